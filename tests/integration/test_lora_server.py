"""Per-request LoRA over HTTP: `--lora-modules` at start-up, adapters as models, the `lora` field, rows with
different adapters in one dynamic batch, and 400s naming the field (one shared server)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.helpers import decode_b64_png, pixels
from tests.integration.test_dynamic_batching import _meeting_in_the_queue
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold

MODEL = "tiny-flux-lora"


@pytest.fixture(scope="module")
def lora_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Dynamic batching (max 4, 32x32 capped to 1 for the held request) with two random adapters loaded, two device
    slots, and runtime loads from the fixture's folder."""
    from diffuserve.lora.tiny import write_random_lora

    logs = tmp_path_factory.mktemp("lora")
    style = write_random_lora(tiny_flux_path, logs / "style", rank=4, seed=1)
    ink = write_random_lora(
        tiny_flux_path, logs / "ink", rank=8, alpha=4, seed=2, targets=("to_q", "to_v", "proj_mlp", "ff.net.2")
    )
    rules = logs / "batching.json"
    rules.write_text(
        json.dumps(
            {"schema_version": 1, "rules": [{"model_contains": "tiny", "resolution": "32x32", "max_batch_size": 1}]}
        )
    )
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--served-model-name",
            MODEL,
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "4",
            "--batching-delay-ms",
            "300",
            "--batching-config",
            str(rules),
            "--lora-modules",
            f"style={style}",
            f"ink={ink}",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--enable-lora-updates",
            "--lora-root",
            str(logs),
            "--enable-batching-metrics",
        ],
        logs / "server.log",
        env=StepHold(logs).env(),
    )
    server.start(timeout_s=180)
    yield server
    server.stop()


def _body(prompt: str, seed: int, **extra) -> dict:
    return {"prompt": prompt, "seed": seed, "size": "64x64", "num_inference_steps": 3, **extra}


def _post(server: ServerProcess, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _images(result: dict) -> list[np.ndarray]:
    return [pixels(decode_b64_png(item["b64_json"])) for item in result["data"]]


def test_adapters_are_models_whose_parent_is_the_base(lora_server: ServerProcess) -> None:
    cards = httpx.get(f"{lora_server.base_url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "style", "ink"]
    assert "parent" not in cards[0] and {c["parent"] for c in cards[1:]} == {MODEL}
    assert httpx.get(f"{lora_server.base_url}/v1/models/ink").json()["parent"] == MODEL


def test_model_naming_an_adapter_selects_it(lora_server: ServerProcess) -> None:
    by_field = _images(_post(lora_server, _body("a cat", 5, lora="style")))
    by_model = _images(_post(lora_server, _body("a cat", 5, model="style")))
    by_list = _images(_post(lora_server, _body("a cat", 5, lora=[{"name": "style", "scale": 1.0}])))
    base = _images(_post(lora_server, _body("a cat", 5)))
    assert np.array_equal(by_field[0], by_model[0]) and np.array_equal(by_field[0], by_list[0])
    assert np.abs(by_field[0] - base[0]).max() > 3


def test_rows_with_different_adapters_merge_and_equal_their_runs_alone(lora_server: ServerProcess) -> None:
    bodies = [
        _body("red house", 1, lora="style"),
        _body("a dog", 2),
        _body("sea at night", 3, n=2, lora=[{"name": "ink", "scale": 0.7}, {"name": "style", "scale": -0.5}]),
    ]
    merged = _meeting_in_the_queue(lora_server, bodies)
    assert [r.status_code for r in merged] == [200] * 3
    assert {r.json()["timings"]["batch_size"] for r in merged} == {3}
    for body, response in zip(bodies, merged, strict=True):
        alone = _post(lora_server, body)
        assert alone["timings"]["batch_size"] == 1
        for a, b in zip(_images(response.json()), _images(alone), strict=True):
            assert np.abs(a - b).max() <= 1, body


def test_an_unknown_model_names_the_adapters_and_the_closest_name(lora_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.images.generate(prompt="a cat", model="stlye", size="64x64")
    error = err.value.body if isinstance(err.value.body, dict) else {}
    error = error.get("error", error)
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert f"serves '{MODEL}' and its LoRA adapter(s) 'style', 'ink'" in error["message"], error
    assert error["message"].endswith("Did you mean 'style'?"), error
    card = httpx.get(f"{lora_server.base_url}/v1/models/inc")
    assert card.status_code == 404 and card.json()["error"]["message"].endswith("Did you mean 'ink'?"), card.text


def test_model_naming_an_adapter_with_lora_naming_another_is_refused(lora_server: ServerProcess) -> None:
    """Ambiguous (the adapter alone, or both?): a 400 naming lora that shows how to ask for both; `lora` may repeat
    the model's own adapter (to give its scale)."""
    client = openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a cat", model="style", size="64x64", extra_body={"lora": "ink"})
    error = err.value.body if isinstance(err.value.body, dict) else {}
    error = error.get("error", error)
    assert error["param"] == "lora" and f"give model '{MODEL}'" in error["message"], error
    assert '[{"name": "style"}, {"name": "ink"}]' in error["message"], error
    half = _body("a cat", 5, model="style", lora=[{"name": "style", "scale": 0.5}])
    assert np.array_equal(
        _images(_post(lora_server, half))[0], _images(_post(lora_server, {**half, "model": MODEL}))[0]
    )


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"lora": "nope"}, "no adapter named 'nope'"),
        ({"lora": [{"name": "style", "scale": 100.0}]}, "scale=100.0 is outside"),
        ({"lora": [{"name": "style"}, {"name": "style"}]}, "given twice"),
        ({"lora": [{"name": "style", "weight": 1}]}, "weight"),
    ],
)
def test_bad_lora_values_are_400_naming_the_field(lora_server: ServerProcess, extra: dict, words: str) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a cat", model=MODEL, size="64x64", extra_body=extra)
    error = err.value.body if isinstance(err.value.body, dict) else {}
    error = error.get("error", error)
    assert words in error["message"] and "lora" in (error.get("param") or ""), error


