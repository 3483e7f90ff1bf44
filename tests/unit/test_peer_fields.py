"""Fields of other servers' clients, checked before queueing (no model, no server): which models take each, how
`size` and `width`/`height` agree, `layers` as `n`, `num_frames` on an image request, `seconds` beside
`num_frames`, and the sound fields (`generate_audio`, vLLM-Omni's `generate_sound` / `sound_duration`) (the integration
side: tests/integration/test_peer_clients.py, tests/integration/test_video_sound.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import SamplingDefaults
from diffuserve.sampling import PEER_FIELDS, ModelDescription, SamplingParams, build_sampling_params
from diffuserve.server.common import check_image_only_fields, layer_count, resolve_size
from diffuserve.server.openai_images import image_params
from diffuserve.server.protocol import ImageGenerationRequest, coerce_form_fields
from diffuserve.server.video_params import VideoCreateRequest, build_video_params, frames_note


def _ctx(output_kind: str = "image", fields: frozenset[str] = frozenset(), sound: bool = False) -> SimpleNamespace:
    model = ModelDescription(
        family="test",
        output_kind=output_kind,
        request_fields=fields,
        produces_audio=sound,
        frame_multiple=4,
        defaults=SamplingDefaults(width=32, height=32, num_frames=5, fps=8),
    )
    return SimpleNamespace(args=ServerArgs(served_model_name="m"), engine=SimpleNamespace(model=model))


def _refused(call, param: str) -> str:
    with pytest.raises(InvalidRequestError) as info:
        call()
    assert info.value.param == param, info.value.message
    return info.value.message


def test_peer_fields_join_the_batch_signature():
    assert {"flow_shift", "boundary_ratio", "resolution"} <= set(dict(SamplingParams().signature()))


@pytest.mark.parametrize("name", ["flow_shift", "guidance_scale_2", "boundary_ratio", "resolution"])
def test_a_peer_field_the_model_does_not_take_names_it_and_who_does(name):
    message = _refused(lambda: build_sampling_params(_ctx().engine.model, prompt="x", **{name: 1.0}), name)
    assert PEER_FIELDS[name] in message
    params = build_sampling_params(_ctx(fields=frozenset({name})).engine.model, prompt="x", **{name: 1.0})
    assert getattr(params, name) == 1.0


def test_size_and_width_height_must_agree():
    assert resolve_size(None, 48, None, (32, 16)) == (48, 16)
    assert resolve_size("64x32", 64, 32, (8, 8)) == (64, 32)
    assert "disagrees with size" in _refused(lambda: resolve_size("64x32", 64, 48, (8, 8)), "height")


def test_layers_is_n_for_layered_models():
    assert layer_count(1, False, 3) == 3 and layer_count(3, True, 3) == 3 and layer_count(2, True, None) == 2
    _refused(lambda: layer_count(2, True, 3), "layers")
    layered = _ctx(fields=frozenset({"layers", "resolution"}))
    params = image_params(ImageGenerationRequest(prompt="x", layers=3, resolution=1024), layered)
    assert (params.n, params.resolution) == (3, 1024)
    _refused(lambda: image_params(ImageGenerationRequest(prompt="x", layers=3), _ctx()), "layers")
    _refused(lambda: image_params(ImageGenerationRequest(prompt="x", n=2, layers=3), layered), "layers")


def test_image_requests_take_num_frames_one_only():
    check_image_only_fields(None)
    check_image_only_fields(1)
    assert image_params(ImageGenerationRequest(prompt="x", num_frames=1), _ctx()).num_frames == 1
    _refused(lambda: image_params(ImageGenerationRequest(prompt="x", num_frames=5), _ctx()), "num_frames")


def test_video_num_frames_wins_over_seconds_and_says_so():
    ctx = _ctx("video")
    body = VideoCreateRequest(prompt="x", seconds="4", num_frames=9)
    params = build_video_params(body, ctx)
    assert params.num_frames == 9 and "num_frames wins" in frames_note(body, params)[0]
    assert frames_note(VideoCreateRequest(prompt="x", seconds="4"), params) == []
    assert build_video_params(VideoCreateRequest(prompt="x", width=48), ctx).width == 48
    _refused(lambda: build_video_params(VideoCreateRequest(prompt="x", size="32x32", width=48), ctx), "width")
    _refused(lambda: build_video_params(VideoCreateRequest(prompt="x", true_cfg_scale=4.0), ctx), "true_cfg_scale")
    two_experts = _ctx("video", frozenset({"guidance_scale_2", "boundary_ratio"}))
    params = build_video_params(VideoCreateRequest(prompt="x", guidance_scale_2=2.0, boundary_ratio=0.6), two_experts)
    assert (params.guidance_scale_2, params.boundary_ratio) == (2.0, 0.6)


def test_sound_fields_are_refused_naming_them_on_models_without_sound():
    silent = _ctx("video")
    for name, value in (("generate_audio", False), ("generate_sound", True), ("sound_duration", 0.625)):
        body = VideoCreateRequest(prompt="x", **{name: value})
        assert PEER_FIELDS[name] in _refused(lambda body=body: build_video_params(body, silent), name)
    assert build_video_params(VideoCreateRequest(prompt="x"), silent).generate_audio is None
    _refused(lambda: build_sampling_params(silent.engine.model, prompt="x", generate_audio=True), "generate_audio")


def test_sound_fields_on_a_model_with_sound():
    sound = _ctx("video", sound=True)  # 5 frames at 8 fps by default: 0.625 s

    def audio(**fields):
        return build_video_params(VideoCreateRequest(prompt="x", **fields), sound).generate_audio

    # Unset is on (so a request that leaves it out merges with one that says true); generate_sound is the same switch.
    assert audio() is True and audio(generate_audio=True) is True and audio(generate_sound=True) is True
    assert audio(generate_audio=False) is False and audio(generate_sound=False) is False
    assert audio(generate_audio=False, generate_sound=False) is False
    assert audio(sound_duration=0.625) is True and audio(sound_duration=0.7) is True  # within one frame (0.125 s)
    assert audio(seconds="2", sound_duration=2.125, generate_sound=True) is True  # 17 frames = 2.125 s
    assert "disagrees" in _refused(lambda: audio(generate_audio=True, generate_sound=False), "generate_sound")
    assert "0.625 s" in _refused(lambda: audio(sound_duration=4.0), "sound_duration")
    assert "silent" in _refused(lambda: audio(generate_sound=False, sound_duration=0.625), "sound_duration")
    # Multipart form values are strings (the SDK's videos.create): booleans and numbers parse as in JSON.
    form = coerce_form_fields(
        VideoCreateRequest, {"prompt": "x", "generate_audio": "false", "generate_sound": "false", "sound_duration": "1"}
    )
    body = VideoCreateRequest.model_validate(form)
    assert (body.generate_audio, body.generate_sound, body.sound_duration) == (False, False, 1.0)
