"""The exact-result cache (`--result-cache-mib`, server/result_cache.py) on a real server, driven by the official
openai client: a repeated seeded request is answered from the cache, byte-identical, marked `result_cache: "hit"`
in `timings`; another seed, another prompt, other step-cache options or another input image miss, and a request
without a seed never hits; `/metrics` (parsed with prometheus_client) counts hits and misses; a url answer's entry
goes with its results-store row (here evicted by `--url-store-max-images 1`)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.integration.helpers import metric_value
from tests.serverproc import ServerProcess

METRIC = "diffuserve_result_cache_requests_total"


@pytest.fixture(scope="module")
def server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("result-cache")
    flags = ["--model-path", str(tiny_flux_path), "--served-model-name", "tiny-flux-results"]
    process = ServerProcess(
        [*flags, "--result-cache-mib", "1", "--url-store-max-images", "1", "--enable-warmup", "false"],
        logs / "server.log",
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _generate(client: openai.OpenAI, prompt: str = "a red circle", **extra) -> tuple[str, dict]:
    result = client.images.generate(
        prompt=prompt, size="64x64", extra_body={"num_inference_steps": 4, **extra}, response_format="b64_json"
    )
    return result.data[0].b64_json, result.model_extra["timings"]


def _counts(server: ServerProcess) -> tuple[float, float]:
    return tuple(metric_value(server.base_url, METRIC, {"outcome": o}) for o in ("hit", "miss"))


def test_a_repeated_seeded_request_is_answered_from_the_cache(server, client) -> None:
    hits, misses = _counts(server)
    first, timings = _generate(client, seed=11, step_cache={"method": "fbcache", "threshold": 0.2})
    assert timings["result_cache"] == "miss" and timings["inference_ms"] > 0
    again, timings = _generate(client, seed=11, step_cache={"method": "fbcache", "threshold": 0.2})
    assert timings["result_cache"] == "hit" and timings["inference_ms"] == 0 and timings["pipeline_calls"] == 0
    assert base64.b64decode(again) == base64.b64decode(first)  # byte-identical
    assert timings["step_cache"]["method"] == "fbcache"  # the counts of the run that made it
    assert _counts(server) == (hits + 1, misses + 1)


@pytest.mark.parametrize(
    "changed",
    [
        {"seed": 12},
        {"prompt": "a blue square"},
        {"step_cache": {"method": "fbcache", "threshold": 0.3}},
        {"guidance_scale": 2.0},
    ],
)
def test_any_other_setting_misses(server, client, changed) -> None:
    base = {"prompt": "a green triangle", "seed": 21, "step_cache": {"method": "fbcache", "threshold": 0.2}}
    _generate(client, **base)
    hits, misses = _counts(server)
    _, timings = _generate(client, **{**base, **changed})
    assert timings["result_cache"] == "miss"
    assert _counts(server) == (hits, misses + 1)


def test_a_request_without_a_seed_never_hits(server, client) -> None:
    hits, misses = _counts(server)
    for _ in range(2):
        _, timings = _generate(client, prompt="no seed given")
        assert timings["result_cache"] == "miss"
    assert _counts(server) == (hits, misses + 2)


def test_edits_key_on_the_input_images_bytes(client) -> None:
    def png(colour: str) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (64, 64), colour).save(buffer, "PNG")
        return buffer.getvalue()

    def edit(image: bytes) -> dict:
        result = client.images.edit(
            image=("in.png", image, "image/png"),
            prompt="make it blue",
            extra_body={"seed": 3, "num_inference_steps": 4},
        )
        return result.model_extra["timings"]

    assert edit(png("red"))["result_cache"] == "miss"
    assert edit(png("red"))["result_cache"] == "hit"
    assert edit(png("yellow"))["result_cache"] == "miss"


def test_a_url_answer_lives_no_longer_than_its_stored_result(server, client) -> None:
    def url_request(seed: int) -> tuple[str, dict]:
        result = client.images.generate(
            prompt="stored", size="64x64", response_format="url", extra_body={"num_inference_steps": 4, "seed": seed}
        )
        return result.data[0].url, result.model_extra["timings"]

    first_url, timings = url_request(31)
    assert timings["result_cache"] == "miss"
    again_url, timings = url_request(31)
    assert timings["result_cache"] == "hit" and again_url != first_url  # a fresh row of the same bytes
    assert httpx.get(again_url).content.startswith(b"\x89PNG")
    assert httpx.get(first_url).status_code == 404  # --url-store-max-images 1: the hit's row replaced it
    url_request(32)  # and this one replaces the hit's row
    assert httpx.get(again_url).status_code == 404
    _, timings = url_request(31)
    assert timings["result_cache"] == "miss"  # its row is gone from the store, so is the entry