def test_an_adapter_for_another_model_stops_start_up_naming_the_module(tiny_flux_path: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from diffuserve.lora.tiny import write_random_lora
    from tests.serverproc import free_port

    folder = write_random_lora(tiny_flux_path, tmp_path / "other", rank=2, seed=4)
    state = load_file(folder / "pytorch_lora_weights.safetensors")
    moved = {k.replace("transformer_blocks.0.", "transformer_blocks.7."): v for k, v in state.items()}
    save_file(moved, folder / "pytorch_lora_weights.safetensors")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "serve",
            "--model-path",
            str(tiny_flux_path),
            "--port",
            str(free_port()),
            "--lora-modules",
            f"other={folder}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "--lora-modules other=" in out.stderr and "transformer_blocks.7.attn.to_k' does not exist" in out.stderr, (
        out.stderr[-2000:]
    )


def test_edits_take_the_lora_field(lora_server: ServerProcess) -> None:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buffer, format="PNG")

    def edit(**fields: str) -> httpx.Response:
        return httpx.post(
            f"{lora_server.base_url}/v1/images/edits",
            files={"image": ("in.png", buffer.getvalue())},
            data={"prompt": "make it blue", "seed": "3", "num_inference_steps": "3", **fields},
            timeout=120,
        )

    styled, plain, unknown = edit(lora="style"), edit(), edit(lora="nope")
    assert styled.status_code == plain.status_code == 200, styled.text
    assert np.abs(_images(styled.json())[0] - _images(plain.json())[0]).max() > 3
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora"


# -- runtime changes (--enable-lora-updates): each test leaves the server's adapters as it found them -----------


def _api(server: ServerProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=120)


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


