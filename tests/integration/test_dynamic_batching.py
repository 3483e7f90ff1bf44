"""Dynamic batching over a real server: merges, caps, stop reasons, failure isolation, fidelity."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from tests.integration.conftest import FAULT_MARKER
from tests.integration.helpers import decode_b64_png, metric_reading, metric_value, pixels
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold, running, wait_idle

STATS_RE = re.compile(
    r"Dynamic batch stats \(last 5 dispatches\): avg_size=(\d+\.\d\d), merged_rate=(\d+\.\d)%, "
    r"full_rate=(\d+\.\d)%, utilization=(\d+\.\d)%, wait_avg=(\d+\.\d\d)ms, wait_p95=(\d+\.\d\d)ms, top_rejects=(\S.*)"
)


def _post_concurrently(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{base_url}/v1/images/generations", json=body, timeout=120)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


def _meeting_in_the_queue(server: ServerProcess, bodies: list[dict]) -> list[httpx.Response]:
    """Post `bodies` while a held request occupies the worker; release it once all of them are queued. They then
    meet in the queue however slowly they arrive (a loaded machine may spread arrivals past the batching delay)."""
    hold = StepHold(server.log_path.parent)
    hold.arm()
    wait_idle(server)

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=120)

    def wait(condition) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, server.log()[-2000:]
            time.sleep(0.05)

    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        try:
            # 32x32 is capped to 1 by the server's rule: dispatched at once, as config_cap:1
            held = pool.submit(post, _body(f"held {StepHold.MARKER}", 0, num_inference_steps=2, size="32x32"))
            wait(lambda: running(server))
            posted = [pool.submit(post, body) for body in bodies]
            wait(lambda: metric_value(server.base_url, "diffuserve_queue_depth") == len(bodies))
        finally:
            hold.release()
        assert held.result().status_code == 200
        return [future.result() for future in posted]


def _body(prompt: str, seed: int, **extra) -> dict:
    return {"prompt": prompt, "seed": seed, "size": "64x64", "num_inference_steps": 3, **extra}


def _dispatches(server: ServerProcess, reason: str) -> float:
    """Dispatches so far that stopped for `reason` (the stop_reason of the dispatch log line, from /metrics)."""
    return metric_value(server.base_url, "diffuserve_batch_dispatches_total", {"reason": reason})


def _four_row_dispatches(server: ServerProcess) -> float:
    """Dispatches so far of exactly 4 rows (size=4/4 of the dispatch log line: the size histogram's buckets)."""
    read, name = metric_reading(server.base_url), "diffuserve_batch_size_outputs_bucket"
    return read(name, {"le": "4.0"}) - read(name, {"le": "3.0"})


def test_four_concurrent_requests_dispatch_as_one_batch(dynamic_server):
    max_size, four = _dispatches(dynamic_server, "max_size"), _four_row_dispatches(dynamic_server)
    responses = _meeting_in_the_queue(dynamic_server, [_body(f"prompt {i}", i) for i in range(4)])
    assert [r.status_code for r in responses] == [200] * 4
    assert {r.json()["timings"]["batch_size"] for r in responses} == {4}
    assert _dispatches(dynamic_server, "max_size") == max_size + 1, "one dispatch, stopped by max_size"
    assert _four_row_dispatches(dynamic_server) == four + 1, "of 4 rows"


def test_n_counts_against_the_cap(dynamic_server):
    max_size, four = _dispatches(dynamic_server, "max_size"), _four_row_dispatches(dynamic_server)
    responses = _meeting_in_the_queue(dynamic_server, [_body("two", 1, n=2), _body("two more", 2, n=2)])
    assert all(r.status_code == 200 and len(r.json()["data"]) == 2 for r in responses)
    assert {r.json()["timings"]["batch_size"] for r in responses} == {2}
    assert _dispatches(dynamic_server, "max_size") == max_size + 1, "2 + 2 rows fill the cap of 4"
    assert _four_row_dispatches(dynamic_server) == four + 1


def test_different_step_counts_never_merge(dynamic_server):
    delay = _dispatches(dynamic_server, "delay")
    responses = _meeting_in_the_queue(
        dynamic_server,
        [  # both queued: the head's batch sees and rejects the other
            _body("three steps", 1),
            _body("two steps", 2, num_inference_steps=2),
        ],
    )
    assert [r.status_code for r in responses] == [200, 200]
    assert [r.json()["timings"]["batch_size"] for r in responses] == [1, 1]
    assert _dispatches(dynamic_server, "delay") == delay + 2, "two singleton dispatches, each after the delay"
    rejects = metric_value(
        dynamic_server.base_url, "diffuserve_batching_rejects_total", {"reason": "sampling_params.num_inference_steps"}
    )
    assert rejects >= 1


def test_config_rule_caps_to_one(dynamic_server):
    capped = _dispatches(dynamic_server, "config_cap:1")
    responses = _post_concurrently(dynamic_server.base_url, [_body("small", i, size="32x32") for i in range(2)])
    assert [r.status_code for r in responses] == [200, 200]
    assert [r.json()["timings"]["batch_size"] for r in responses] == [1, 1]
    assert _dispatches(dynamic_server, "config_cap:1") == capped + 2, "each dispatched alone by the config rule"


def test_failing_merged_batch_fails_all_its_requests_and_server_goes_on(dynamic_server):
    bodies = [_body("fine", 1), _body(f"broken {FAULT_MARKER}", 2), _body("fine too", 3), _body("also fine", 4)]
    responses = _meeting_in_the_queue(dynamic_server, bodies)
    assert [r.status_code for r in responses] == [500] * 4
    for response in responses:
        error = response.json()["error"]
        assert error["code"] == "generation_failed"
        assert "dynamic batch of 4 requests" in error["message"] and "injected fault" in error["message"]
    after = _post_concurrently(dynamic_server.base_url, [_body("next batch", i) for i in range(4)])
    assert [r.status_code for r in after] == [200] * 4
    assert httpx.get(f"{dynamic_server.base_url}/health").status_code == 200


def test_batched_rows_match_singleton_runs(dynamic_server, singleton_server):
    """Each request's output in a merged batch equals its singleton run (<= 1/255 per pixel)."""
    bodies = [_body(f"fidelity {i}", 100 + i, n=1 + (i == 1)) for i in range(3)]
    merged = _meeting_in_the_queue(dynamic_server, bodies)
    assert all(r.json()["timings"]["batch_size"] == 3 for r in merged)
    for body, response in zip(bodies, merged, strict=True):
        alone = httpx.post(f"{singleton_server.base_url}/v1/images/generations", json=body, timeout=120).json()
        assert alone["timings"]["batch_size"] == 1
        for batched_item, alone_item in zip(response.json()["data"], alone["data"], strict=True):
            diff = np.abs(
                pixels(decode_b64_png(batched_item["b64_json"])) - pixels(decode_b64_png(alone_item["b64_json"]))
            )
            assert diff.max() <= 1, f"max pixel difference {diff.max()} > 1/255"


def test_stats_line_and_prometheus_batching_metrics(dynamic_server):
    # Earlier tests in this module made well over 5 dispatches; make sure at least 5 more happen.
    for _ in range(2):
        _post_concurrently(dynamic_server.base_url, [_body("stats", i) for i in range(4)])
    _post_concurrently(dynamic_server.base_url, [_body("stats solo", 9, size="32x32")])
    match = dynamic_server.wait_for_log(STATS_RE.pattern)
    avg_size, merged, full, util = (float(match.group(i)) for i in range(1, 5))
    assert 1.0 <= avg_size <= 4.0 and 0 <= merged <= 100 and 0 <= full <= 100 and 0 < util <= 100
    base = dynamic_server.base_url
    assert metric_value(base, "diffuserve_batch_size_outputs_count") >= 5
    assert metric_value(base, "diffuserve_batch_dispatches_total", {"reason": "max_size"}) >= 1
    assert metric_value(base, "diffuserve_batch_dispatches_total", {"reason": "config_cap:1"}) >= 1
