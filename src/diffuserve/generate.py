"""`diffuserve generate` (one-shot generation to files) and `diffuserve plan` (print the plan)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import ConfigError
from diffuserve.sampling import SamplingParams, build_sampling_params


def _file_stem(prompt: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")[:48]
    return stem or "image"


def _chunks(params: list[SamplingParams], max_outputs: int) -> list[list[SamplingParams]]:
    """Group prompts into pipeline batches of at most `max_outputs` rows (a prompt's n never splits)."""
    batches: list[list[SamplingParams]] = []
    current: list[SamplingParams] = []
    for p in params:
        if current and sum(q.n for q in current) + p.n > max_outputs:
            batches.append(current)
            current = []
        current.append(p)
    if current:
        batches.append(current)
    return batches


def _encoded(params: SamplingParams, output: Any) -> list[bytes]:
    """A request's outputs as file bytes: MP4 per video, or the chosen image format per image."""
    if params.output_format == "mp4":
        from diffuserve.media.video import encode_mp4

        return [encode_mp4(frames, params.fps) for frames in output.videos]
    from diffuserve.media.images import encode_image

    return [encode_image(image, params.output_format, params.output_quality) for image in output.images]


def generate(args: ServerArgs, values: dict[str, Any]) -> int:
    from tqdm import tqdm

    from diffuserve.launch import (
        apply_num_threads,
        load_serving_pipeline,
        plan_deployment,
        resolve_device,
        resolve_model_path,
    )

    stem = values.get("output_file_name")
    if stem is not None and (Path(stem).name != stem or stem in ("", ".", "..")):
        # Files go into --output-path only: a name may not climb out of it or name another folder.
        raise ConfigError(f"--output-file-name: {stem!r} must be a plain file name without folders; use --output-path for the folder.")
    args.validate()
    model_path = resolve_model_path(args)
    device = resolve_device(args.device)
    deployment = plan_deployment(args, model_path, device)
    apply_num_threads(args.num_threads, device)
    pipeline = load_serving_pipeline(args, model_path, device, deployment, metrics=None)
    model = pipeline.describe_model()
    video = model.output_kind == "video"
    n = values.get("num_outputs_per_prompt", 1)
    if n < 1:
        raise ConfigError("--num-outputs-per-prompt must be >= 1.")
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
        for i, prompt in enumerate(values["prompt"])
    ]
    max_outputs = args.batching_max_size if args.batching_mode == "dynamic" else n
    out_dir = Path(values.get("output_path") or "outputs")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for batch in _chunks(params, max(max_outputs, n)):
        steps = batch[0].num_inference_steps
        with tqdm(total=steps, desc=f"denoising {len(batch)} prompt(s)", unit="step") as bar:
            result = pipeline.run(batch, on_step=lambda i, total: bar.update(1))
        for p, output in zip(batch, result.outputs, strict=True):
            for j, blob in enumerate(_encoded(p, output)):
                name = stem or _file_stem(p.prompt)
                suffix = "" if len(params) == 1 and n == 1 else f"_{p.seed}_{j}"
                path = out_dir / f"{name}{suffix}.{p.output_format}"
                path.write_bytes(blob)
                written.append(path)
    for path in written:
        print(path)
    return 0


def print_plan(values: dict[str, Any]) -> int:
    """Resolve and print the plan from JSON and safetensors headers only (no weights loaded)."""
    from diffuserve.config.argparse_dataclass import dataclass_from_namespace
    from diffuserve.config.deployment import DeploymentArgs, format_plan
    from diffuserve.hardware import describe_hardware, detect_hardware
    from diffuserve.launch import resolve_deployment, resolve_dtype

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
