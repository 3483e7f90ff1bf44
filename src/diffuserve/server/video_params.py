"""The body of POST /v1/videos and its mapping to `SamplingParams` (validation only: no engine, no I/O).

Besides OpenAI's fields it takes the extension fields the clients of SGLang-Diffusion, vLLM-Omni and FastVideo
send (docs/api.md, "Fields of other servers' clients"): `num_frames` beside `seconds` (an explicit `num_frames`
wins, as in FastVideo), `width`/`height` beside `size`, Wan2.2 A14B's `guidance_scale_2` and `boundary_ratio`,
`true_cfg_scale` and `flow_shift` where the served model gives them meaning (else a 400 naming the field).
Joint audio-video models (LTX-2) take `generate_audio` and vLLM-Omni's `generate_sound` (the same switch) and
`sound_duration` (which must be the video's duration: the sound track always spans the whole video); models
without sound refuse all three, naming the field.
"""

from __future__ import annotations

import math

from pydantic import Field, StrictFloat, StrictInt, StrictStr

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import ModelDescription, SamplingParams, build_sampling_params, check_request_fields
from diffuserve.server.common import check_request_limits, request_step_cache, resolve_size, served_model
from diffuserve.server.context import ServerContext
from diffuserve.server.lora_fields import base_model_name, request_loras
from diffuserve.server.protocol import MAX_SEED, PromptRequest


class VideoCreateRequest(PromptRequest):
    """Body of POST /v1/videos (prompt, model and size as for images)."""

    seconds: StrictStr | StrictFloat | StrictInt | None = Field(
        default=None,
        description='Duration (OpenAI sends a string such as "4"); frames = seconds x fps, '
        "rounded to the nearest count the model can make. With num_frames too, num_frames wins (the job's "
        "num_frames and seconds report what runs).",
    )
    num_frames: StrictInt | None = Field(
        default=None, ge=1, description="Frames (Wan: 4k+1); omitted = the model's default (or from seconds)."
    )
    width: StrictInt | None = Field(
        default=None, ge=1, description="Alternative to size (with size too, they must agree)."
    )
    height: StrictInt | None = Field(
        default=None, ge=1, description="Alternative to size (with size too, they must agree)."
    )
    fps: StrictInt | None = Field(default=None, ge=1, le=120, description="Frames per second of the MP4.")
    num_inference_steps: StrictInt | None = Field(default=None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(default=None, ge=0, le=100, description="Classifier-free guidance scale.")
    guidance_scale_2: float | None = Field(
        default=None,
        ge=0,
        le=100,
        description="Wan2.2 A14B: guidance of the low-noise expert (default: guidance_scale). Other models: 400.",
    )
    boundary_ratio: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="Wan2.2 A14B: the timestep share at "
        "which the low-noise expert takes over (default: the checkpoint's). Other "
        "models: 400.",
    )
    true_cfg_scale: float | None = Field(
        default=None,
        ge=0,
        le=100,
        description="True CFG scale, for families that "
        "run true CFG (with negative_prompt); others (Wan: use guidance_scale): 400.",
    )
    negative_prompt: str | None = Field(default=None, description="What not to film (used when guidance_scale > 1).")
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED, description="Random seed (0 to 2^63-1).")
    n: StrictInt = Field(default=1, ge=1, le=1, description="Videos per job; 1 (submit several jobs for more).")
    timeout: float | None = Field(
        default=None, gt=0, description="Seconds the job may take in the engine (capped by --request-timeout-s)."
    )
    priority: StrictInt = Field(default=0, ge=-100, le=100, description="Lower runs first among queued requests.")
    user: str | None = Field(
        default=None, max_length=256, description="End-user id (accepted for OpenAI compatibility)."
    )
    generate_audio: bool | None = Field(
        default=None,
        description="Models with sound (LTX-2): false writes a silent MP4 (true, the default: an AAC track of "
        "the video's duration). Models without sound: 400.",
    )
    generate_sound: bool | None = Field(
        default=None, description="vLLM-Omni's name for generate_audio (with both, they must agree)."
    )
    sound_duration: float | None = Field(
        default=None,
        gt=0,
        description="vLLM-Omni: seconds of sound; here it must equal the video's duration (num_frames / fps, "
        "within one frame): the sound track always spans the whole video. Models without sound: 400.",
    )


def _seconds(body: VideoCreateRequest) -> float:
    try:
        seconds = float(body.seconds)  # type: ignore[arg-type]
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(f'seconds={body.seconds!r} must be a positive number, e.g. "4".', param="seconds")
    return seconds