def _metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_runtime_adapter_is_a_model_swaps_into_a_slot_and_unloads(lora_server: ServerProcess, tiny_flux_path: Path):
    """A third adapter on two slots: loaded from --lora-root, listed and selected as a model, split from a batch that
    would need three adapters, the same pixels after being swapped out and in again, counted on /metrics, gone once
    unloaded."""
    from diffuserve.lora.tiny import write_random_lora

    root = lora_server.log_path.parent
    write_random_lora(tiny_flux_path, root / "pen", rank=4, seed=5, targets=("to_k", "ff.net.0.proj"))
    loaded = _api(lora_server, "load_lora_adapter", {"lora_name": "pen", "lora_path": "pen"})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'pen' added successfully."
    client = openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="unused", max_retries=0)
    assert {m.id: getattr(m, "parent", None) for m in client.models.list()} == {
        MODEL: None,
        "style": MODEL,
        "ink": MODEL,
        "pen": MODEL,
    }
    extra = {"seed": 9, "num_inference_steps": 3}
    first = client.images.generate(prompt="a pen", model="pen", size="64x64", extra_body=extra)
    base = client.images.generate(prompt="a pen", model=MODEL, size="64x64", extra_body=extra)
    pen, plain = (pixels(decode_b64_png(r.data[0].b64_json)) for r in (first, base))
    assert np.abs(pen - plain).max() > 3

    _post(lora_server, _body("both", 3, lora=[{"name": "style"}, {"name": "ink"}]))  # pen leaves the slots
    bodies = [_body("one", 1, lora="style"), _body("two", 2, lora="ink"), _body("a pen", 9, model="pen")]
    merged = _meeting_in_the_queue(lora_server, bodies)
    assert [r.status_code for r in merged] == [200] * 3
    assert sorted(r.json()["timings"]["batch_size"] for r in merged) == [1, 2, 2]  # 3 adapters, 2 slots: split
    # Swapped out and back in: the same pixels (<= 1/255: in a batch the rows' adapters take the batched matmul),
    # which differ from the plain model's (above), so pen was in a slot again. The batch of 2 holds two adapters:
    # each request names another one.
    assert np.abs(_images(merged[2].json())[0] - pen).max() <= 1

    counts = _metrics(lora_server)
    assert counts[("diffuserve_lora_requests_total", (("adapter", "pen"),))] == 2
    assert counts[("diffuserve_lora_adapters", (("where", "registered"),))] == 3
    assert counts[("diffuserve_lora_adapters", (("where", "device"),))] == 2
    assert counts[("diffuserve_batching_rejects_total", (("reason", "lora_slots"),))] >= 1

    unloaded = _api(lora_server, "unload_lora_adapter", {"lora_name": "pen"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'pen' removed successfully."
    assert [m.id for m in client.models.list()] == [MODEL, "style", "ink"]
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a pen", size="64x64", extra_body={"lora": "pen"})
    assert err.value.body["param"] == "lora"


def test_runtime_changes_refuse_bad_input_naming_the_field(lora_server: ServerProcess, tiny_flux_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from diffuserve.lora.tiny import write_random_lora

    root = lora_server.log_path.parent
    folder = write_random_lora(tiny_flux_path, root / "moved", rank=2, seed=4)
    state = load_file(folder / "pytorch_lora_weights.safetensors")
    save_file(
        {k.replace("transformer_blocks.0.", "transformer_blocks.7."): v for k, v in state.items()},
        folder / "pytorch_lora_weights.safetensors",
    )
    cases = [
        ("load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path", "outside --lora-root"),
        ("load_lora_adapter", {"lora_name": "x", "lora_path": "nope"}, 400, "lora_path", "does not exist"),
        ("load_lora_adapter", {"lora_name": "style", "lora_path": "moved"}, 400, "lora_name", "already been loaded"),
        ("load_lora_adapter", {"lora_name": "x", "lora_path": "moved"}, 400, "lora_path", "blocks.7.attn.to_k"),
        ("unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name", "cannot be found"),
        ("set_lora", {"lora_nickname": "nope"}, 400, "lora_nickname", "give its lora_path"),
        ("set_lora", {"lora_nickname": "style", "strength": 99.0}, 400, "strength", "outside"),
    ]
    for route, body, status, param, words in cases:
        response = _api(lora_server, route, body)
        assert response.status_code == status and _error(response)["param"] == param, (route, body, response.text)
        assert words in _error(response)["message"], (route, body, response.text)
    assert [a["nickname"] for a in httpx.get(f"{lora_server.base_url}/v1/list_loras").json()["loaded_adapters"]] == [
        "style",
        "ink",
    ]


def test_set_lora_gives_requests_that_name_none_the_default(lora_server: ServerProcess) -> None:
    styled = _images(_post(lora_server, _body("a cat", 5, lora=[{"name": "style", "scale": 0.5}])))
    listing = _api(lora_server, "set_lora", {"lora_nickname": ["style"], "strength": [0.5]}).json()
    try:
        assert listing["active"]["transformer"][0] | {"path": None} == {
            "nickname": "style",
            "path": None,
            "merged": False,
            "strength": 0.5,
        }
        assert np.array_equal(_images(_post(lora_server, _body("a cat", 5)))[0], styled[0])
        explicit = _images(_post(lora_server, _body("a cat", 5, lora=[])))  # an explicit empty list: no adapter
    finally:
        cleared = _api(lora_server, "set_lora", {"lora_nickname": []})
    assert cleared.json()["active"]["transformer"] == []
    assert not np.array_equal(explicit[0], styled[0])
    assert np.array_equal(_images(_post(lora_server, _body("a cat", 5)))[0], explicit[0])


def test_unload_waits_for_the_requests_that_use_the_adapter(lora_server: ServerProcess, tiny_flux_path: Path) -> None:
    """The unload answers only once the running request that chose the adapter is done; meanwhile new requests may no
    longer choose it."""
    from concurrent.futures import ThreadPoolExecutor

    from diffuserve.lora.tiny import write_random_lora
    from tests.step_hold import running, wait_idle

    root = lora_server.log_path.parent
    write_random_lora(tiny_flux_path, root / "brief", rank=2, seed=6)
    assert (
        _api(lora_server, "load_lora_adapter", {"lora_name": "brief", "lora_path": str(root / "brief")}).status_code
        == 200
    )
    hold = StepHold(root)
    hold.arm()
    wait_idle(lora_server)
    with ThreadPoolExecutor(2) as pool:
        try:
            held = pool.submit(_post, lora_server, _body(f"held {StepHold.MARKER}", 1, lora="brief", size="32x32"))
            deadline = time.monotonic() + 60
            while not running(lora_server):
                assert time.monotonic() < deadline, lora_server.log()[-2000:]
                time.sleep(0.05)
            unload = pool.submit(_api, lora_server, "unload_lora_adapter", {"lora_name": "brief"})
            while "brief" in [m["id"] for m in httpx.get(f"{lora_server.base_url}/v1/models").json()["data"]]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = httpx.post(
                f"{lora_server.base_url}/v1/images/generations", json=_body("late", 2, lora="brief"), timeout=60
            )
            assert refused.status_code == 400 and "being unloaded" in _error(refused)["message"]
            assert not unload.done()  # the held request still uses it
        finally:
            hold.release()
        assert held.result()["data"] and unload.result().status_code == 200


def test_without_the_flag_runtime_changes_are_refused(singleton_server: ServerProcess) -> None:
    loaded = _api(singleton_server, "load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})
    assert loaded.status_code == 400 and _error(loaded)["param"] == "lora_path", loaded.text
    assert "--enable-lora-updates" in _error(loaded)["message"] and _error(loaded)["code"] == "lora_updates_disabled"
    assert _api(singleton_server, "set_lora", {"lora_nickname": "x"}).status_code == 400
    listing = httpx.get(f"{singleton_server.base_url}/v1/list_loras").json()
    assert listing["loaded_adapters"] == [] and listing["active"] == {"transformer": []}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's notice that OpenAI's own Sora API ends
def test_videos_route_the_lora_field_and_refuse_an_adapter_that_is_not_loaded(wan_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{wan_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="a wave", extra_body={"lora": "style"})
    error = err.value.body if isinstance(err.value.body, dict) else {}
    error = error.get("error", error)
    # Wan takes adapters (`WanLoraLoaderMixin`), but this server loaded none.
    assert error["param"] == "lora" and "no adapter named 'style'" in error["message"], error
