"""Build argparse flags from config dataclass fields, and dataclasses back from parsed values.

Every config dataclass declares its flags once (the vLLM pattern): a field made with `flag(...)` owns
its default, its `--help` text and group, and the commands that take it. The flag name and the `--config`
key come from the field's *dest*: the field name, or `metadata["dest"]` where the owner's own name is
shorter (`BatchingConfig.max_size` is `--batching-max-size`). The CLI, the `--config` file checks and
`ServerArgs`' flat keywords all read that one declaration, so they cannot drift apart.

Field metadata read here:
  help, group        the `--help` text and section title;
  commands           the subcommands that take the flag (else the class' `COMMANDS`, else every command);
  per_command        {command: {key: value}} overrides of help / group / choices for one command
                     (a group of None puts the flag in argparse's plain "options" section);
  dest               the flat name, when it differs from the field name;
  cli                False: a field that is not a flag (filled by the code, not the user);
  choices, aliases, nargs, metavar   as for `add_argument`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from diffuserve.errors import ConfigError

COMMANDS = ("serve", "generate", "plan")
"""The subcommands whose flags come from config dataclasses."""


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


def flag(
    default: Any,
    help: str,
    group: str,
    *,
    commands: Sequence[str] | None = None,
    dest: str | None = None,
    per_command: dict[str, dict[str, Any]] | None = None,
    **meta: Any,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring for the metadata)."""
    metadata: dict[str, Any] = {"help": help, "group": group, **meta}
    if commands is not None:
        metadata["commands"] = tuple(commands)
    if dest is not None:
        metadata["dest"] = dest
    if per_command:
        metadata["per_command"] = per_command
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_flags(checks: Iterable[tuple[bool, str, str]]) -> None:
    """Raise `ConfigError("FLAG: MESSAGE.")` for the first (failed, flag, message) that failed."""
    for failed, name, message in checks:
        if failed:
            raise ConfigError(f"{name}: {message}.")


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def flag_dest(field: dataclasses.Field) -> str:
    """The flat name of a flag field: argparse dest, `--config` key and `ServerArgs(...)` keyword."""
    return field.metadata.get("dest", field.name)


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line flags."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli") is not False]


def flag_commands(cls: type, field: dataclasses.Field) -> tuple[str, ...]:
    """The subcommands that take this flag: its own `commands`, else the class' `COMMANDS`, else all."""
    return tuple(field.metadata.get("commands") or getattr(cls, "COMMANDS", COMMANDS))


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


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _argument_kwargs(field: dataclasses.Field, annotation: Any, meta: dict[str, Any]) -> dict[str, Any]:
    # Defaults stay with the dataclass (argparse.SUPPRESS), so a --config file can give any flag and
    # the command line still wins; `--help` shows the dataclass default.
    kwargs: dict[str, Any] = {"dest": flag_dest(field), "default": argparse.SUPPRESS, "help": meta.get("help", "")}
    default = _default_of(field)
    if default is not None and not isinstance(default, list) and "default: " not in kwargs["help"]:
        kwargs["help"] += f" (default: {default})"
    scalar, is_list = _base_type(annotation)
    if scalar is bool:
        # `--flag` alone means true; `--flag false` turns an on-by-default switch off.
        kwargs.update(nargs="?", const=True, type=parse_bool, metavar="true|false")
    elif is_list:
        kwargs.update(nargs=meta.get("nargs", "+"), type=scalar)
    else:
        # A str-valued enum (BatchingMode) parses as its plain value; the dataclass turns it into the member.
        kwargs["type"] = str if isinstance(scalar, type) and issubclass(scalar, str) else scalar
    for key in ("choices", "metavar"):
        if key in meta:
            kwargs[key] = list(meta[key]) if key == "choices" else meta[key]
    return kwargs


def add_dataclass_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    command: str,
    groups: dict[str | None, Any] | None = None,
) -> dict[str | None, Any]:
    """Add one flag per field of `cls` that `command` takes. `groups` (title -> argument group) is shared
    between calls so that several dataclasses fill the same `--help` sections; a title not in it yet gets a
    new section. Returns `groups`."""
    groups = {} if groups is None else groups
    groups.setdefault(None, parser)
    hints = typing.get_type_hints(cls)
    for field in flag_fields(cls):
        if command not in flag_commands(cls, field):
            continue
        meta = {**field.metadata, **field.metadata.get("per_command", {}).get(command, {})}
        title = meta.get("group")
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        names = [flag_name(flag_dest(field)), *meta.get("aliases", [])]
        groups[title].add_argument(*names, **_argument_kwargs(field, hints[field.name], meta))
    return groups


def add_groups(parser: argparse.ArgumentParser, titles: Iterable[str]) -> dict[str | None, Any]:
    """Argument groups in this `--help` order (a group that stays empty is not shown)."""
    groups: dict[str | None, Any] = {None: parser}
    for title in titles:
        groups[title] = parser.add_argument_group(title)
    return groups


def flag_values(cls: type, values: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """{field name: value} of the flags of `cls` present in parsed `values` (keyed by dest)."""
    values = vars(values) if isinstance(values, argparse.Namespace) else values
    return {f.name: values[flag_dest(f)] for f in flag_fields(cls) if flag_dest(f) in values}


def dataclass_from_namespace(cls: type, namespace: argparse.Namespace | dict[str, Any]) -> Any:
    """Instantiate `cls` from the parsed values it has flags for; missing ones keep their defaults."""
    return cls(**flag_values(cls, namespace))
