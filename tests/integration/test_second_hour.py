"""Defaults that fit (issue 22 items 5 and 7), over a real server: an absolute --model-path is served under its
folder's name, an image server lists no video jobs of a shared results folder, an edit input larger than
--max-image-side (without size) is a 400 naming `image`, the log at info has no transformers loading chatter
(continuous mode's `timings.batch_rows`: test_continuous_batching.py, on its continuous server)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import httpx
from PIL import Image

from tests.serverproc import ServerProcess


def test_folder_name_ids_no_foreign_video_jobs_and_oversized_edit_input(tiny_flux_path: Path, tmp_path: Path):
    from diffuserve.storage import ResultStore

    checkpoint = tmp_path / "my-flux"
    shutil.copytree(tiny_flux_path, checkpoint)
    outputs = tmp_path / "shared-outputs"
    video_store = ResultStore(outputs)  # a video server's job in the same folder
    video_store.add("video_foreign", "video", "completed", {"model": "wan", "prompt": "a cat surfing"})
    video_store.close()
    server = ServerProcess(
        ["--model-path", f"{checkpoint.resolve()}/", "--max-image-side", "64", "--output-dir", str(outputs)],
        tmp_path / "server.log",
    )
    server.start(timeout_s=180)
    try:
        base = server.base_url
        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["my-flux"], models
        listed = httpx.get(f"{base}/v1/videos", timeout=30).json()
        assert listed["data"] == [] and listed["has_more"] is False, listed
        wide = io.BytesIO()
        Image.new("RGB", (80, 16), "white").save(wide, format="PNG")  # 1,280 pixels (under 64^2), one side over 64
        edit = httpx.post(
            f"{base}/v1/images/edits",
            timeout=60,
            data={"prompt": "a red circle"},
            files={"image": ("wide.png", wide.getvalue(), "image/png")},
        )
        assert edit.status_code == 400, edit.text
        error = edit.json()["error"]
        assert error["param"] == "image" and "--max-image-side" in error["message"], error
    finally:
        server.stop()
    log = server.log()  # (served under the folder's name: /v1/models above)
    # transformers' loading chatter stays below info (issue 22 item 7): no torchvision fallback note, no bars.
    assert "requires torchvision" not in log and "Loading weights" not in log, log[-3000:]
