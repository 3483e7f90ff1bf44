"""Adapters, the exact-result cache and continuous batching agree (issue 34 items 3 and 4), on one real continuous
server (`--enable-lora-updates --lora-root --result-cache-mib 64 --max-loras 1`) driven by the official openai client
and the load / unload routes:

- an adapter unloaded and loaded again from another folder is never answered from the cache with the old image: the
  new answer equals the new files' image on a freshly loaded pipeline (<= 1/255), and the unload drops the old entry;
- an unload waits for the requests that use the adapter, running (two rows of a continuous group, held at their
  first step by the `hold_step` fault, `tests/step_hold.py`) and queued (a third, of another group): all three
  succeed, and the server logs the unload after their last step;
- a continuous group never needs more distinct adapters than `--max-loras`: two requests with different adapters
  queued together run in two groups and both succeed.

Requests are made to wait in the queue behind an anchor of another size (a 32x32 request of 5000 steps whose
client then goes away), so they meet there however slowly the machine runs; the gates are the server's metrics.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.helpers import decode_b64_png, metric_reading, metric_value, pixels
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running, wait_idle

MODEL = "tiny-flux-lora-continuous"
COMMON = ["--model-path", "--served-model-name", MODEL, "--batching-mode", "continuous", "--batching-max-size", "4"]


def _flags(path: Path, *extra: str) -> list[str]:
    return [COMMON[0], str(path), *COMMON[1:], "--max-lora-rank", "8", "--enable-warmup", "false", *extra]


@pytest.fixture(scope="module")
def server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("lora-continuous")
    process = ServerProcess(
        _flags(
            tiny_flux_path,
            "--enable-lora-updates",
            "--lora-root",
            str(root),
            "--result-cache-mib",
            "64",
            "--max-loras",
            "1",
            "--max-inference-steps",
            "5000",
            "--enable-batching-metrics",
        ),
        root / "server.log",
        env=StepHold(root).env(),
    )
    process.start(timeout_s=180)
    yield process
    process.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _route(server: ServerProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=300)


def _adapter(server: ServerProcess, tiny_flux_path: Path, folder: str, seed: int) -> str:
    """A random adapter written under the server's --lora-root; returns its folder name (relative to the root)."""
    from diffuserve.lora.tiny import write_random_lora

    write_random_lora(tiny_flux_path, server.log_path.parent / folder, rank=4, seed=seed)
    return folder


def _load(server: ServerProcess, name: str, folder: str) -> None:
    loaded = _route(server, "load_lora_adapter", {"lora_name": name, "lora_path": folder})
    assert loaded.status_code == 200, loaded.text


def _unload(server: ServerProcess, name: str) -> httpx.Response:
    return _route(server, "unload_lora_adapter", {"lora_name": name})


def _image(client: openai.OpenAI, prompt: str, seed: int, **extra: object) -> tuple[bytes, dict]:
    result = client.images.generate(
        model=MODEL,
        prompt=prompt,
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": 3, **extra},
    )
    return base64.b64decode(result.data[0].b64_json), result.model_extra["timings"]


def _pixels(png: bytes) -> np.ndarray:
    return pixels(decode_b64_png(base64.b64encode(png).decode()))


def _wait(server: ServerProcess, condition: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}; log tail:\n{server.log()[-3000:]}"
        time.sleep(0.05)


