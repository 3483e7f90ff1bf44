"""The `diffuserve` command: serve | generate | plan | bench | make-tiny | make-tiny-lora | compat | calibrate-cache.

Flags are built from the config dataclasses (the sub-configs ServerArgs composes, and DeploymentArgs):
each field says which subcommands take it, so `--help`, `--config` files and the code share one
declaration. Heavy imports (torch, diffusers) happen only in the subcommand that needs them, so
`--help` and `plan` start fast.
"""

# ruff: noqa: E402 - the SIGINT handler below goes in before this module's imports

from __future__ import annotations

import os
import signal
import sys


def _command_of(argv: list[str] | None) -> str:
    """The subcommand named in `argv` (before parsing, for the Ctrl-C line), else ''."""
    return next((word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")), "")


def _interrupted_while_starting(_signum: int, _frame: object) -> None:
    os.write(2, f"{' '.join(filter(None, ('diffuserve', _command_of(None))))}: interrupted\n".encode())
    os._exit(130)  # EXIT_INTERRUPTED: nothing has started that could need stopping


_STARTING_HANDLER = __name__ == "__main__" or os.path.basename(sys.argv[0] or "") == "diffuserve"
"""As the program (`python -m diffuserve.cli`, the `diffuserve` script), Ctrl-C during this module's imports (0.1-0.3 s)
is one line and exit 130, not a traceback, until `main` catches KeyboardInterrupt. A library import changes nothing."""
if _STARTING_HANDLER:
    signal.signal(signal.SIGINT, _interrupted_while_starting)

import argparse
import difflib
import functools
import logging
from pathlib import Path
from typing import Any, NoReturn

from diffuserve import __version__, generate_masks
from diffuserve.config.argparse_dataclass import add_dataclass_arguments, add_groups, parse_bool
from diffuserve.config.deployment_args import DeploymentArgs
from diffuserve.config.server_args import GROUP_ORDER, SECTIONS, ServerArgs, load_config_file
from diffuserve.errors import CheckpointError, ConfigError, DiffuserveError, InvalidRequestError

EXIT_OK = 0
EXIT_FAILURE = 1
"""A checkpoint or model that cannot load, or a failure at run time."""
EXIT_USAGE = 2
"""A bad flag, flag value or --config file (argparse's own code for usage errors)."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C / a forced shutdown): 128 + SIGINT, the shell convention."""


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for unknown flags, after a usage line short enough to leave it in sight."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage()
        if usage.count("\n") > 2:  # a subcommand's full usage lists every flag (76 lines for `serve`)
            usage = f"usage: {self.prog} [FLAGS]  (every flag: {self.prog} --help)\n"
        sys.stderr.write(usage)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def unknown_flags(self, extras: list[str]) -> NoReturn:
        flags = sorted(s for a in self._actions for s in a.option_strings if s.startswith("--"))
        hints = {}
        for extra in extras:
            word = extra.split("=", 1)[0]
            close = difflib.get_close_matches(word, flags, n=1, cutoff=0.6) if word.startswith("-") else []
            if close:
                hints[word] = close[0]
        # The suggestion last, where the eye lands: "... --batching-max-szie 3 (did you mean --batching-max-size?)".
        if len(hints) == 1 and sum(extra.startswith("-") for extra in extras) == 1:
            hint = f" (did you mean {next(iter(hints.values()))}?)"
        else:
            hint = f" (did you mean {', '.join(f'{c} for {w}' for w, c in hints.items())}?)" if hints else ""
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to every flag that has a default (lists as 1,4,8; None left out)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or "default" in text:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _add_config_flag(parser: argparse.ArgumentParser, example: str = '{"port": 8000}') -> None:
    text = f"JSON or YAML file whose keys are flag names (e.g. {example}); command-line flags win."
    parser.add_argument("--config", default=None, metavar="FILE", help=text.replace("%", "%%"))


def _add_config_arguments(parser: argparse.ArgumentParser, command: str, *, deployment: bool = True) -> dict:
    """The flags of the config dataclasses that `command` takes, in their `--help` sections."""
    groups = add_groups(parser, GROUP_ORDER)
    for section in SECTIONS.values():
        add_dataclass_arguments(parser, section, command=command, groups=groups)
    if deployment:
        add_dataclass_arguments(parser, DeploymentArgs, command=command, groups=groups)
    return groups


def _add_generate(sub: Any) -> None:
    """`generate`: its own inputs (prompts, sizes, input images, outputs), then the config dataclasses' flags."""
    gen = sub.add_parser(
        "generate",
        help="Generate images or videos once and write them to files.",
        description="Load the model, generate, write image (or MP4) files, print their paths.",
    )
    _add_config_flag(gen, '{"prompt": "a red fox", "seed": 1}')
    g = gen.add_argument_group("Generation")
    # Defaults are applied by generate() (argparse.SUPPRESS here), so a --config file can give any of
    # these and the command line still wins.
    add = functools.partial(g.add_argument, default=argparse.SUPPRESS)
    add(
        "--prompt",
        action="append",
        help="Prompt; repeat the flag for several prompts (batched by --batching-max-size). "
        "Required here or as `prompt` (a string or a list) in --config.",
    )
    add("--negative-prompt", help="Negative prompt (true CFG when --true-cfg-scale > 1).")
    add("--width", type=int, help="Width in pixels (default: the model's).")
    add("--height", type=int, help="Height in pixels (default: the model's).")
    add("--num-inference-steps", type=int, help="Denoising steps (default: the model's).")
    add("--guidance-scale", type=float, help="Guidance scale (default: the model's).")
    add("--true-cfg-scale", type=float, help="True CFG scale (default: 1.0, off).")
    add("--seed", type=int, help="Seed of the first prompt; prompt i uses seed+i (default: 0).")
    add("--num-outputs-per-prompt", type=int, help="Images per prompt (default: 1).")
    add("--output-path", help="Folder for the files (created; default: outputs).")
    add(
        "--output-file-name",
        help="File name stem (default: derived from the prompt). Files are STEM.EXT for one "
        "output, else STEM_<prompt index>_<output index>.EXT, with or without this flag.",
    )
    add(
        "--output-format",
        choices=["png", "jpeg", "webp", "glb", "obj"],
        help="Image models: png, jpeg or webp "
        "(default: png); mesh models (Hunyuan3D-2): glb or obj (default: glb). Video models always write mp4.",
    )
    add("--num-frames", type=int, help="Video models only: frames per video (default: the model's).")
    add("--fps", type=int, help="Video models only: frames per second of the MP4 (default: the model's).")
    flag = functools.partial(add, nargs="?", const=True, type=parse_bool, metavar="true|false")
    flag("--generate-audio", help="Models with sound (LTX-2) only: false writes silent MP4s (default: with sound).")
    add(
        "--image-path",
        action="append",
        metavar="PATH",
        help="Input image (PNG, JPEG or WebP) for edit, "
        "image-to-image, image-to-video and layered models; repeat it for models that take several. Checked as "
        "POST /v1/images/edits checks `image` (and /v1/videos `input_reference`), before the model loads. Mesh models "
        "(Hunyuan3D-2): the one image of the object to reconstruct in 3D (no --prompt needed).",
    )
    add(
        "--strength",
        type=float,
        help="With --image-path on an image model: the share of the schedule re-noised "
        "from the input image, in (0, 1] (default: 0.6, as POST /v1/images/edits).",
    )
    generate_masks.add_mask_flags(add)  # --mask-path, --padding-mask-crop
    _add_config_arguments(gen, "generate")


def _add_tool_commands(sub: Any) -> None:
    """`compat`, `calibrate-cache` and `bench`: the tools (diffuserve/tools/), each with its own flags."""
    compat = sub.add_parser(
        "compat",
        help="Build every tiny checkpoint and write the compatibility grid from real runs.",
        description="For each image family's tiny checkpoint: T2I, I2I, batching, residency and "
        "diffusers parity through the serving path; writes the grid as Markdown.",
    )
    compat.add_argument("--output", default=None, help="Markdown file to write the grid to (default: print only).")
    compat.add_argument(
        "--families", default=None, help="Comma-separated make-tiny names to check (default: every image family)."
    )
    compat.add_argument(
        "--quick",
        action="store_true",
        help="Only the cheap columns (T2I, I2I, Batching); Residency and Matches diffusers show -.",
    )

    calibrate = sub.add_parser(
        "calibrate-cache",
        help="Write a checkpoint's MagCache ratios (docs/step-caches.md).",
        description="Generate a few prompts with every step computed and write the magnitude "
        "ratios that --step-cache-calibration loads for magcache.",
    )
    from diffuserve.tools.calibrate_cache import add_arguments as add_calibrate_arguments

    add_calibrate_arguments(calibrate)

    bench = sub.add_parser(
        "bench",
        help="Benchmark a running server over HTTP.",
        formatter_class=_DefaultsFormatter,
        description="Drive a running server with concurrent requests and report throughput and latency.",
    )
    from diffuserve.tools.bench import add_bench_arguments

    add_bench_arguments(bench)


def _add_make_tiny_lora(sub: Any) -> None:
    """`make-tiny-lora`: a random adapter in diffusers' format for a tiny checkpoint (lora/tiny.py)."""
    lora = sub.add_parser(
        "make-tiny-lora",
        help="Write a random LoRA adapter for a tiny checkpoint (offline).",
        description="Write a random LoRA adapter in diffusers' format (pytorch_lora_weights."
        "safetensors), loadable by pipe.load_lora_weights and --lora-modules.",
    )
    lora.add_argument("--checkpoint", required=True, help="The tiny checkpoint folder (make-tiny --family flux).")
    lora.add_argument("--output", required=True, help="Output folder.")
    lora.add_argument("--rank", type=int, default=4, help="LoRA rank (default: 4).")
    lora.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank, scaling 1).")
    lora.add_argument("--seed", type=int, default=0, help="Seed of the random weights (default: 0).")
    lora.add_argument(
        "--targets",
        default="to_q,to_k,to_v,to_out.0",
        help="Comma-separated module names to adapt (default: to_q,to_k,to_v,to_out.0).",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="diffuserve",
        description="Serve diffusion models (FLUX and any diffusers checkpoint) behind an OpenAI-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"diffuserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    serve = sub.add_parser("serve", help="Run the HTTP server.", description="Run the OpenAI-compatible HTTP server.")
    _add_config_flag(serve)
    _add_config_arguments(serve, "serve")

    _add_generate(sub)

    _add_config_flag(
        plan := sub.add_parser(
            "plan",
            help="Print the resolved deployment plan without loading weights.",
            description="Resolve the deployment plan for a checkpoint and hardware; print it and why.",
        ),
        '{"model_path": "ckpt", "num_gpus": 2}',
    )
    groups = _add_config_arguments(plan, "plan", deployment=False)
    add = functools.partial(plan.add_argument, default=argparse.SUPPRESS)
    add("--gpu-memory-gib", type=float, help="Describe GPUs with this much free memory each instead of detecting.")
    add("--json", action="store_true", help="Print the plan as JSON.")
    add_dataclass_arguments(plan, DeploymentArgs, command="plan", groups=groups)

    tiny = sub.add_parser(
        "make-tiny",
        help="Write a tiny random-weight checkpoint (offline).",
        description="Write a tiny diffusers-format checkpoint with random weights and offline tokenizers.",
    )
    from diffuserve.family_spec import tiny_builds

    tiny_families = sorted(tiny_builds())
    tiny.add_argument(
        "--family",
        default="flux",
        choices=tiny_families,
        help=f"Model family: {', '.join(tiny_families)} (default: flux).",
    )
    tiny.add_argument("--output", required=True, help="Output folder.")
    tiny.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "36m"],
        help="tiny (~72k-parameter transformer) or 36m (benchmarks) (default: tiny).",
    )

    _add_make_tiny_lora(sub)

    _add_tool_commands(sub)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, _Parser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _config_actions(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags a --config file may set for one subcommand: dest -> action."""
    return {a.dest: a for a in sub._actions if a.option_strings and a.dest not in ("help", "config", "version")}


def _allowed(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    if isinstance(action, argparse._StoreTrueAction) or getattr(action.type, "__name__", "") == "parse_bool":
        return "true or false"
    kind = getattr(action.type, "__name__", "str")
    return {"int": "an integer", "float": "a number", "str": "a string"}.get(kind, f"a value {kind} accepts")


def _coerce(action: argparse.Action, value: Any, where: str) -> Any:
    """A --config value -> what the command-line flag would have parsed, or the same error it gives."""
    flag = max(action.option_strings, key=len)

    def bad(reason: str | None = None) -> NoReturn:
        raise ConfigError(f"{where}: {value!r} is not valid for {flag}: expected {reason or _allowed(action)}.")

    def one(item: Any) -> Any:
        if isinstance(item, (dict, list)) or (isinstance(item, bool) and action.type in (int, float)):
            bad()
        if isinstance(item, float) and action.type is int and not item.is_integer():
            bad()
        text = str(item).lower() if isinstance(item, bool) else str(item)
        try:
            converted = action.type(text) if action.type is not None else text
        except argparse.ArgumentTypeError as exc:
            bad(str(exc).removeprefix("expected "))
        except (TypeError, ValueError):
            bad()
        if action.choices is not None and converted not in action.choices:
            bad()
        return converted

    if isinstance(action, argparse._StoreTrueAction):
        return one(value) if action.type else _parse_flag_bool(value, bad)
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        # A string is one prompt (`--prompt` appends), but a space-separated list for nargs flags, as
        # the shell would split `--component-residency dit=resident vae=resident`.
        split = isinstance(value, str) and not isinstance(action, argparse._AppendAction)
        items = value.split() if split else (value if isinstance(value, list) else [value])
        if not items:
            bad("at least one value")
        return [one(v) for v in items]
    if action.nargs == "?" and value is None:
        return action.const
    return one(value)


def _parse_flag_bool(value: Any, bad: Any) -> bool:
    try:
        return parse_bool(value)
    except argparse.ArgumentTypeError:
        bad()


def _merge_config_file(ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """Values from --config (if any) under those given on the command line, checked against the flags
    of this subcommand: a key of another command is an error naming that command."""
    values = {k: v for k, v in vars(ns).items() if k not in ("command", "config")}
    if not getattr(ns, "config", None):
        return values
    subs = _subparsers(parser or _build_parser())
    actions = _config_actions(subs[ns.command])
    elsewhere: dict[str, str] = {}
    for name, other in subs.items():
        if name != ns.command:
            for dest in _config_actions(other):
                elsewhere.setdefault(dest, name)
    from_file = load_config_file(ns.config, set(actions), elsewhere=elsewhere, command=ns.command)
    merged = {
        name: _coerce(actions[name], value, f"--config {ns.config}: key {name.replace('_', '-')!r}")
        for name, value in from_file.items()
    }
    merged.update(values)
    return merged


def _server_args(values: dict[str, Any], config: str | None) -> ServerArgs:
    return ServerArgs.from_flags(values, config)


def _make_tiny(ns: argparse.Namespace) -> int:
    """Write the checkpoint; an --output that is a file or cannot be written is one line, exit 2."""
    from diffuserve.models.tiny import build_tiny_checkpoint

    output = Path(ns.output)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output: {ns.output!r} is a file; give a folder (created if missing).")
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".diffuserve-write-check"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--output: cannot write to {ns.output!r} ({exc.strerror or exc}); give a writable folder."
        ) from exc
    print(build_tiny_checkpoint(ns.family, output, preset=ns.preset))
    return 0


def _setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok, 1 a model that cannot load (or a run-time failure), 2 usage and configuration
    errors, 130 interrupted (see EXIT_*; the README lists them)."""
    try:
        if _STARTING_HANDLER and signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # caught below from here on
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before a command's own handling (while parsing, importing, or before `serve` installs its start-up
        # handler): one line, never a traceback.
        print(f"{' '.join(filter(None, ('diffuserve', _command_of(argv))))}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = _build_parser()
    ns, extras = parser.parse_known_args(argv)
    if extras:
        _subparsers(parser)[ns.command].unknown_flags(extras)
    try:
        if ns.command == "bench":
            from diffuserve.tools.bench import run_bench

            return run_bench(ns)
        if ns.command in ("make-tiny", "calibrate-cache"):  # no torchvision fallback notes: we use PIL processors
            from diffuserve.launch.setup import quiet_library_loading

            quiet_library_loading()
        if ns.command == "make-tiny":
            return _make_tiny(ns)
        if ns.command == "make-tiny-lora":
            from diffuserve.lora.tiny import write_random_lora

            print(
                write_random_lora(
                    ns.checkpoint,
                    ns.output,
                    rank=ns.rank,
                    alpha=ns.alpha,
                    seed=ns.seed,
                    targets=tuple(t.strip() for t in ns.targets.split(",") if t.strip()),
                )
            )
            return 0
        if ns.command == "calibrate-cache":
            from diffuserve.tools.calibrate_cache import run as run_calibration

            return run_calibration(ns)
        if ns.command == "compat":
            from diffuserve.tools.compat import render, run_compat

            names = [n.strip() for n in ns.families.split(",") if n.strip()] if ns.families else None
            print(render(run_compat(names, Path(ns.output) if ns.output else None, quick=ns.quick)))
            return 0
        values = _merge_config_file(ns, parser)
        if ns.command == "plan":
            from diffuserve.config.model_args import ModelArgs
            from diffuserve.plan_command import print_plan

            ModelArgs(
                model_path=values.get("model_path"), transformer_path=values.get("transformer_path")
            ).check_files()  # serve's message and exit code (2)

            return print_plan(values)
        args = _server_args(values, getattr(ns, "config", None))
        _setup_logging(args.http.log_level)
        if ns.command == "serve":
            from diffuserve.server.runner import install_startup_signal_handlers, serve

            restore = install_startup_signal_handlers()  # before torch's imports: a signal stops at once, 0 / 130
            try:
                return serve(args)
            finally:
                restore()
        from diffuserve.launch.follower import serve_other_node
        from diffuserve.launch.ranks import is_serving_process

        if not is_serving_process(args):  # generate on another host's ranks: they follow node 0's calls
            return serve_other_node(args)
        from diffuserve.generate import generate

        return generate(args, values)
    except CheckpointError as exc:
        # Before ConfigError (its base): a checkpoint that cannot load is a failed start, not a usage error.
        print(f"diffuserve {ns.command}: error: the model failed to load: {exc.message}", file=sys.stderr)
        return EXIT_FAILURE
    except (ConfigError, InvalidRequestError) as exc:
        # InvalidRequestError here is a `generate` flag the model refuses (a size it cannot make, ...).
        print(f"diffuserve {ns.command}: configuration error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except DiffuserveError as exc:
        print(f"diffuserve {ns.command}: error: {exc.message}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
