"""Fields of other servers' clients, checked before queueing (no model, no server): which models take each, how
`size` and `width`/`height` agree, `layers` as `n`, `num_frames` on an image request, and `seconds` beside
`num_frames` (the integration side: tests/integration/test_peer_clients.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diffuserve.config.server_args import ServerArgs
from diffuserve.errors import InvalidRequestError
from diffuserve.families.base import SamplingDefaults
from diffuserve.sampling import PEER_FIELDS, ModelDescription, SamplingParams, build_sampling_params
from diffuserve.server.common import check_image_only_fields, layer_count, resolve_size
from diffuserve.server.openai_images import image_params
from diffuserve.server.protocol import ImageGenerationRequest
from diffuserve.server.video_params import VideoCreateRequest, build_video_params, frames_note


def _ctx(output_kind: str = "image", fields: frozenset[str] = frozenset()) -> SimpleNamespace:
    model = ModelDescription(
        family="test",
        output_kind=output_kind,
        request_fields=fields,
        frame_multiple=4,
        defaults=SamplingDefaults(width=32, height=32, num_frames=5, fps=8),
        validate=lambda params: None,
    )
    return SimpleNamespace(args=ServerArgs(served_model_name="m"), engine=SimpleNamespace(model=model))


def _refused(call, param: str) -> str:
    with pytest.raises(InvalidRequestError) as info:
        call()
    assert info.value.param == param, info.value.message
    return info.value.message


def test_peer_fields_join_the_batch_signature():
    assert {"flow_shift", "boundary_ratio", "resolution"} <= set(SamplingParams.signature_fields())


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
