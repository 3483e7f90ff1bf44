"""Text prefetch (`pipelines/text_prefetch.py`) without a model: requests queued while the encode lane is busy are
encoded together, one encoder call for all their texts, and each text's row is taken once.

Gated on events (a job that holds the lane), never on sleeps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from diffuserve.pipelines.lanes import Lanes
from diffuserve.pipelines.text_prefetch import TextPrefetch

WAIT_S = 30


@dataclass
class _Params:
    prompt: str
    size: int = 64

    def signature(self) -> tuple[int]:
        return (self.size,)


class _Pipeline:
    def __init__(self) -> None:
        self.side = Lanes("cpu")
        self.calls: list[list[str]] = []
        self.batches: list[list[str]] = []

    def lanes(self) -> Lanes:
        return self.side

    def encode_many(self, texts: list[str], requests: list[_Params]) -> list[dict[str, torch.Tensor]]:
        self.calls.append(list(texts))
        self.batches.append([r.prompt for r in requests])
        return [{"embeds": torch.full((1, 2), float(len(t)))} for t in texts]


def _hold_lane(overlap: Lanes) -> threading.Event:
    """Occupy the encode lane until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        assert release.wait(WAIT_S)

    overlap.encode.submit(hold)
    assert started.wait(WAIT_S)
    return release


def test_requests_queued_behind_a_busy_lane_are_encoded_in_one_call() -> None:
    pipeline = _Pipeline()
    prefetch = TextPrefetch(pipeline, pipeline.encode_many)
    release = _hold_lane(pipeline.side)
    done = threading.Semaphore(0)
    texts = ["a fox", "a lighthouse", "ramen", "a tram"]
    for text in texts:
        assert prefetch.submit(_Params(text), [text, ""], on_done=lambda steps: done.release())
    assert not prefetch.submit(_Params("a fox"), ["a fox"])  # already waiting: nothing more to do
    assert prefetch.submit(_Params("other size", 128), ["other size"], on_done=lambda steps: done.release())
    release.set()
    for _ in range(len(texts) + 1):  # every request hears of its encode
        assert done.acquire(timeout=WAIT_S)
    # One call per signature, each distinct text once, in arrival order.
    assert pipeline.calls == [["a fox", "", "a lighthouse", "ramen", "a tram"], ["other size"]]
    # The encode's batch is every member request (a family that encodes by role sees each one's prompt).
    assert pipeline.batches == [texts, ["other size"]]
    for text in [*texts, ""]:
        row = prefetch.take(text, _Params(text))
        assert row is not None and float(row["embeds"][0, 0]) == len(text)
        assert prefetch.take(text, _Params(text)) is None  # taken once
    assert prefetch.take("other size", _Params("other size")) is None  # another signature's entry
    assert prefetch.take("other size", _Params("other size", 128)) is not None


def test_a_request_arriving_after_the_job_started_opens_the_next_job() -> None:
    pipeline = _Pipeline()
    started, release = threading.Event(), threading.Event()
    calls: list[list[str]] = []

    def encode_many(texts: list[str], requests: list[_Params]) -> list[dict[str, torch.Tensor]]:
        calls.append(list(texts))
        if len(calls) == 1:  # the first job is running: a new request must not join it
            started.set()
            assert release.wait(WAIT_S)
        return [{"embeds": torch.zeros(1, 2)} for _ in texts]

    prefetch = TextPrefetch(pipeline, encode_many)
    done = threading.Semaphore(0)
    assert prefetch.submit(_Params("first"), ["first"], on_done=lambda steps: done.release())
    assert started.wait(WAIT_S)
    assert prefetch.submit(_Params("second"), ["second"], on_done=lambda steps: done.release())
    release.set()
    assert done.acquire(timeout=WAIT_S) and done.acquire(timeout=WAIT_S)
    assert calls == [["first"], ["second"]]
    assert prefetch.num_entries == 2
