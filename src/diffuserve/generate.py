"""`diffuserve generate` (one-shot generation to files) and `diffuserve plan` (print the plan)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import ConfigError
from diffuserve.executor.worker import plan_calls
from diffuserve.sampling import SamplingParams, build_sampling_params

INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT)."""


def _file_stem(prompt: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")[:48]
    return stem or "image"


def chunk_rows(params: list[SamplingParams], max_rows: int | None) -> list[list[tuple[int, int, SamplingParams]]]:
    """Pipeline calls for the prompts: (prompt index, first row, part) per call, at most `max_rows` rows
    each (the engine's `plan_calls`); None runs one prompt, all its rows, per call."""
    if max_rows is None:
        return [[(i, 0, p)] for i, p in enumerate(params)]
    return plan_calls(params, max_rows)


def output_names(prompts: list[str], n: int, stem: str | None) -> list[list[str]]:
    """File stems per prompt and output: STEM for a single output, else STEM_<prompt i>_<output j>.

    STEM is --output-file-name, or one derived from each prompt; the suffixes are the same either way.
    Derived stems of equal prompts would collide, so they always carry the suffix too.
    """
    single = len(prompts) == 1 and n == 1
    return [[(stem or _file_stem(prompt)) + ("" if single else f"_{i}_{j}") for j in range(n)]
            for i, prompt in enumerate(prompts)]


def _encoded(params: SamplingParams, output: Any) -> list[bytes]:
    """A request's outputs as file bytes: MP4 per video, or the chosen image format per image."""
    if params.output_format == "mp4":
        from diffuserve.media.video import encode_mp4

        return [encode_mp4(frames, params.fps) for frames in output.videos]
    from diffuserve.media.images import encode_image

    return [encode_image(image, params.output_format, params.output_quality) for image in output.images]


def _check_applicable(values: dict[str, Any], video: bool, family: str) -> None:
    """Flags that mean nothing for this model are errors naming the flag, never silently ignored."""
    if not video:
        for key in ("num_frames", "fps"):
            if values.get(key) is not None:
                raise ConfigError(f"--{key.replace('_', '-')}: the served model ({family}) makes images; "
                                  "this flag applies to video models only. Drop it.")
    elif values.get("output_format") not in (None, "mp4"):
        raise ConfigError(f"--output-format {values['output_format']}: the served model ({family}) makes videos, "
                          "which are always written as mp4. Drop the flag.")


def _warn_truncated(pipeline: Any, prompts: list[str], negative_prompt: str | None) -> None:
    """Say when a prompt is longer than a text encoder takes (it runs cut off, as in `serve`), counted by the
    model's token owner as `serve` counts."""
    owner = pipeline.describe_model().prompt_tokens
    if owner is None:
        return
    for i, prompt in enumerate(prompts):
        for found in owner.count({"prompt": prompt, "negative_prompt": negative_prompt}).truncations:
            logging.getLogger("diffuserve").warning("--prompt #%d: %s", i, found.message)


def generate(args: ServerArgs, values: dict[str, Any]) -> int:
    from diffuserve.launch.root import open_pipeline
    from diffuserve.launch.setup import resolve_model_path

    prompts = values.get("prompt")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts and values.get("image_path"):
        prompts = [""]  # a mesh model is conditioned on the image alone
    if not prompts:
        raise ConfigError("--prompt is required: give it on the command line (repeat it for several prompts) "
                          "or as `prompt` (a string or a list) in --config.")
    stem = values.get("output_file_name")
    if stem is not None and (Path(stem).name != stem or stem in ("", ".", "..")):
        # Files go into --output-path only: a name may not climb out of it or name another folder.
        raise ConfigError(f"--output-file-name: {stem!r} must be a plain file name without folders; use --output-path for the folder.")
    n = values.get("num_outputs_per_prompt", 1)
    if n < 1:
        raise ConfigError("--num-outputs-per-prompt must be >= 1.")
    args.validate()
    model_path = resolve_model_path(args)
    from diffuserve.models.registry import resolve as resolve_model

    spec = resolve_model(model_path, model_id=args.model_id, backend=args.backend)
    if spec.family != "unknown":  # known from model_index.json alone: refuse before loading any weight
        _check_applicable(values, spec.output_kind == "video", spec.family)
    pipeline, close = open_pipeline(args)
    try:
        return _generate(args, values, pipeline, prompts, n, stem)
    finally:
        close()


def _generate(args: ServerArgs, values: dict[str, Any], pipeline: Any, prompts: list[str], n: int,
              stem: str | None) -> int:
    from tqdm import tqdm

    model = pipeline.describe_model()
    if model.output_kind == "mesh":
        return _generate_mesh(values, pipeline, stem)
    video = model.output_kind == "video"
    _check_applicable(values, video, model.family)
    params = [
        build_sampling_params(
            model,
            prompt=prompt,
            negative_prompt=values.get("negative_prompt"),
            width=values.get("width") or None,
            height=values.get("height") or None,
            num_inference_steps=values.get("num_inference_steps") or None,
            guidance_scale=values.get("guidance_scale"),
            true_cfg_scale=values.get("true_cfg_scale"),
            seed=values.get("seed", 0) + i,
            n=n,
            num_frames=(values.get("num_frames") or None) if video else None,
            fps=values.get("fps") or None,
            output_format="mp4" if video else values.get("output_format", "png"),
        )
        for i, prompt in enumerate(prompts)
    ]
    _warn_truncated(pipeline, prompts, values.get("negative_prompt"))
    # --batching-max-size bounds the rows of every pipeline call in dynamic mode (as in `serve`);
    # singleton mode runs one prompt (all its n rows) per call.
    max_rows = args.batching_max_size if args.batching_mode == "dynamic" else None
    names = output_names(prompts, n, stem)
    out_dir = Path(values.get("output_path") or "outputs")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    progress = [0, params[0].num_inference_steps]
    try:
        for call in chunk_rows(params, max_rows):
            steps = call[0][2].num_inference_steps
            progress[:] = [0, steps]

            def step(i: int, total: int) -> None:
                progress[:] = [i + 1, total]
                bar.update(1)

            with tqdm(total=steps, desc=f"denoising {sum(p.n for _, _, p in call)} row(s)", unit="step") as bar:
                result = pipeline.run([p for _, _, p in call], on_step=step)
            for (prompt_index, first_row, part), output in zip(call, result.outputs, strict=True):
                for j, blob in enumerate(_encoded(part, output)):
                    path = out_dir / f"{names[prompt_index][first_row + j]}.{part.output_format}"
                    path.write_bytes(blob)
                    written.append(path)
    except KeyboardInterrupt:
        import sys

        print(f"\ninterrupted at step {progress[0]}/{progress[1]}; wrote {len(written)} files to {out_dir}",
              file=sys.stderr)
        return INTERRUPTED
    for path in written:
        print(path)
    return 0


def _generate_mesh(values: dict[str, Any], pipeline: Any, stem: str | None) -> int:
    """Mesh families: `--image-path` -> one mesh file (.glb unless --output-format obj)."""
    from diffuserve.media.meshes import MESH_FORMATS, encode_mesh

    image_path = values.get("image_path")
    if not image_path:
        raise ConfigError("--image-path is required: this model (image-to-3D) reconstructs the object in an image.")
    output_format = values.get("output_format") or "glb"
    if output_format not in MESH_FORMATS:
        raise ConfigError(f"--output-format {output_format}: a mesh model writes glb or obj.")
    model = pipeline.describe_model()
    params = build_sampling_params(model, prompt="", num_inference_steps=values.get("num_inference_steps") or None,
                                   guidance_scale=values.get("guidance_scale"), seed=values.get("seed", 0),
                                   output_format=output_format, image_inputs=(Path(image_path).read_bytes(),))
    mesh = pipeline.run([params]).outputs[0].meshes[0]
    if mesh.error:
        raise ConfigError(f"no mesh for {image_path}: {mesh.error}")
    out_dir = Path(values.get("output_path") or "outputs")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem or Path(image_path).stem}.{output_format}"
    path.write_bytes(encode_mesh(mesh.vertices, mesh.faces, output_format))
    print(path)
    return 0


def print_plan(values: dict[str, Any]) -> int:
    """Resolve and print the plan from JSON and safetensors headers only (no weights loaded)."""
    from diffuserve.config.argparse_dataclass import dataclass_from_namespace
    from diffuserve.config.deployment import DeploymentArgs, format_plan
    from diffuserve.hardware import describe_hardware, detect_hardware
    from diffuserve.launch.setup import resolve_deployment, resolve_dtype

    deployment = dataclass_from_namespace(DeploymentArgs, values)
    if values.get("model_path"):
        model_path = Path(values["model_path"])
    else:
        from diffuserve.models.tiny import ensure_default_model

        model_path = ensure_default_model()
    if values.get("gpu_memory_gib") is not None:
        hardware = describe_hardware(deployment.num_gpus or 1, values["gpu_memory_gib"])
    else:
        hardware = detect_hardware("auto")
    device_kind = "cuda" if hardware.gpus else "cpu"
    dtype = resolve_dtype(values.get("dtype", "auto"), device_kind)
    plan = resolve_deployment(deployment, model_path, model_id=values.get("model_id"), dtype=dtype, hardware=hardware)
    print(json.dumps(plan.to_dict(), indent=2) if values.get("json") else format_plan(plan))
    return 0
