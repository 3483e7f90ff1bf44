"""`diffuserve generate`: one-shot generation to files (`diffuserve plan` is `plan_command.py`)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import ConfigError, InvalidRequestError
from diffuserve.generate_masks import check_mask_family, read_mask
from diffuserve.pipelines.prompt_limits import with_counter
from diffuserve.sampling import SamplingParams, build_sampling_params
from diffuserve.server.control_fields import generate_control

INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT)."""


def _file_stem(prompt: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")[:48]
    return stem or "image"


def output_names(prompts: list[str], n: int, stem: str | None) -> list[list[str]]:
    """File stems per prompt and output: STEM for a single output, else STEM_<prompt i>_<output j>.

    STEM is --output-file-name, or one derived from each prompt; the suffixes are the same either way.
    Derived stems of equal prompts would collide, so they always carry the suffix too.
    """
    single = len(prompts) == 1 and n == 1
    return [
        [(stem or _file_stem(prompt)) + ("" if single else f"_{i}_{j}") for j in range(n)]
        for i, prompt in enumerate(prompts)
    ]


def _encoded(params: SamplingParams, output: Any) -> list[bytes]:
    """A request's outputs as file bytes: MP4 per video, or the chosen image format per image."""
    if params.output_format == "mp4":
        from diffuserve.media.video import encode_mp4

        sounds = zip(output.videos, output.audios or [None] * len(output.videos), strict=True)  # AAC track per video
        return [encode_mp4(v, params.fps, a, output.audio_sample_rate) for v, a in sounds]
    from diffuserve.media.images import encode_image

    return [encode_image(image, params.output_format, params.output_quality) for image in output.images]


def _check_applicable(values: dict[str, Any], video: bool, family: str, sound: bool) -> None:
    """Flags that mean nothing for this model are errors naming the flag, never silently ignored."""
    if values.get("generate_audio") is not None and not sound:
        raise ConfigError(
            f"--generate-audio: the served model ({family}) makes no sound (joint audio-video models such as LTX-2 "
            "do). Drop the flag."
        )
    if not video:
        for key in ("num_frames", "fps"):
            if values.get(key) is not None:
                raise ConfigError(
                    f"--{key.replace('_', '-')}: the served model ({family}) makes images; "
                    "this flag applies to video models only. Drop it."
                )
    elif values.get("output_format") not in (None, "mp4"):
        raise ConfigError(
            f"--output-format {values['output_format']}: the served model ({family}) makes videos, "
            "which are always written as mp4. Drop the flag."
        )


FLAG_OF_FIELD = {
    "prompt": "--prompt",
    "negative_prompt": "--negative-prompt",
    "size": "--width/--height",
    "width": "--width",
    "height": "--height",
    "num_inference_steps": "--num-inference-steps",
    "guidance_scale": "--guidance-scale",
    "true_cfg_scale": "--true-cfg-scale",
    "seed": "--seed",
    "num_frames": "--num-frames",
    "fps": "--fps",
    "image": "--image-path",
    "input_reference": "--image-path",
    "strength": "--strength",
    "mask": "--mask-path",
    "output_format": "--output-format",
    "model": "--model-path",
    "step_cache": "--step-cache",
}
"""A request field (as the API's 400s name it) -> the `generate` flag that sets it."""
_API_FIELDS = (
    "negative_prompt",
    "width",
    "height",
    "num_inference_steps",
    "guidance_scale",
    "true_cfg_scale",
    "seed",
    "num_frames",
    "fps",
    "strength",
)
"""The flags `generate` checks through the API's own request models, before any weight is loaded."""


def _flag_error(field: str, message: str) -> ConfigError:
    """The API's message for `field`, named by its flag (exit 2)."""
    return ConfigError(f"{FLAG_OF_FIELD.get(field, '--' + field.replace('_', '-'))}: {message}")


def check_values(values: dict[str, Any], prompts: list[str], video: bool) -> None:
    """Every value the API validates, with the API's rules and messages (the same pydantic request models as
    POST /v1/images/edits and /v1/videos), each error naming its flag: empty prompt, steps 0, negative seed,
    guidance out of range, ... A model-free check, so it runs before the model loads."""
    from pydantic import ValidationError

    from diffuserve.server.protocol import ImageEditRequest
    from diffuserve.server.video_params import VideoCreateRequest

    model = VideoCreateRequest if video else ImageEditRequest
    given = {k: values[k] for k in _API_FIELDS if values.get(k) is not None and k in model.model_fields}
    for prompt in prompts:
        try:
            model.model_validate({"prompt": prompt, **given})
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            field = str(first["loc"][0]) if first.get("loc") else "prompt"
            raise _flag_error(field, f"Invalid value for {field!r}: {first.get('msg', 'invalid')}.") from None


def read_images(values: dict[str, Any], max_side: int, *, video: bool) -> tuple[bytes, ...]:
    """The `--image-path` files' bytes, each decoded as the API decodes uploads (formats, pixel limit), so a
    bad file is refused before the model loads, with the API's message naming the flag."""
    from diffuserve.media.images import decode_image

    paths = values.get("image_path") or []
    blobs = []
    for path in [paths] if isinstance(paths, str) else paths:  # a --config file may give one path as a string
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"--image-path {path}: cannot read it ({exc.strerror or exc}).") from None
        try:
            decode_image(
                data,
                max_pixels=max_side**2,
                param="input_reference" if video else "image",
                limit_flag=f"--max-image-side {max_side} (at most {max_side}x{max_side} pixels)",
            )
        except InvalidRequestError as exc:
            raise ConfigError(f"--image-path {path}: {exc.message}") from None
        blobs.append(data)
    return tuple(blobs)