def _open_anchor(server: ServerProcess) -> socket.socket:
    """A request of 5000 steps over a raw socket, of another continuous group key than the 64x64 requests (its
    guidance: FLUX.1 packs sizes, so size alone no longer keeps them apart), so they queue behind it: closing it
    makes its row leave the group at the next step."""
    body = json.dumps(
        {"prompt": "the anchor", "seed": 99, "size": "32x32", "num_inference_steps": 5000, "guidance_scale": 1.5}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return sock


def _queue_behind_anchor(server: ServerProcess, pool: ThreadPoolExecutor, bodies: list[dict]) -> list:
    """Post `bodies` while the anchor runs, wait until all are queued, then let the anchor go: they start together
    (as far as the group's rules let them)."""
    wait_idle(server)
    anchor = _open_anchor(server)
    try:
        _wait(server, lambda: running(server), "the anchor running")
        posted = [
            pool.submit(httpx.post, f"{server.base_url}/v1/images/generations", json=b, timeout=300) for b in bodies
        ]
        _wait(server, lambda: metric_value(server.base_url, "diffuserve_queue_depth") == len(bodies), "the queue")
    finally:
        anchor.close()
    return posted


def test_a_replaced_adapter_is_never_answered_from_the_cache(server: ServerProcess, tiny_flux_path: Path) -> None:
    """Issue 34's steps: load `a` from a1, seed 1; unload; load `a` from a2; the same request answers a2's image
    (a fresh pipeline's), not the cached a1 image. The unload drops the entry made with a1."""
    a1, a2 = _adapter(server, tiny_flux_path, "a1", 11), _adapter(server, tiny_flux_path, "a2", 12)
    client = _client(server)
    _load(server, "a", a1)
    first, timings = _image(client, "a lighthouse", 1, lora="a")
    assert timings["result_cache"] == "miss"
    again, timings = _image(client, "a lighthouse", 1, lora="a")
    assert timings["result_cache"] == "hit" and again == first  # the cache does answer this request
    entries = metric_value(server.base_url, "diffuserve_result_cache_entries")
    assert _unload(server, "a").status_code == 200
    after_unload = metric_value(server.base_url, "diffuserve_result_cache_entries")
    _load(server, "a", a2)
    try:
        replaced, timings = _image(client, "a lighthouse", 1, lora="a")
    finally:
        assert _unload(server, "a").status_code == 200
    assert timings["result_cache"] == "miss" and replaced != first
    assert np.abs(_pixels(replaced) - _pixels(first)).max() > 3  # another adapter, another image
    assert after_unload == entries - 1  # the unload dropped the a1 entry
    reference = _fresh_image(tiny_flux_path, server.log_path.parent / a2, "a lighthouse", 1)
    assert np.abs(_pixels(replaced) - pixels(reference)).max() <= 1  # 1/255


def _fresh_image(tiny_flux_path: Path, adapter: Path, prompt: str, seed: int):
    """The image of `adapter`'s files on a pipeline that never saw another adapter: a fresh load with it installed
    as `serve --lora-modules a=ADAPTER` installs it (what a fresh server answers, without starting one)."""
    import torch

    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    pipe = load_pipeline(tiny_flux_path)
    install_lora(pipe, "flux", {"a": str(adapter)}, max_loras=1, max_rank=8, device="cpu", dtype=torch.float32)
    params = SamplingParams(
        prompt=prompt,
        seed=seed,
        width=64,
        height=64,
        num_inference_steps=3,
        guidance_scale=pipe.defaults.guidance_scale,  # what the server fills in for a request without one
        lora=(("a", 1.0),),
    )
    return pipe.run([params]).outputs[0].images[0]


def _steps_by_rows(server: ServerProcess) -> dict[int, float]:
    """Continuous denoising steps so far with exactly 1, 2 and 3 rows (the step-rows histogram's buckets)."""
    read, name = metric_reading(server.base_url), "diffuserve_continuous_step_batch_rows_bucket"
    up_to = [read(name, {"le": f"{rows}.0"}) for rows in range(4)]  # one scrape
    return {rows: up_to[rows] - up_to[rows - 1] for rows in (1, 2, 3)}


def test_an_unload_waits_for_the_running_and_queued_requests_of_a_continuous_server(
    server: ServerProcess, tiny_flux_path: Path
) -> None:
    """Two requests with adapter `slow` run as one continuous group, held at their first step, and a third (another
    guidance scale: another group) waits in the queue; an unload sent then refuses the adapter to new requests at
    once but ends only after all three finished with it (each answers 200: a step whose adapter is gone fails)."""
    _load(server, "slow", _adapter(server, tiny_flux_path, "slow", 13))
    hold = StepHold(server.log_path.parent)
    hold.arm()
    steps_before = _steps_by_rows(server)
    body = {"seed": 1, "size": "64x64", "num_inference_steps": 3, "lora": "slow"}
    bodies = [{**body, "prompt": f"slow {i} {StepHold.MARKER}", "seed": i} for i in (1, 2)]
    url = f"{server.base_url}/v1/images/generations"
    with ThreadPoolExecutor(5) as pool:
        try:
            posted = _queue_behind_anchor(server, pool, bodies)
            _wait(server, lambda: metric_value(server.base_url, "diffuserve_running_batch_size") == 2, "both rows")
            posted.append(pool.submit(httpx.post, url, json={**body, "prompt": "queued", "guidance_scale": 2.0}))
            _wait(server, lambda: metric_value(server.base_url, "diffuserve_queue_depth") == 1, "the third queued")
            unload = pool.submit(_unload, server, "slow")
            _wait(server, lambda: "slow" not in [m.id for m in _client(server).models.list()], "the unload begin")
            late = httpx.post(url, json={**body, "prompt": "late"}, timeout=60)
            assert late.status_code == 400 and "being unloaded" in late.json()["error"]["message"], late.text
            assert not unload.done()  # the rows and the queued request still use it
        finally:
            hold.release()
        answers = [future.result() for future in posted]
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text[-500:] for a in answers]
        assert [a.json()["timings"]["batch_size"] for a in answers] == [2, 2, 1]  # one group, then the queued one
        done = unload.result()
    assert done.status_code == 200 and done.text == "Success: LoRA adapter 'slow' removed successfully."
    # Denoising steps by rows (/metrics): the group's 3 steps of 2 rows, then the queued one's 3 alone (the
    # anchor's steps are 1-row steps too); never more than 2 rows.
    steps = {rows: n - steps_before[rows] for rows, n in _steps_by_rows(server).items()}
    assert (steps[2], steps[3]) == (3, 0) and steps[1] >= 3, steps


def test_a_continuous_group_never_needs_more_adapters_than_max_loras(
    server: ServerProcess, tiny_flux_path: Path
) -> None:
    """--max-loras 1: requests with adapters x and y queued together run one after the other (each alone in its
    group) and both succeed; a group of both would need two device slots."""
    _load(server, "x", _adapter(server, tiny_flux_path, "x", 14))
    _load(server, "y", _adapter(server, tiny_flux_path, "y", 15))
    bodies = [
        {"prompt": f"capped {name}", "seed": 5, "size": "64x64", "num_inference_steps": 3, "lora": name}
        for name in ("x", "y")
    ]
    try:
        with ThreadPoolExecutor(3) as pool:
            answers = [future.result() for future in _queue_behind_anchor(server, pool, bodies)]
    finally:
        for name in ("x", "y"):
            assert _unload(server, name).status_code == 200
    assert [a.status_code for a in answers] == [200, 200], [a.text[-500:] for a in answers]
    assert [a.json()["timings"]["batch_size"] for a in answers] == [1, 1]
