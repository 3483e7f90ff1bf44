"""The `diffuserve` command: serve | generate | plan | bench | make-tiny | compat.

Flags are built from the config dataclasses (ServerArgs, DeploymentArgs), so `--help`, `--config`
files and the code share one declaration. Heavy imports (torch, diffusers) happen only in the
subcommand that needs them, so `--help` and `plan` start fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from pathlib import Path
from typing import Any

from diffuserve import __version__
from diffuserve.config.argparse_dataclass import (
    _base_type,
    add_dataclass_arguments,
    dataclass_from_namespace,
    parse_bool,
)
from diffuserve.config.deployment import DeploymentArgs
from diffuserve.config.server_args import ServerArgs, load_config_file
from diffuserve.errors import ConfigError, DiffuserveError

_SERVER_ONLY = frozenset({
    "host", "port", "enable_warmup", "warmup_steps", "shutdown_timeout_s", "max_inference_steps",
    "max_image_side", "url_store_max_images", "max_queue_size", "request_timeout_s", "max_request_bytes",
    "max_prompt_chars", "max_upload_bytes", "api_key", "allow_remote_urls", "batching_delay_ms", "batching_config",
    "enable_batching_metrics", "batching_mode",
    "output_dir", "result_ttl_s", "max_output_bytes", "result_sweep_interval_s",
})
"""ServerArgs fields that mean nothing to a one-shot `generate`."""

_GEN_DEFAULTS = ("width", "height", "num_inference_steps", "guidance_scale")


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="JSON or YAML file whose keys are flag names (e.g. {\"port\": 8000}); command-line flags win.")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffuserve",
        description="Serve diffusion models (FLUX and any diffusers checkpoint) behind an OpenAI-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"diffuserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="Run the HTTP server.", description="Run the OpenAI-compatible HTTP server.")
    _add_config_flag(serve)
    add_dataclass_arguments(serve, ServerArgs, default_group="Server")
    add_dataclass_arguments(serve, DeploymentArgs, default_group="Deployment")

    gen = sub.add_parser("generate", help="Generate images once and write them to files.",
                         description="Load the model, generate, write image (or MP4) files, print their paths.")
    _add_config_flag(gen)
    g = gen.add_argument_group("Generation")
    g.add_argument("--prompt", action="append", required=True, help="Prompt; repeat the flag for several prompts (batched by --batching-max-size).")
    g.add_argument("--negative-prompt", default=None, help="Negative prompt (true CFG when --true-cfg-scale > 1).")
    g.add_argument("--width", type=int, default=None, help="Width in pixels (default: the model's).")
    g.add_argument("--height", type=int, default=None, help="Height in pixels (default: the model's).")
    g.add_argument("--num-inference-steps", type=int, default=None, help="Denoising steps (default: the model's).")
    g.add_argument("--guidance-scale", type=float, default=None, help="Guidance scale (default: the model's).")
    g.add_argument("--true-cfg-scale", type=float, default=1.0, help="True CFG scale (default: 1.0, off).")
    g.add_argument("--seed", type=int, default=0, help="Seed of the first prompt; prompt i uses seed+i (default: 0).")
    g.add_argument("--num-outputs-per-prompt", type=int, default=1, help="Images per prompt (default: 1).")
    g.add_argument("--output-path", default="outputs", help="Folder for the files (created; default: outputs).")
    g.add_argument("--output-file-name", default=None, help="File name stem (default: derived from the prompt).")
    g.add_argument("--output-format", default="png", choices=["png", "jpeg", "webp"], help="Image format (default: png; video models write mp4).")
    g.add_argument("--num-frames", type=int, default=None, help="Video models: frames per video (default: the model's).")
    g.add_argument("--fps", type=int, default=None, help="Video models: frames per second of the MP4 (default: the model's).")
    add_dataclass_arguments(gen, ServerArgs, default_group="Model", skip=_SERVER_ONLY)
    gen.add_argument_group("Dynamic batching").add_argument(
        "--batching-mode", dest="batching_mode", choices=["singleton", "dynamic"], default=argparse.SUPPRESS,
        help="With several --prompt flags: dynamic runs them in batches of --batching-max-size outputs.")
    add_dataclass_arguments(gen, DeploymentArgs, default_group="Deployment")

    plan = sub.add_parser("plan", help="Print the resolved deployment plan without loading weights.",
                          description="Resolve the deployment plan for a checkpoint and hardware; print it and why.")
    plan.add_argument("--model-path", default=None, help="Checkpoint folder (default: the embedded model).")
    plan.add_argument("--model-id", default=None, help="Family hint (e.g. FLUX.1-dev) when model_index.json is ambiguous.")
    plan.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="Weights dtype used to size components (default: auto = bfloat16 on GPUs).")
    plan.add_argument("--gpu-memory-gib", type=float, default=None, help="Describe GPUs with this much free memory each instead of detecting.")
    plan.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    add_dataclass_arguments(plan, DeploymentArgs, default_group="Deployment")

    tiny = sub.add_parser("make-tiny", help="Write a tiny random-weight checkpoint (offline).",
                          description="Write a tiny diffusers-format checkpoint with random weights and offline tokenizers.")
    tiny.add_argument("--family", default="flux", help="Model family (default: flux).")
    tiny.add_argument("--output", required=True, help="Output folder.")
    tiny.add_argument("--preset", default="tiny", help="tiny (~72k-parameter transformer) or 36m (benchmarks).")

    compat = sub.add_parser("compat", help="Build every tiny checkpoint and write the compatibility grid from real runs.",
                            description="For each image family's tiny checkpoint: T2I, I2I, batching, residency and "
                                        "diffusers parity through the serving path; writes the grid as Markdown.")
    compat.add_argument("--output", default=None, help="Markdown file to write the grid to (default: print only).")
    compat.add_argument("--families", default=None,
                        help="Comma-separated make-tiny names to check (default: every image family).")
    compat.add_argument("--quick", action="store_true",
                        help="Only the cheap columns (T2I, I2I, Batching); Residency and Matches diffusers show -.")

    bench = sub.add_parser("bench", help="Benchmark a running server over HTTP.",
                           description="Drive a running server with concurrent requests and report throughput and latency.")
    from diffuserve.bench import add_bench_arguments

    add_bench_arguments(bench)
    return parser


def _coerce(cls: type, name: str, value: Any) -> Any:
    """A --config value -> the field's type (YAML/JSON may give strings for booleans and numbers)."""
    scalar, is_list = _base_type(typing.get_type_hints(cls)[name])
    if is_list:
        items = value if isinstance(value, list) else str(value).split()
        return [scalar(v) for v in items]
    if value is None:
        return None
    if scalar is bool:
        return parse_bool(value)
    return scalar(value)