def check_inputs(
    values: dict[str, Any],
    images: tuple[bytes, ...],
    *,
    family: str,
    max_inputs: int,
    min_inputs: int,
    video: bool,
    size_multiple: int | None,
) -> None:
    """What the model takes: input images (none for a text-only model, at least one for an edit-only, image-to-video
    or layered model, at most its limit), `--strength` (image edits only) and, when known before loading, the
    size multiple."""
    if images and max_inputs == 0:
        raise ConfigError(
            f"--image-path: the model ({family}) takes no input image (it is text-to-"
            f"{'video' if video else 'image'} only). Drop the flag, or serve an edit, image-to-image "
            "or image-to-video model."
        )
    if len(images) > max(max_inputs, 1) and max_inputs:
        raise ConfigError(
            f"--image-path: the model ({family}) takes at most {max_inputs} input image(s); got {len(images)}."
        )
    if len(images) < min_inputs:
        raise ConfigError(
            f"--image-path: the model ({family}) needs {min_inputs} input image(s) "
            f"({'the first frame' if video else 'the image to edit'}); got {len(images)}."
        )
    if values.get("strength") is not None and (video or not images):
        raise ConfigError(
            "--strength applies to image edits (with --image-path on an image model): the share of the "
            "schedule re-noised from the input image. Drop it."
        )
    for name in ("width", "height"):
        value = values.get(name)
        if size_multiple and value is not None and value % size_multiple:
            raise ConfigError(
                f"--{name} {value} is not a multiple of {size_multiple}, which this {family} model "
                f"needs; choose e.g. {max(size_multiple, value // size_multiple * size_multiple)}."
            )


def _warn_truncated(model: Any, prompts: list[str], negative_prompt: str | None) -> None:
    """Say when a prompt is longer than a text encoder takes (it runs cut off, as in `serve`), counted by the
    model's token owner as `serve` counts."""
    owner = model.prompt_tokens
    if owner is None:
        return
    for i, prompt in enumerate(prompts):
        for found in owner.count({"prompt": prompt, "negative_prompt": negative_prompt}).truncations:
            logging.getLogger("diffuserve").warning("--prompt #%d: %s", i, found.message)


def generate(args: ServerArgs, values: dict[str, Any]) -> int:
    from diffuserve.engine.offline import OfflineEngine
    from diffuserve.launch.root import build_generate_engine
    from diffuserve.launch.setup import resolve_model_path

    prompts = values.get("prompt")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts and values.get("image_path"):
        prompts = [""]  # a mesh model is conditioned on the image alone
    if not prompts:
        raise ConfigError(
            "--prompt is required: give it on the command line (repeat it for several prompts) "
            "or as `prompt` (a string or a list) in --config."
        )
    stem = values.get("output_file_name")
    if stem is not None and (Path(stem).name != stem or stem in ("", ".", "..")):
        # Files go into --output-path only: a name may not climb out of it or name another folder.
        raise ConfigError(
            f"--output-file-name: {stem!r} must be a plain file name without folders; use --output-path for the folder."
        )
    n = values.get("num_outputs_per_prompt", 1)
    if n < 1:
        raise ConfigError("--num-outputs-per-prompt must be >= 1.")
    args.validate()
    model_path = resolve_model_path(args, quiet=True)  # the engine's set-up resolves (and logs) it again
    from diffuserve.family_spec import spec_for
    from diffuserve.models.registry import resolve_model

    spec = resolve_model(model_path, model_id=args.model.model_id, backend=args.model.backend)
    video = spec.output_kind == "video"
    images = read_images(values, args.http.max_image_side, video=video)
    mask = read_mask(values, images, args.http.max_image_side)  # before loading, as read_images
    if spec.family != "unknown":  # known from model_index.json alone: refuse before loading any weight
        _check_applicable(values, video, spec.family, spec_for(spec.family).produces_audio)
        if spec.output_kind != "mesh":  # a mesh model ignores the prompt (its image is the condition)
            check_values(values, prompts, video)
            _check_family_inputs(values, images, spec, model_path)
    step_cache = _step_cache(args)
    engine = OfflineEngine(build_generate_engine(args))
    try:
        model = with_counter(engine.start())  # generate counts prompts as `serve`'s front end does
        return _generate(values, engine, model, prompts, n, stem, images, step_cache=step_cache, mask=mask)
    finally:
        engine.close()


