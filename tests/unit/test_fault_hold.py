"""The operator-only `hold_step:` fault (`pipelines/fault_hooks.py`) that integration tests gate on, without a model."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from diffuserve.pipelines.fault_hooks import ENV_VAR, InjectedFault, InjectedFaults, maybe_inject_faults
from diffuserve.pipelines.serving import ServingPipeline

WAIT_S = 30


@dataclass
class _Params:
    prompt: str


class _Loop:
    """A pipeline whose `run` reports `steps` denoising steps; `reaching` is set just before each report."""

    def __init__(self, steps: int = 3):
        self.steps = steps
        self.reported: list[int] = []
        self.reaching = threading.Event()

    def run(self, batch: list[Any], on_step: Any = None, **_: Any) -> str:
        for i in range(self.steps):
            self.reaching.set()
            if on_step is not None:
                on_step(i, self.steps)
            self.reported.append(i)
        return "done"


def _wrapped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, inner: Any) -> tuple[Any, Path]:
    release = tmp_path / "release"
    monkeypatch.setenv(ENV_VAR, f"prompt:BOOM,hold_step:HOLD,release:{release}")
    return maybe_inject_faults(ServingPipeline(inner)), release


def test_a_marked_call_reports_no_step_until_released(monkeypatch, tmp_path):
    inner = _Loop()
    pipeline, release = _wrapped(monkeypatch, tmp_path, inner)
    assert isinstance(pipeline.faults, InjectedFaults)
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(pipeline.run([_Params("a HOLD b")])))
    thread.start()
    assert inner.reaching.wait(WAIT_S)
    thread.join(0.2)  # a broken hold would finish here; a slow machine only keeps it held longer
    assert thread.is_alive() and inner.reported == []
    release.touch()
    thread.join(WAIT_S)
    assert result == ["done"] and inner.reported == [0, 1, 2]


def test_unmarked_calls_and_released_holds_run_freely_and_the_fault_still_fails(monkeypatch, tmp_path):
    inner = _Loop()
    pipeline, release = _wrapped(monkeypatch, tmp_path, inner)
    assert pipeline.run([_Params("plain")]) == "done"  # not marked: never waits for the file
    release.touch()
    assert pipeline.run([_Params("HOLD")]) == "done"  # released: runs on
    with pytest.raises(InjectedFault):
        pipeline.run([_Params("BOOM")])


def test_continuous_steps_of_a_marked_row_wait_in_check_step(monkeypatch, tmp_path):
    pipeline, release = _wrapped(monkeypatch, tmp_path, _Loop())
    done = threading.Event()
    thread = threading.Thread(target=lambda: (pipeline.check_step([_Params("x"), _Params("HOLD")]), done.set()))
    thread.start()
    assert not done.wait(0.2)
    release.touch()
    assert done.wait(WAIT_S)
    pipeline.check_step([_Params("plain")])


def test_hold_step_needs_an_absolute_release_path(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "hold_step:HOLD")
    with pytest.raises(ValueError, match="release:"):
        maybe_inject_faults(ServingPipeline(_Loop()))  # type: ignore[arg-type]
    monkeypatch.setenv(ENV_VAR, "hold:SIDE")
    inner = ServingPipeline(_Loop())  # type: ignore[arg-type]
    assert maybe_inject_faults(inner) is inner


def test_a_numbered_release_lets_that_many_steps_go_on(monkeypatch, tmp_path):
    inner = _Loop(steps=4)
    pipeline, release = _wrapped(monkeypatch, tmp_path, inner)
    release.write_text("2")
    thread = threading.Thread(target=lambda: pipeline.run([_Params("HOLD")]))
    thread.start()
    give_up = time.monotonic() + WAIT_S
    while len(inner.reported) < 2:  # steps 1 and 2 are released
        assert time.monotonic() < give_up, inner.reported
        time.sleep(0.01)
    thread.join(0.2)  # step 3 waits (a broken hold would finish here)
    assert thread.is_alive() and inner.reported == [0, 1]
    release.write_text("")
    thread.join(WAIT_S)
    assert inner.reported == [0, 1, 2, 3]
