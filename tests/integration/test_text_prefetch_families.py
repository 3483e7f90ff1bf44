"""Text prefetch with real encoders (`pipelines/text_prefetch.py`): requests queued behind a busy encode lane are
encoded in one lane job, and the merged batch that takes those rows equals each request alone (<= 1/255).

SANA encodes a text by its role (a prompt gets the complex human instruction, a negative prompt does not) and SD3
encodes prompts and negative prompts in separate calls, both deciding the roles from the batch they are given: the
lane job's batch is every member request, so the second request's prompt is encoded as a prompt too.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from diffuserve.pipelines.lanes import lanes_for
from diffuserve.sampling import SamplingParams

WAIT_S = 120


def _max_diff(a, b) -> int:
    return int(np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).max())


@pytest.mark.parametrize("family", ["sana", "sd3", "flux"])
def test_rows_encoded_in_one_lane_job_equal_their_requests_alone(tiny_checkpoint, family: str) -> None:
    from diffuserve.models.loader import load_pipeline

    pipeline = load_pipeline(tiny_checkpoint(family))
    common = {"width": 64, "height": 64, "num_inference_steps": 2, "guidance_scale": 4.0}
    if family == "flux":  # true CFG: a negative prompt and true_cfg_scale
        common = {**common, "guidance_scale": 3.5, "true_cfg_scale": 3.0}
    batch = [
        SamplingParams(prompt="a red square on white", negative_prompt="blurry", seed=1, **common),
        SamplingParams(prompt="a small blue circle in the corner", negative_prompt="dark", seed=2, **common),
    ]
    alone = [pipeline.run([params]).outputs[0].images[0] for params in batch]

    started, release = threading.Event(), threading.Event()

    def hold() -> None:  # the lane is busy while both requests queue: they ride one job
        started.set()
        assert release.wait(WAIT_S)

    lanes_for(pipeline).encode.submit(hold)
    assert started.wait(WAIT_S)
    done = threading.Semaphore(0)
    for params in batch:
        assert pipeline.prefetch_text(params, on_done=lambda steps: done.release())
    release.set()
    assert done.acquire(timeout=WAIT_S) and done.acquire(timeout=WAIT_S)
    assert pipeline.text_stage.prefetched.num_entries == 4  # two prompts and two negative prompts, waiting
    merged = pipeline.run(batch).outputs
    assert pipeline.text_stage.prefetched.num_entries == 0  # the batch took them
    for params, got, want in zip(batch, merged, alone, strict=True):
        assert _max_diff(got.images[0], want) <= 1, params.prompt