def _step_cache(args: ServerArgs) -> Any:
    """The step cache of every row: `--step-cache` with `--step-cache-config`, magcache's ratios from
    `--step-cache-calibration` (the same flags and rules as `serve`'s default; `args.validate()` checked them)."""
    from diffuserve.config.step_cache import server_step_cache, with_calibration

    return with_calibration(
        server_step_cache(args.step_cache.method, args.step_cache.options), args.step_cache.calibration, "--step-cache"
    )


def _check_family_inputs(values: dict[str, Any], images: tuple[bytes, ...], spec: Any, model_path: Path) -> None:
    """`check_inputs` with what the family spec says of the checkpoint's configs before loading (the size multiple
    only for native adapters, whose rule the spec states; the loaded model's own checks follow in `_generate`)."""
    from diffuserve.family_spec import spec_for
    from diffuserve.family_spec.checkpoint import describe_checkpoint, read_checkpoint_configs

    family = spec_for(spec.family)
    multiple = describe_checkpoint(family, read_checkpoint_configs(model_path)).size_multiple
    check_mask_family(values, family, spec.backend)
    text_conditioned = bool(family.tasks & {"t2i", "t2v"})
    check_inputs(
        values,
        images,
        family=spec.family,
        max_inputs=family.max_image_inputs,
        min_inputs=0 if text_conditioned else 1,
        video=spec.output_kind == "video",
        size_multiple=multiple if spec.backend == "native" else None,
    )


