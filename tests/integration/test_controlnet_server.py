"""ControlNet over HTTP with the official `openai` client (`extra_body`) and in `generate`: `--controlnet` at
start-up, control rows merged with plain ones in one dynamic batch (each equal to its run alone), 400s naming the
field before anything is queued, and exit 2 for a ControlNet of another family."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from tests.integration.helpers import decode_b64_png, pixels
from tests.integration.test_dynamic_batching import _meeting_in_the_queue
from tests.serverproc import ServerProcess
from tests.step_hold import StepHold

MODEL = "tiny-flux-controlnet"


def _png(seed: int, size: tuple[int, int] = (64, 64)) -> bytes:
    array = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def controlnet_folders(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffuserve.families.flux.controlnet import build_tiny_flux_controlnet

    root = tmp_path_factory.mktemp("cn-server")
    return {
        "canny": build_tiny_flux_controlnet(tiny_flux_path, root / "canny", seed=0),
        "union": build_tiny_flux_controlnet(tiny_flux_path, root / "union", num_modes=4, seed=1),
    }


@pytest.fixture(scope="module")
def cn_server(
    tiny_flux_path: Path, controlnet_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Dynamic batching (32x32 capped to 1 for the held request) with two ControlNets: `canny` and the Union `u`."""
    logs = tmp_path_factory.mktemp("cn-logs")
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
            "--controlnet",
            f"canny={controlnet_folders['canny']}",
            f"u={controlnet_folders['union']}",
        ],
        logs / "server.log",
        env=StepHold(logs).env(),
    )
    server.start(timeout_s=180)
    yield server
    server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _body(prompt: str, seed: int, **extra) -> dict:
    return {"prompt": prompt, "seed": seed, "size": "64x64", "num_inference_steps": 3, **extra}


def test_control_rows_and_plain_rows_merge_and_each_equals_its_run_alone(cn_server: ServerProcess) -> None:
    bodies = [
        _body("a cat", 1, control_image=_data_url(_png(1, (80, 48))), controlnet="canny"),
        _body("a dog", 2),
        _body(
            "a fox",
            3,
            n=2,
            control_image=base64.b64encode(_png(2)).decode(),
            controlnet="u",
            control_mode=1,
            controlnet_conditioning_scale=0.7,
            control_guidance_end=0.5,
        ),
    ]
    merged = _meeting_in_the_queue(cn_server, bodies)
    assert [r.status_code for r in merged] == [200] * 3, [r.text for r in merged]
    assert {r.json()["timings"]["batch_size"] for r in merged} == {3}
    client = _client(cn_server)
    for body, response in zip(bodies, merged, strict=True):
        extra = {k: v for k, v in body.items() if k not in ("prompt", "size", "n")}
        alone = client.images.generate(prompt=body["prompt"], size="64x64", n=body.get("n", 1), extra_body=extra)
        assert alone.timings["batch_size"] == 1  # type: ignore[attr-defined]
        for a, b in zip(response.json()["data"], alone.data, strict=True):
            assert np.abs(pixels(decode_b64_png(a["b64_json"])) - pixels(decode_b64_png(b.b64_json))).max() <= 1
    plain = client.images.generate(prompt="a cat", size="64x64", extra_body={"seed": 1, "num_inference_steps": 3})
    control = merged[0].json()["data"][0]["b64_json"]
    assert np.abs(pixels(decode_b64_png(plain.data[0].b64_json)) - pixels(decode_b64_png(control))).max() > 10


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"controlnet": "u", "control_mode": 7}, "control_mode", "7 is not one of its modes"),
        ({"controlnet": "u"}, "control_mode", "is missing"),
        ({}, "controlnet", "several ControlNets are loaded (canny, u)"),
        ({"controlnet": "depth"}, "controlnet", "no ControlNet named 'depth'"),
        ({"controlnet": "canny", "control_guidance_start": 1.0}, "control_guidance_start", "start < end"),
        ({"controlnet": "canny", "control_image": "aGVsbG8="}, "control_image", ""),
        ({"controlnet": "canny", "control_image": "https://example.com/a.png"}, "control_image", "remote URLs"),
        ({"controlnet": "canny", "step_cache": "fbcache"}, "step_cache", "refused for ControlNet rows"),
        ({"control_image": None, "control_mode": 1}, "control_mode", "applies with control_image"),
    ],
)
def test_bad_control_fields_are_400_naming_the_field(cn_server: ServerProcess, extra, param, words) -> None:
    body = {"control_image": _data_url(_png(0)), "seed": 1, **extra}
    if body["control_image"] is None:
        del body["control_image"]
    with pytest.raises(openai.BadRequestError) as err:
        _client(cn_server).images.generate(prompt="a cat", size="64x64", extra_body=body)
    error = err.value.body if isinstance(err.value.body, dict) else {}
    error = error.get("error", error)
    assert error["param"] == param and words in error["message"], error


