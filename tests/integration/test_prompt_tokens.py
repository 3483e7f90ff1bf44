"""One owner for the server's prompt token counts (`pipelines/prompt_limits.PromptTokens`, the front end's own,
built from the description's tokenizer folders: `with_counter`): it never shares a tokenizer with the encode path,
and every family reports prompt truncation from its spec's text encoders.

The race and the per-family checks run on loaded tiny pipelines (no server): the description API is what the
routes call; the video and /server_info checks use the shared session servers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec import spec_for
from diffuserve.pipelines.prompt_limits import checkpoint_limits, with_counter
from diffuserve.server.common import check_prompt

ENCODES = 800
"""Encodes the race test runs beside the counters (on the starting commit 1-8 of 300 came out unpadded)."""


def _load(path: Path, backend: str = "auto") -> Any:
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(path, backend=backend)


def _ctx(pipeline: Any, *, reject: bool = False) -> SimpleNamespace:
    """What `check_prompt` reads of the server: the engine's model description and the reject flag."""
    model = pipeline.describe_model()
    return SimpleNamespace(
        engine=SimpleNamespace(model=model),
        args=SimpleNamespace(limits=SimpleNamespace(reject_truncated_prompts=reject)),
    )


def test_usage_counting_beside_encodes_never_changes_what_an_encode_gets(tiny_flux_path: Path):
    """The bench defect of issue 25: the usage count tokenized on the pipeline's own fast T5 tokenizer (from the
    HTTP side) while the encode lane encoded with it, so an encode came out unpadded (27 of 64 tokens) and the
    group's `recipe.concat_cond` failed. Counting now runs on the owner's private copies: every encode is padded
    to the family length however many requests are counted beside it."""
    pipeline = _load(tiny_flux_path)
    ctx = _ctx(pipeline)
    length = pipeline.adapter.max_sequence_length
    prompts = ["a fox", "a red fox in fresh snow, golden hour", " ".join(["a very long prompt"] * 30)]
    stop, counted = threading.Event(), threading.Semaphore(0)
    errors: list[BaseException] = []

    def count(i: int) -> None:
        try:
            while not stop.is_set():
                # The usage path of one request: truncation check + usage text tokens in one count.
                check_prompt(ctx, {"prompt": prompts[i % 3], "negative_prompt": prompts[(i + 1) % 3]})
                counted.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)
            counted.release()

    counters = [threading.Thread(target=count, args=(i,)) for i in range(4)]
    for thread in counters:
        thread.start()
    counted.acquire()  # the counters are running before the first encode
    widths = []
    try:
        for i in range(ENCODES):
            embeds = pipeline.encode_text("text_encoder_2", [prompts[i % 3]], [])["prompt_embeds"]
            widths.append(embeds.shape[1])
    finally:
        stop.set()
        for thread in counters:
            thread.join()
    assert not errors, errors
    assert set(widths) == {length}, f"unpadded encodes: {sorted(set(widths))} (want {length})"


# (tiny checkpoint, backend, attribute of the adapter holding the length its last encoder really reads)
FAMILY_CASES = [
    ("flux", "native", "max_sequence_length"),
    ("flux", "diffusers", "_max_sequence_length"),
    ("flux2", "native", "max_sequence_length"),
    ("flux2-klein", "native", "max_sequence_length"),
    ("qwen-image", "native", None),
    ("qwen-image-2.1", "native", None),
    ("qwen-image-edit", "native", None),
    ("z-image", "native", "max_sequence_length"),
    ("sana", "native", None),
    ("sd3", "native", "max_sequence_length"),
    ("sd3", "diffusers", "_max_sequence_length"),
    ("wan", "native", "_max_length"),
]