def _build_params(
    values: dict[str, Any],
    model: Any,
    prompts: list[str],
    n: int,
    images: tuple[bytes, ...],
    step_cache: Any = None,
    mask: bytes | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per prompt through the API's builder. With input images on an image model, the size
    defaults to the first input's (rounded down to the model's multiple) and strength to 0.6, as for
    POST /v1/images/edits; an image-to-video input is the first frame, as `input_reference`."""
    video = model.output_kind == "video"
    width, height = values.get("width"), values.get("height")
    edit = bool(images) and not video
    if edit and width is None and height is None:
        from diffuserve.media.images import decode_image

        first, multiple = decode_image(images[0], max_pixels=2**62), model.size_multiple
        width = max(multiple, first.width // multiple * multiple)
        height = max(multiple, first.height // multiple * multiple)
    return [
        build_sampling_params(
            model,
            prompt=prompt,
            negative_prompt=values.get("negative_prompt"),
            width=width,
            height=height,
            num_inference_steps=values.get("num_inference_steps"),
            guidance_scale=values.get("guidance_scale"),
            true_cfg_scale=values.get("true_cfg_scale"),
            seed=values.get("seed", 0) + i,
            n=n,
            num_frames=values.get("num_frames") if video else None,
            fps=values.get("fps"),
            output_format="mp4" if video else values.get("output_format", "png"),
            image_inputs=images,
            mask_input=mask,
            padding_mask_crop=values.get("padding_mask_crop"),
            strength=values.get("strength", 0.6) if edit else 1.0,
            step_cache=step_cache,
            generate_audio=values.get("generate_audio"),
            control=generate_control(values, model),
        )
        for i, prompt in enumerate(prompts)
    ]


def _generate(
    values: dict[str, Any],
    engine: Any,
    model: Any,
    prompts: list[str],
    n: int,
    stem: str | None,
    images: tuple[bytes, ...] = (),
    *,
    step_cache: Any = None,
    mask: bytes | None = None,
) -> int:
    if model.output_kind == "mesh":
        return _generate_mesh(values, engine, model, stem)
    video = model.output_kind == "video"
    _check_applicable(values, video, model.family, model.produces_audio)
    # Again with what the loaded model says (a checkpoint of an unknown family is only known now).
    check_values(values, prompts, video)
    check_inputs(
        values,
        images,
        family=model.family,
        max_inputs=model.max_image_inputs,
        min_inputs=model.min_image_inputs,
        video=video,
        size_multiple=model.size_multiple,
    )
    try:
        params = _build_params(values, model, prompts, n, images, step_cache, mask)
    except InvalidRequestError as exc:
        if exc.param not in ("step_cache", "mask", "padding_mask_crop"):
            raise
        raise _flag_error(exc.param, exc.message) from None  # a method or a mask this model cannot run
    _warn_truncated(model, prompts, values.get("negative_prompt"))
    names = output_names(prompts, n, stem)
    out_dir = Path(values.get("output_path") or "outputs")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    # The engine batches as `serve` does: singleton runs one prompt (all its n rows) per call; dynamic merges the
    # prompts into calls of at most --batching-max-size rows. Files are written as each prompt's answer arrives.
    step, running = (0, params[0].num_inference_steps), None
    try:
        for prompt_index, submitted in enumerate(engine.submit_all(params)):
            step, running = (0, submitted.params.num_inference_steps), submitted.request_id
            output = _wait(engine, submitted).output
            for j, blob in enumerate(_encoded(submitted.params, output)):
                path = out_dir / f"{names[prompt_index][j]}.{submitted.params.output_format}"
                path.write_bytes(blob)
                written.append(path)
    except KeyboardInterrupt:
        import sys

        done = engine.interrupt(running) if running else None
        if done is not None:
            # The step in flight: the engine finishes it, then stops, and its log ("stopped at step k/N") counts
            # it; the steps done when Ctrl-C came would read one lower than that line.
            step = (min(done[0] + 1, done[1]), done[1])
        print(
            f"\ninterrupted at step {step[0]}/{step[1]}; wrote {len(written)} files to {out_dir}",
            file=sys.stderr,
        )
        return INTERRUPTED
    engine.log_step_cache()
    for path in written:
        print(path)
    return 0


def _wait(engine: Any, submitted: Any) -> Any:
    """One request's result, with a progress bar of its denoising steps (raises its error)."""
    from concurrent.futures import TimeoutError as Pending

    from tqdm import tqdm

    params = submitted.params
    # The unit spaced from the figures ("2/2 steps", "9.80 steps/s"); the bar's count never passes its total.
    shape = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}, {rate_noinv_fmt}]"
    with tqdm(
        total=params.num_inference_steps, desc=f"denoising {params.n} row(s)", unit=" steps", bar_format=shape
    ) as bar:
        while True:
            try:
                result = submitted.result.result(timeout=0.1)
            except Pending:
                done, total = engine.progress(submitted.request_id) or (0, 0)
                if total:
                    bar.total = total
                bar.update(min(done, bar.total) - bar.n)
                continue
            bar.update(bar.total - bar.n)
            return result


def _generate_mesh(values: dict[str, Any], engine: Any, model: Any, stem: str | None) -> int:
    """Mesh families: `--image-path` -> one mesh file (.glb unless --output-format obj), run by the engine."""
    from diffuserve.media.meshes import MESH_FORMATS, encode_mesh

    paths = values.get("image_path") or []
    paths = [paths] if isinstance(paths, str) else list(paths)  # a --config file may give one path as a string
    if len(paths) != 1:
        raise ConfigError(
            "--image-path is required, once: this model (image-to-3D) reconstructs the object in one "
            f"image; got {len(paths)}."
        )
    image_path = paths[0]
    output_format = values.get("output_format") or "glb"
    if output_format not in MESH_FORMATS:
        raise ConfigError(f"--output-format {output_format}: a mesh model writes glb or obj.")
    params = build_sampling_params(
        model,
        prompt="",
        num_inference_steps=values.get("num_inference_steps") or None,
        guidance_scale=values.get("guidance_scale"),
        seed=values.get("seed", 0),
        output_format=output_format,
        image_inputs=(Path(image_path).read_bytes(),),
    )
    mesh = _wait(engine, next(iter(engine.submit_all([params])))).output.meshes[0]
    if mesh.error:
        raise ConfigError(f"no mesh for {image_path}: {mesh.error}")
    out_dir = Path(values.get("output_path") or "outputs")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem or Path(image_path).stem}.{output_format}"
    path.write_bytes(encode_mesh(mesh.vertices, mesh.faces, output_format))
    print(path)
    return 0
