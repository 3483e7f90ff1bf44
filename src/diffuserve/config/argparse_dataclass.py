"""Build argparse flags from dataclass fields, and dataclasses back from parsed namespaces.

Every config dataclass declares its flags once: the field name gives the flag (`--max-queue-size`),
`metadata` gives help text, choices, aliases, nargs and the `--help` group. The CLI, the `--config`
file loader and the README all read the same declaration, so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def parse_bool(text: str | bool) -> bool:
    """`true|false|1|0|yes|no|on|off` -> bool; anything else is an argparse error naming the value."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) of a field annotation such as `int | None` or `list[str]`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else (str, False)
    if origin in (list, tuple):
        inner = typing.get_args(annotation)
        return (inner[0] if inner else str), True
    return annotation, False


def add_dataclass_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    default_group: str,
    skip: frozenset[str] = frozenset(),
) -> dict[str, argparse._ArgumentGroup]:
    """Add one flag per field of `cls`; groups come from `metadata["group"]` (else `default_group`)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or field.metadata.get("cli") is False:
            continue
        meta = field.metadata
        title = meta.get("group", default_group)
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        scalar, is_list = _base_type(hints[field.name])
        names = [flag_name(field.name), *meta.get("aliases", [])]
        kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": meta.get("help", "")}
        default = field.default if field.default is not dataclasses.MISSING else None
        if default not in (None, dataclasses.MISSING) and "default: " not in kwargs["help"]:
            kwargs["help"] += f" (default: {default})"
        if scalar is bool:
            # `--flag` alone means true; `--flag false` turns an on-by-default switch off.
            kwargs.update(nargs="?", const=True, type=parse_bool, metavar="true|false")
        elif is_list:
            kwargs.update(nargs=meta.get("nargs", "+"), type=scalar)
        else:
            kwargs["type"] = scalar
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        group.add_argument(*names, **kwargs)
    return groups


def dataclass_from_namespace(cls: type, namespace: argparse.Namespace | dict[str, Any]) -> Any:
    """Instantiate `cls` from the parsed values it has fields for; missing ones keep their defaults."""
    values = vars(namespace) if isinstance(namespace, argparse.Namespace) else namespace
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def field_names(*classes: type) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls)}