def test_an_edit_with_a_control_image_is_400(cn_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _client(cn_server).images.edit(
            image=("in.png", _png(3), "image/png"),
            prompt="a cat",
            extra_body={"control_image": _data_url(_png(0)), "controlnet": "canny"},
        )
    assert "control_image" in str(err.value)


def test_generate_takes_the_control_flags_and_matches_the_server(
    cn_server: ServerProcess, tiny_flux_path: Path, controlnet_folders: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "pose.png").write_bytes(_png(4, (40, 40)))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "generate",
            "--model-path",
            str(tiny_flux_path),
            "--controlnet",
            f"u={controlnet_folders['union']}",
            "--control-image",
            str(tmp_path / "pose.png"),
            "--control-mode",
            "2",
            "--controlnet-conditioning-scale",
            "0.9",
            "--prompt",
            "a fox",
            "--seed",
            "5",
            "--width",
            "64",
            "--height",
            "64",
            "--num-inference-steps",
            "3",
            "--output-path",
            str(tmp_path),
            "--output-file-name",
            "fox",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    served = _client(cn_server).images.generate(
        prompt="a fox",
        size="64x64",
        extra_body={
            "seed": 5,
            "num_inference_steps": 3,
            "control_image": _data_url(_png(4, (40, 40))),
            "controlnet": "u",
            "control_mode": 2,
            "controlnet_conditioning_scale": 0.9,
        },
    )
    written = pixels(Image.open(tmp_path / "fox.png"))
    assert np.abs(written - pixels(decode_b64_png(served.data[0].b64_json))).max() <= 1


def test_a_controlnet_of_another_family_exits_2_naming_the_flag_and_both_families(
    tiny_flux_path: Path, tmp_path: Path, cli_main
) -> None:
    folder = tmp_path / "sd3-canny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "SD3ControlNetModel"}))
    args = ["--model-path", str(tiny_flux_path), "--controlnet", str(folder)]
    # `serve` in a real process (were it not refused, it would go on to serve); `plan` in this one.
    served = subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", "serve", *args], capture_output=True, text=True, timeout=300
    )
    for out in (served, cli_main("plan", *args)):
        assert out.returncode == 2, out.stderr[-2000:]
        assert "--controlnet: sd3-canny" in out.stderr and "for the sd3 family" in out.stderr, out.stderr[-2000:]
        assert "is a flux model" in out.stderr, out.stderr[-2000:]


def test_plan_counts_each_controlnet_as_a_component(
    tiny_flux_path: Path, controlnet_folders: dict[str, Path], cli_main
) -> None:
    out = cli_main(
        "plan",
        "--model-path",
        str(tiny_flux_path),
        "--json",
        "--controlnet",
        str(controlnet_folders["canny"]),
        f"u={controlnet_folders['union']}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    components = json.loads(out.stdout)["components"]
    from safetensors import safe_open

    for key, folder in (("controlnet", controlnet_folders["canny"]), ("controlnet_2", controlnet_folders["union"])):
        with safe_open(str(folder / "diffusion_pytorch_model.safetensors"), "pt") as f:
            expected = sum(4 * int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # float32 tensors
        assert components[key]["weight_bytes"] == expected and components[key]["mode"] == "resident", components[key]


def test_plan_refuses_splitting_a_controlnet_call_over_ranks(
    tiny_flux_path: Path, controlnet_folders, cli_main
) -> None:
    out = cli_main(
        "plan",
        "--model-path",
        str(tiny_flux_path),
        "--num-gpus",
        "2",
        "--tp-size",
        "2",
        "--gpu-memory-gib",
        "80",
        "--controlnet",
        str(controlnet_folders["canny"]),
    )
    assert out.returncode == 2 and "--controlnet with --tp-size" in out.stderr, out.stderr[-2000:]
