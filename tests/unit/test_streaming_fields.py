"""The pure parts of streaming and the OpenAI request fields: preview steps, quality -> steps, the
encoder quality from output_compression, and the SSE wire format."""

from __future__ import annotations

import json

import pytest

from diffuserve.errors import InvalidRequestError
from diffuserve.executor.batch_runner import preview_steps
from diffuserve.server.streaming import sse
from diffuserve.server.usage import encoder_quality, reported_quality, steps_for_quality


@pytest.mark.parametrize(
    ("num_steps", "partials", "expected"),
    [
        (4, 2, [0, 2]),
        (28, 3, [6, 13, 20]),
        (8, 1, [3]),
        (2, 2, [0]),  # a short schedule gives fewer previews, never one at the last step
        (1, 3, []),
        (10, 0, []),
    ],
)
def test_preview_steps_are_evenly_spaced_and_never_the_last(num_steps, partials, expected):
    assert preview_steps(num_steps, partials) == expected


def test_quality_maps_to_a_share_of_the_family_default_steps():
    assert [steps_for_quality(q, 28) for q in ("low", "medium", "high")] == [7, 14, 28]
    assert [steps_for_quality(q, 4) for q in ("low", "medium", "high", "hd")] == [1, 2, 4, 4]
    assert steps_for_quality("auto", 28) is None and steps_for_quality(None, 28) is None
    assert steps_for_quality("standard", 28) is None
    assert (reported_quality("standard"), reported_quality("hd"), reported_quality(None)) == ("auto", "high", "auto")


def test_output_compression_is_the_encoder_quality_for_lossy_formats_only():
    assert encoder_quality("jpeg", 90, None, False) == 90
    assert encoder_quality("webp", 90, 40, False) == 40
    assert encoder_quality("jpeg", 90, 0, False) == 1
    for args in (("png", 90, 40, False), ("jpeg", 80, 40, True)):
        with pytest.raises(InvalidRequestError) as info:
            encoder_quality(*args)
        assert info.value.param == "output_compression"


def test_sse_event_format():
    raw = sse("image_generation.completed", {"type": "image_generation.completed", "b64_json": "AA=="}).decode()
    assert raw.startswith("event: image_generation.completed\ndata: ") and raw.endswith("\n\n")
    assert json.loads(raw.split("data: ", 1)[1]) == {"type": "image_generation.completed", "b64_json": "AA=="}