def frames_for(body: VideoCreateRequest, fps: int, default: int, step: int) -> int:
    """num_frames from the body: explicit (it wins over `seconds`, which must still be a valid number), from
    `seconds` (snapped to step*k+1), or the default."""
    if body.seconds is None:
        return default if body.num_frames is None else body.num_frames
    seconds = _seconds(body)
    if body.num_frames is not None:
        return body.num_frames
    return max(1, round((seconds * fps - 1) / step) * step + 1)


def frames_note(body: VideoCreateRequest, params: SamplingParams) -> list[str]:
    """The warning a job gets when `seconds` and `num_frames` were both given (num_frames won)."""
    if body.seconds is None or body.num_frames is None:
        return []
    return [
        f"seconds={body.seconds} and num_frames={body.num_frames} were both given: num_frames wins, so the video "
        f"is {params.num_frames} frames = {params.num_frames / params.fps:g} s at {params.fps} fps."
    ]


def audio_choice(body: VideoCreateRequest, model: ModelDescription, num_frames: int, fps: int) -> bool | None:
    """`generate_audio` from the body's sound fields (None: unset), refused naming the field where the model makes
    no sound, where `generate_audio` and `generate_sound` disagree, or where `sound_duration` is not the video's."""
    check_request_fields(
        model,
        {
            "generate_audio": body.generate_audio,
            "generate_sound": body.generate_sound,
            "sound_duration": body.sound_duration,
        },
    )
    if None not in (body.generate_audio, body.generate_sound) and body.generate_audio != body.generate_sound:
        raise InvalidRequestError(
            f"generate_sound={body.generate_sound} disagrees with generate_audio={body.generate_audio} (the same "
            "switch under vLLM-Omni's name); send one of them.",
            param="generate_sound",
        )
    choice = body.generate_audio if body.generate_audio is not None else body.generate_sound
    if body.sound_duration is not None:
        seconds = num_frames / fps
        if choice is False:
            raise InvalidRequestError(
                "sound_duration is set but the video is silent (generate_audio / generate_sound false); leave "
                "sound_duration out.",
                param="sound_duration",
            )
        if abs(body.sound_duration - seconds) > 1 / fps:
            raise InvalidRequestError(
                f"sound_duration={body.sound_duration:g} differs from the video's duration ({num_frames} frames at "
                f"{fps} fps = {seconds:g} s): the sound track always spans the whole video. Leave sound_duration "
                "out, or set the duration with seconds / num_frames.",
                param="sound_duration",
            )
    return choice


def build_video_params(body: VideoCreateRequest, ctx: ServerContext, image: bytes | None = None) -> SamplingParams:
    """Request body + the model's defaults -> SamplingParams, checked against the server's caps."""
    args = ctx.args
    model = served_model(ctx)
    assert model is not None
    if model.output_kind != "video":
        raise InvalidRequestError(
            f"The served model {args.public_model_name!r} makes {model.outputs}, not videos; use "
            f"{'POST /v1/meshes' if model.output_kind == 'mesh' else 'POST /v1/images/generations'}.",
            param="model",
            code="model_not_supported",
        )
    defaults = model.defaults
    width, height = resolve_size(body.size, body.width, body.height, (defaults.width, defaults.height))
    steps = body.num_inference_steps or defaults.num_inference_steps
    check_request_limits(
        ctx,
        model=base_model_name(ctx, body.model),
        texts={"prompt": body.prompt, "negative_prompt": body.negative_prompt},
        width=width,
        height=height,
        steps=steps,
    )
    check_request_fields(model, {"true_cfg_scale": body.true_cfg_scale})
    fps = body.fps or defaults.fps
    num_frames = frames_for(body, fps, defaults.num_frames, model.frame_multiple)
    if num_frames > args.http.max_video_frames:
        raise InvalidRequestError(
            f"num_frames={num_frames} exceeds the limit of {args.http.max_video_frames} (--max-video-frames).",
            param="num_frames" if body.num_frames is not None else "seconds",
        )
    generate_audio = audio_choice(body, model, num_frames, fps)
    return build_sampling_params(
        model,
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        width=width,
        height=height,
        num_frames=num_frames,
        fps=fps,
        num_inference_steps=steps,
        guidance_scale=body.guidance_scale,
        true_cfg_scale=body.true_cfg_scale,
        guidance_scale_2=body.guidance_scale_2,
        boundary_ratio=body.boundary_ratio,
        flow_shift=body.flow_shift,
        seed=body.seed,
        n=1,
        output_format="mp4",
        image_inputs=() if image is None else (image,),
        lora=request_loras(ctx, body.lora, body.model),
        step_cache=request_step_cache(body, ctx),
        generate_audio=generate_audio,
    )