def _merge_config_file(ns: argparse.Namespace) -> dict[str, Any]:
    """Values from --config (if any) under those given on the command line."""
    values = {k: v for k, v in vars(ns).items() if k not in ("command", "config")}
    if not getattr(ns, "config", None):
        return values
    known = {f.name: cls for cls in (ServerArgs, DeploymentArgs) for f in dataclasses.fields(cls)
             if f.metadata.get("cli") is not False}
    from_file = load_config_file(ns.config, set(known))
    merged = {name: _coerce(known[name], name, value) for name, value in from_file.items()}
    merged.update(values)
    return merged


def _server_args(values: dict[str, Any], config: str | None) -> ServerArgs:
    args = dataclass_from_namespace(ServerArgs, values)
    args.config = config
    args.deployment = dataclass_from_namespace(DeploymentArgs, values)
    return args


def _setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "bench":
            from diffuserve.bench import run_bench

            return run_bench(ns)
        if ns.command == "make-tiny":
            from diffuserve.models.tiny import build_tiny_checkpoint

            path = build_tiny_checkpoint(ns.family, Path(ns.output), preset=ns.preset)
            print(path)
            return 0
        if ns.command == "compat":
            from diffuserve.compat import render, run_compat

            names = [n.strip() for n in ns.families.split(",") if n.strip()] if ns.families else None
            print(render(run_compat(names, Path(ns.output) if ns.output else None, quick=ns.quick)))
            return 0
        values = _merge_config_file(ns)
        if ns.command == "plan":
            from diffuserve.generate import print_plan

            return print_plan(values)
        args = _server_args(values, getattr(ns, "config", None))
        _setup_logging(args.log_level)
        if ns.command == "serve":
            from diffuserve.server.runner import serve

            return serve(args)
        from diffuserve.generate import generate

        return generate(args, values)
    except DiffuserveError as exc:
        kind = "configuration error" if isinstance(exc, ConfigError) else "error"
        print(f"diffuserve {ns.command}: {kind}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
