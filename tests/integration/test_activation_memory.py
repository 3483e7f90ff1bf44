"""Activation memory over a real server (issue 34 item 2): with a small `--activation-memory-gib`, a request whose
estimate alone is over the budget is a 400 in the OpenAI envelope naming the field and the largest value that fits
(and that value runs); /server_info and `diffuserve plan` show the budget. Admission beside running work (a second
request waits while the first's estimate holds the budget) is tested on the engine with gated steps
(tests/unit/test_activation.py)."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.serverproc import ServerProcess

BUDGET_GIB = "0.1"
"""Fits one 64x64 image of the tiny FLUX (~70 MiB estimated), not a 512x512 one (~140 MiB)."""


@pytest.fixture(scope="module")
def server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("activation")
    process = ServerProcess(
        ["--model-path", str(tiny_flux_path), "--activation-memory-gib", BUDGET_GIB], logs / "server.log"
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _refused(client: openai.OpenAI, **fields) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model="flux-tiny", prompt="too big", response_format="b64_json", **fields)
    return info.value


def _image(client: openai.OpenAI, **fields) -> list[Image.Image]:
    result = client.images.generate(
        model="flux-tiny", prompt="fits", response_format="b64_json", extra_body={"num_inference_steps": 2}, **fields
    )
    return [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]


def test_a_size_over_the_budget_is_a_400_naming_size_and_the_largest_square_that_runs(client):
    error = _refused(client, size="512x512")
    assert error.body["param"] == "size" and error.body["type"] == "invalid_request_error"
    message = error.body["message"]
    assert "size 512x512 needs ~" in message and f"the budget is {float(BUDGET_GIB):.2f} GiB" in message
    side = int(re.search(r"the largest square size that fits is (\d+)x\1", message).group(1))
    assert 64 <= side < 512
    (image,) = _image(client, size=f"{side}x{side}")
    assert image.size == (side, side)


def test_n_over_the_budget_names_n_and_the_largest_n_that_runs(client):
    error = _refused(client, size="256x256", n=8)
    assert error.body["param"] == "n"
    most = int(re.search(r"the largest n that fits is (\d+)", error.body["message"]).group(1))
    assert 1 <= most < 8
    assert len(_image(client, size="256x256", n=most)) == most


def test_server_info_and_plan_show_the_budget(server: ServerProcess, tiny_flux_path: Path, cli_main):
    info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
    memory = info["deployment_plan"]["activation_memory"]
    assert memory == {"budget_gib": float(BUDGET_GIB), "source": f"--activation-memory-gib {BUDGET_GIB}"}
    planned = cli_main("plan", "--model-path", str(tiny_flux_path))
    assert planned.returncode == 0, planned.stderr
    plan = planned.stdout
    # Without the flag: 0.75 x the available RAM after the weights (a CPU host).
    assert re.search(r"activation memory: [\d.]+ GiB per replica \(75% of available RAM [\d.]+ GiB after", plan), plan
