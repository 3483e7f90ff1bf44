"""Protocol validation (pydantic) and the batch signature of SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from diffuserve.sampling import SamplingParams, signature_difference
from diffuserve.server.app import _param_of
from diffuserve.server.protocol import ImageGenerationRequest, parse_size


@pytest.mark.parametrize(
    ("text", "expected"), [("64x64", (64, 64)), (" 32 X 48 ", (32, 48)), ("1024×768", (1024, 768))]
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "64", "64x", "x64", "-1x5", "axb", "1234567x2"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_size(text)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 11}, "n"),
        ({"prompt": "x", "n": "2"}, "n"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "seed": 2**63}, "seed"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "size": "0x0"}, "size"),
        ({"prompt": "x", "response_format": "gif"}, "response_format"),
        ({"prompt": "x", "output_quality": 0}, "output_quality"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x", "timeout": 0}, "timeout"),
        ({"prompt": "x", "unknown": 1}, "unknown"),
    ],
)
def test_invalid_fields_are_named(body, field):
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate(body)
    assert _param_of(tuple(info.value.errors()[0]["loc"])) == field


def test_valid_request_defaults():
    request = ImageGenerationRequest.model_validate({"prompt": "a fox", "size": "64X32"})
    assert request.size == "64x32" and request.n == 1 and request.response_format == "b64_json"
    assert ImageGenerationRequest.model_validate({"prompt": "a", "size": "auto"}).size is None


def test_signature_holds_exactly_the_tensor_program():
    base = SamplingParams(prompt="a", seed=1, width=64, height=64)
    per_row = SamplingParams(prompt="b", negative_prompt=None, seed=2, n=3, output_format="jpeg", output_quality=10)
    assert base.signature() == per_row.signature()
    assert signature_difference(base, per_row) is None
    assert signature_difference(base, SamplingParams(num_inference_steps=5)) == "sampling_params.num_inference_steps"
    assert signature_difference(base, SamplingParams(width=128)) == "sampling_params.width"
    cfg = SamplingParams(negative_prompt="blurry", true_cfg_scale=4.0)
    assert cfg.cfg_enabled and not SamplingParams(true_cfg_scale=4.0).cfg_enabled
    assert signature_difference(SamplingParams(negative_prompt="x", true_cfg_scale=4.0), cfg) is None
    assert "cfg_enabled" in dict(SamplingParams().signature())
