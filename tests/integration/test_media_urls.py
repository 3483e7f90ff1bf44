"""Remote image sources through a real server (`--allow-remote-urls`): the images come from a local HTTP server
(tests/media_server.py) that the server may reach only through the test-only loopback allowance
(DIFFUSERVE_TEST_MEDIA_LOOPBACK=1), with `--allowed-media-domains 127.0.0.1 169.254.169.254 10.0.0.1`: the two
non-public addresses are listed on purpose, to show that the address check refuses them anyway.

A fetched image must edit exactly as the same bytes uploaded; every guard (non-public address at a redirect hop,
a host not listed, a slow answer, a too-large answer) is a 400 naming the field, before anything is queued.
The pure checks and the remaining SSRF cases run in-process: tests/unit/test_safe_fetch.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.helpers import decode_b64_png, metric_value, pixels
from tests.media_server import MediaServer, media_server, png_bytes
from tests.serverproc import ServerProcess

EDIT = {"num_inference_steps": 2, "seed": 3}
CAP = 2 * 1024 * 1024
"""--max-upload-bytes of the server (the local server's `/big` is larger)."""


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    with media_server(png_bytes(48, 32, seed=11)) as server:
        yield server


@pytest.fixture(scope="module")
def url_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("media_urls")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--served-model-name",
            "tiny-flux-urls",
            "--allow-remote-urls",
            "--allowed-media-domains",
            "127.0.0.1",
            "169.254.169.254",
            "10.0.0.1",
            "--media-fetch-timeout-s",
            "1",
            "--max-upload-bytes",
            str(CAP),
        ],
        logs / "server.log",
        env={"DIFFUSERVE_TEST_MEDIA_LOOPBACK": "1"},
    )
    server.start()
    yield server
    server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_a_fetched_image_edits_as_the_uploaded_bytes(url_server, media):
    client = _client(url_server)
    upload = client.images.edit(image=("cat.png", media.image, "image/png"), prompt="make it blue", extra_body=EDIT)
    expected = pixels(decode_b64_png(upload.data[0].b64_json))
    before = len(media.requests)
    by_sdk = client.images.edit(image=[], prompt="make it blue", extra_body={"url": media.url("/cat.png"), **EDIT})
    by_json = httpx.post(
        f"{url_server.base_url}/v1/images/edits",
        json={"prompt": "make it blue", "images": [{"image_url": media.url("/cat.png")}], **EDIT},
        timeout=120,
    )
    assert by_json.status_code == 200, by_json.text
    for b64 in (by_sdk.data[0].b64_json, by_json.json()["data"][0]["b64_json"]):
        assert np.abs(pixels(decode_b64_png(b64)) - expected).max() == 0
    assert media.requests[before:] == [("/cat.png", f"127.0.0.1:{media.port}")] * 2


@pytest.mark.parametrize(
    ("path", "host", "needle"),
    [
        ("/redirect?to=http://169.254.169.254/latest/meta-data/", "127.0.0.1", "169.254.169.254 is a link-local"),
        ("/redirect?to=http://10.0.0.1/cat.png", "127.0.0.1", "10.0.0.1 is a private address"),
        ("/cat.png", "localhost", "localhost is not in --allowed-media-domains"),
        ("/slow", "127.0.0.1", "--media-fetch-timeout-s"),
        ("/big", "127.0.0.1", "--max-upload-bytes"),
    ],
)
def test_each_guard_is_a_400_naming_the_field(url_server, media, path, host, needle):
    client = _client(url_server)
    accepted = metric_value(url_server.base_url, "diffuserve_requests_total", {"endpoint": "images"})
    before = len(media.requests)
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[], prompt="x", extra_body={"url": media.url(path, host=host), **EDIT})
    assert info.value.body["param"] == "url" and needle in info.value.body["message"], info.value.body
    # The local server saw at most the first hop (a redirect); the refused place was never asked.
    assert [p for p, _ in media.requests[before:]] == ([path] if host == "127.0.0.1" else [])
    assert metric_value(url_server.base_url, "diffuserve_requests_total", {"endpoint": "images"}) == accepted
