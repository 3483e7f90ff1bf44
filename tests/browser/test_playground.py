"""The playground page: its security headers and file rules over HTTP, then the page itself in a real
headless Chromium (Playwright driving Debian's `chromium`): ask for the key, show the model and plan,
generate with streaming, and render the final image at the right size and with the API's pixels; a video model's
job list shows why a job failed (one the server's drain cut short)."""

from __future__ import annotations

import base64
import io
import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from diffuserve.server.job_drain import stopped_error
from diffuserve.server.video_jobs import VideoJob, VideoJobStore
from diffuserve.storage import ResultStore
from tests.conftest import STREAMING_API_KEY
from tests.serverproc import ServerProcess

INSTALL_HINT = (
    "install a headless browser: `apt-get install -y chromium` (Debian) and `pip install playwright` "
    "(in the test extra); or point DIFFUSERVE_CHROMIUM at a Chromium binary"
)


def _chromium() -> str | None:
    candidates = [
        os.environ.get("DIFFUSERVE_CHROMIUM"),
        "/usr/lib/chromium/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
        shutil.which("google-chrome"),
    ]
    return next((c for c in candidates if c and Path(c).is_file()), None)


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = _chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        path = None
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(
                f"CI must run the browser test, but no browser is available: {INSTALL_HINT} (.ci/run does this)"
            )
        pytest.skip(f"no headless browser here: {INSTALL_HINT}")
    return path


def test_headers_and_only_its_own_files(streaming_server):
    base = streaming_server.base_url
    for path in ("/playground", "/playground/playground.js", "/playground/playground.css", "/playground/config.json"):
        response = httpx.get(f"{base}{path}", timeout=30)  # no API key: the page and its files hold no data
        assert response.status_code == 200, path
        csp = response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert response.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(f"{base}/playground", timeout=30).text
    assert '<script src="/playground/playground.js"' in page and "<script>" not in page, "no inline script"
    assert "http://" not in page and "https://" not in page, "no third-party assets"
    assert httpx.get(f"{base}/playground/config.json", timeout=30).json() == {"auth_required": True}
    for path in (
        "/playground/__init__.py",
        "/playground/static/index.html",
        "/playground/..%2f__init__.py",
        "/playground/%2e%2e/app.py",
        "/playground/index.htm",
    ):
        keyed = httpx.get(f"{base}{path}", timeout=30, headers={"Authorization": f"Bearer {STREAMING_API_KEY}"})
        assert keyed.status_code == 404, path
        assert httpx.get(f"{base}{path}", timeout=30).status_code == 401, "only the page's own files are public"
    assert httpx.get(f"{base}/server_info", timeout=30).status_code == 401, "the API itself still needs the key"


def test_playground_generates_in_headless_chromium(streaming_server, chromium_path, tmp_path: Path):
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            page = browser.new_page()
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(f"{streaming_server.base_url}/playground")
            page.wait_for_selector("#auth:not([hidden])")
            page.fill("#api-key", STREAMING_API_KEY)
            page.click("#connect")
            # Function forms, not expression strings: the page's CSP (rightly) forbids eval.
            page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny-flux-stream'")
            assert "components" in page.text_content("#plan")
            for selector, value in (
                ("#size", "64x64"),
                ("#steps", "4"),
                ("#seed", "11"),
                ("#n", "1"),
                ("#partial-images", "2"),
                ("#prompt", "a red fox"),
            ):
                page.fill(selector, value)
            page.click("#generate")
            page.wait_for_function(
                "() => { const img = document.querySelector('figure img.final');"
                " return img && img.complete && img.naturalWidth > 0; }",
                timeout=120_000,
            )
            width, height, src = page.eval_on_selector(
                "figure img.final", "img => [img.naturalWidth, img.naturalHeight, img.src]"
            )
            partials = page.get_attribute("figure", "data-partials")
            page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        finally:
            browser.close()
    assert (width, height) == (64, 64)
    assert partials == "2", "both partial images were shown before the final one"
    assert errors == [], errors  # a CSP violation or a script error would show here
    # What the page rendered is what the API makes for the same request.
    reference = httpx.post(
        f"{streaming_server.base_url}/v1/images/generations",
        timeout=60,
        headers={"Authorization": f"Bearer {STREAMING_API_KEY}"},
        json={"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 11, "guidance_scale": 3.5},
    )
    shown = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")
    expected = Image.open(io.BytesIO(base64.b64decode(reference.json()["data"][0]["b64_json"]))).convert("RGB")
    assert np.array_equal(np.asarray(shown), np.asarray(expected))
    assert (tmp_path / "playground.png").stat().st_size > 0


def test_a_video_job_stopped_by_a_drain_shows_why(tiny_wan_path: Path, chromium_path, tmp_path: Path):
    """The job list of a video model shows a failed job's error: here the row a drain cut short leaves (written
    through the store as the drain writes it; the drain itself is tested in tests/integration)."""
    from playwright.sync_api import sync_playwright

    outputs = tmp_path / "outputs"
    results = ResultStore(outputs)
    jobs = VideoJobStore(results)
    fields = {"width": 32, "height": 32, "num_frames": 5, "fps": 8, "num_inference_steps": 4, "seed": 1}
    jobs.add(VideoJob(id="video_cut", model="tiny-wan", prompt="a fox cut by the drain", **fields))
    jobs.set_progress("video_cut", 3, 4)
    error = stopped_error("its deadline, --shutdown-timeout-s 0.5, passed")
    assert jobs.fail("video_cut", error)
    results.close()
    args = ["--model-path", str(tiny_wan_path), "--served-model-name", "tiny-wan", "--output-dir", str(outputs)]
    server = ServerProcess(args, tmp_path / "server.log").start(timeout_s=240)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=chromium_path,
                headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            try:
                page = browser.new_page()
                page.goto(f"{server.base_url}/playground")
                page.wait_for_selector('li[data-id="video_cut"][data-status="failed"]', timeout=60_000)
                shown = page.text_content('li[data-id="video_cut"] .title')
            finally:
                browser.close()
    finally:
        server.stop()
    assert shown is not None and "failed 75%" in shown and error["message"] in shown, shown