@pytest.mark.parametrize(("name", "backend", "length_attr"), FAMILY_CASES, ids=[f"{n}-{b}" for n, b, _ in FAMILY_CASES])
def test_every_family_reports_a_truncated_prompt_from_its_spec(
    tiny_checkpoint, tiny_flux_path: Path, tiny_wan_path: Path, name: str, backend: str, length_attr: str | None
):
    path = {"flux": tiny_flux_path, "wan": tiny_wan_path}.get(name) or tiny_checkpoint(name)
    pipeline = _load(path, backend)
    facts = spec_for(pipeline.family).text_encoders
    assert facts, f"{pipeline.family}: its spec lists no text encoders"
    limits = checkpoint_limits(pipeline.family, pipeline.tokenizer_part, pipeline.text_readings)
    assert [limit.encoder for limit in limits] == [fact.label for fact in facts]
    if length_attr is not None:  # the limit reported is the length the encode really reads
        assert limits[-1].max_tokens == getattr(pipeline.adapter if backend == "native" else pipeline, length_attr)
    cut = [limit for limit in limits if limit.max_tokens is not None]
    words = 2 * max((limit.max_tokens for limit in cut), default=64) + 16
    long = " ".join(["fox"] * words)

    short = check_prompt(_ctx(pipeline), {"prompt": "a fox", "negative_prompt": None})
    assert short.warnings == [] and short.text_tokens > 0
    found = check_prompt(_ctx(pipeline), {"prompt": long, "negative_prompt": None})
    if not cut:  # Qwen-Image-Edit: diffusers gives the encoder the whole prompt, so nothing is cut
        assert found.warnings == [] and found.text_tokens >= words
        return
    assert found.warnings and all(w.startswith("prompt is ") for w in found.warnings)
    assert {w.split(" tokens for ")[1].split(",")[0] for w in found.warnings} == {limit.encoder for limit in cut}
    # usage counts the spec's last encoder, as far as the text reaches into it (net of chat templates)
    owner = with_counter(pipeline.describe_model()).prompt_tokens
    assert owner.usage == owner.limits[-1]  # the spec's last encoder (T5 for FLUX.1 and SD3)
    reads = owner.usage.max_tokens
    assert found.text_tokens == reads
    # the last text that fits the usage encoder (net of its template) warns nothing for it; one word more does
    low, high = 1, words  # tokens(low words) <= reads < tokens(high words)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if owner.tokens(" ".join(["fox"] * middle)) <= reads else (low, middle)
    label = owner.usage.encoder
    fits = check_prompt(_ctx(pipeline), {"prompt": " ".join(["fox"] * low)}).warnings
    over = check_prompt(_ctx(pipeline), {"prompt": " ".join(["fox"] * high)}).warnings
    assert not [w for w in fits if label in w] and [w for w in over if label in w]
    with pytest.raises(InvalidRequestError) as refused:
        check_prompt(_ctx(pipeline, reject=True), {"prompt": "a fox", "negative_prompt": long})
    assert refused.value.param == "negative_prompt" and refused.value.http_status == 400


def test_the_token_owner_never_holds_the_pipelines_tokenizers(tiny_flux_path: Path):
    """The front end's own tokenizers, loaded once per process from the folders the description names (plain
    data: the description carries no tokenizer)."""
    pipeline = _load(tiny_flux_path)
    model = pipeline.describe_model()
    assert model.prompt_tokens is None
    assert {e.folder for e in model.text_encoders} == {
        str(tiny_flux_path / "tokenizer"),
        str(tiny_flux_path / "tokenizer_2"),
    }
    owner = with_counter(model).prompt_tokens
    assert owner is with_counter(pipeline.describe_model()).prompt_tokens
    shared = {id(pipeline.adapter.tokenizer), id(pipeline.adapter.tokenizer_2)}
    assert not shared & {id(limit.tokenizer) for limit in owner.limits}
    assert owner.usage is not None and id(owner.usage.tokenizer) not in shared


def test_a_video_job_with_a_long_prompt_answers_with_warnings(wan_server):
    """The video routes count through the same owner: the new job's answer carries the warnings (the job object
    keeps none), the log says it, and the job runs as usual."""
    base, start = wan_server.base_url, len(wan_server.log())
    long = " ".join(["fox"] * 600)  # UMT5 reads at most 512
    created = httpx.post(f"{base}/v1/videos", json={"prompt": long, "num_inference_steps": 1}, timeout=30)
    assert created.status_code == 200, created.text
    job = created.json()
    assert [w.split(" tokens for ")[1].split(",")[0] for w in job["warnings"]] == ["text_encoder (UMT5)"]
    wan_server.wait_for_log("request truncated by the text encoders", start=start)
    short = httpx.post(f"{base}/v1/videos", json={"prompt": "a fox", "num_inference_steps": 1}, timeout=30).json()
    assert "warnings" not in short
    deadline = time.monotonic() + 120
    for video_id in (job["id"], short["id"]):  # both run; the shared server is left idle for the next test
        status = "queued"
        while status in ("queued", "in_progress") and time.monotonic() < deadline:
            status = httpx.get(f"{base}/v1/videos/{video_id}", timeout=30).json()["status"]
            time.sleep(0.02)
        assert status == "completed", wan_server.log()[-2000:]


def test_server_info_lists_the_token_limits(singleton_server):
    """/server_info says what each text encoder reads (the start-up log built the owner at load)."""
    info = httpx.get(f"{singleton_server.base_url}/server_info", timeout=30).json()
    assert info["pipeline"]["text_encoders"] == {"text_encoder (CLIP)": 77, "text_encoder_2 (T5)": 64}
