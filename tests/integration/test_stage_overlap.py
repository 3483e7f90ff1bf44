"""Dynamic batching with stage overlap, over a real server and the official openai client: batch k's VAE decode
runs in the decode lane while batch k+1 denoises (`executor/batch_runner.py` `run_batch`, `pipelines/lanes.py`).

The `hold:` fault injection makes the first batch's decode wait until the loop has run two more denoising steps,
which only the next batch can supply: the proof is the loop's own step counter (`overlap_steps_total`), not
timing. (The continuous-mode encode / decode overlap is tested in test_continuous_batching.py.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai

from tests.integration.conftest import HOLD_MARKER
from tests.integration.helpers import decode_b64_png, metric_value, pixels, wait_until
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold

PIXEL_TOL = 1  # uint8 steps, i.e. 1/255


def _generate(server: ServerProcess, model: str, prompt: str, seed: int, steps: int) -> np.ndarray:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    result = client.images.generate(
        model=model,
        prompt=prompt,
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": steps},
    )
    return pixels(decode_b64_png(result.data[0].b64_json))


def _dispatches(server) -> float:
    """Batches dispatched so far (every stop reason), from /metrics."""
    return metric_value(server.base_url, "diffuserve_batch_dispatches_total")


def test_a_batch_decodes_while_the_next_batch_denoises(dynamic_server, singleton_server):
    server = dynamic_server
    dispatched = _dispatches(server)
    before = metric_value(server.base_url, "diffuserve_overlap_steps_total", {"stage": "decode"})
    jobs = [(f"{HOLD_MARKER} first", 31, 2), ("the next batch", 32, 3)]  # different steps: never one batch
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_generate, server, "tiny-flux-dynamic", *jobs[0])
        # The first batch is dispatched: the next one runs after its denoise, while its decode waits in the lane
        # for two more steps.
        wait_until(lambda: _dispatches(server) > dispatched, "the first batch dispatched", timeout_s=120)
        second = pool.submit(_generate, server, "tiny-flux-dynamic", *jobs[1])
        got = [first.result(), second.result()]
    steps_beside = metric_value(server.base_url, "diffuserve_overlap_steps_total", {"stage": "decode"}) - before
    assert steps_beside >= 2, "the worker waited for the first batch's decode instead of denoising the next batch"
    for (prompt, seed, steps), image in zip(jobs, got, strict=True):
        body = {"prompt": prompt, "seed": seed, "size": "64x64", "num_inference_steps": steps}
        alone = pixels(
            decode_b64_png(
                httpx.post(f"{singleton_server.base_url}/v1/images/generations", timeout=300, json=body).json()["data"][
                    0
                ]["b64_json"]
            )
        )
        assert int(np.abs(image.astype(np.int16) - alone.astype(np.int16)).max()) <= PIXEL_TOL, prompt


def test_a_queued_requests_text_encodes_while_the_running_batch_denoises(dynamic_server, singleton_server):
    """A request admitted behind a running batch has its texts encoded in the encode lane meanwhile
    (`pipelines/text_prefetch.py`); `hold:` makes that encode wait for two of the running batch's steps."""
    server = dynamic_server
    start, dispatched = len(server.log()), _dispatches(server)
    before = metric_value(server.base_url, "diffuserve_overlap_steps_total", {"stage": "encode"})
    # Different step counts: three batches. The third supplies the steps the second's held decode waits for.
    # The running batch's steps wait for the test's release (`tests/step_hold.py`) until the queued request's
    # encode is seen held: a fast machine finishes 60 tiny steps before a second HTTP request is admitted.
    jobs = [(f"the running batch {StepHold.MARKER}", 41, 60), (f"{HOLD_MARKER} queued behind it", 42, 3)]
    jobs.append(("and one more", 43, 4))
    hold = StepHold(server.log_path.parent)
    hold.arm()
    with ThreadPoolExecutor(3) as pool:
        try:
            first = pool.submit(_generate, server, "tiny-flux-dynamic", *jobs[0])
            wait_until(lambda: _dispatches(server) > dispatched, "the first batch runs", timeout_s=120)
            second = pool.submit(_generate, server, "tiny-flux-dynamic", *jobs[1])
            server.wait_for_log("fault injection: holding a side encode", start=start, timeout_s=120)
        finally:
            hold.release()
        third = pool.submit(_generate, server, "tiny-flux-dynamic", *jobs[2])
        got = [first.result(), second.result(), third.result()]
    StepHold(singleton_server.log_path.parent).release()  # the singleton reference of the marked prompt runs free
    steps_beside = metric_value(server.base_url, "diffuserve_overlap_steps_total", {"stage": "encode"}) - before
    assert steps_beside >= 2, "the queued request's text encode did not run beside the running batch"
    for (prompt, seed, steps), image in zip(jobs, got, strict=True):
        body = {"prompt": prompt, "seed": seed, "size": "64x64", "num_inference_steps": steps}
        alone = pixels(
            decode_b64_png(
                httpx.post(f"{singleton_server.base_url}/v1/images/generations", timeout=300, json=body).json()["data"][
                    0
                ]["b64_json"]
            )
        )
        assert int(np.abs(image.astype(np.int16) - alone.astype(np.int16)).max()) <= PIXEL_TOL, prompt


def test_counting_prompt_tokens_beside_an_encode_does_not_change_what_the_encode_gets(tiny_flux_path):
    """The server counts prompt tokens (HTTP thread) while the encode lane tokenizes: on one shared fast tokenizer
    the count's settings leaked into the encode (unpadded rows). `PromptTokens` counts on a private copy."""
    import threading

    from transformers import AutoTokenizer

    from diffuserve.pipelines.prompt_limits import PromptTokens, TextEncoderLimit

    tokenizer = AutoTokenizer.from_pretrained(tiny_flux_path / "tokenizer_2")
    text, stop = "a red fox in fresh snow, golden hour", threading.Event()
    counter = PromptTokens([TextEncoderLimit("text_encoder_2 (T5)", tokenizer, 64)])

    def count() -> None:
        while not stop.is_set():
            counter.count({"prompt": text})

    counting = threading.Thread(target=count)
    counting.start()
    try:
        lengths = {
            tokenizer(
                [text], padding="max_length", max_length=64, truncation=True, return_tensors="pt"
            ).input_ids.shape[1]
            for _ in range(300)
        }
    finally:
        stop.set()
        counting.join()
    assert lengths == {64}
