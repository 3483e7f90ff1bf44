"""Shared real servers: each starts once per session (a server costs ~5 s of imports and load)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serverproc import ServerProcess
from tests.step_hold import StepHold

FAULT_MARKER = "FAIL-THIS-BATCH"
HOLD_MARKER = "HOLD-MY-SIDE-STAGES"
"""Fault injection `hold:`: a side-lane encode / decode of such a request waits for two more denoising steps."""
LONG_STEPS = 2000
"""Steps of a video job meant to be cancelled while it runs (it never gets near the end)."""


@pytest.fixture(scope="session")
def singleton_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Default serving (singleton), observed from process start for the readiness contract."""
    logs = tmp_path_factory.mktemp("singleton")
    server = ServerProcess(
        ["--model-path", str(tiny_flux_path), "--served-model-name", "tiny-flux", "--model-id", "FLUX.1-dev"],
        logs / "server.log",
        env=StepHold(logs).env(),
    )
    server.start(observe=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def dynamic_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Dynamic batching, max 4, a long delay so concurrent requests meet; 32x32 capped to 1 by a rule;
    operator-only fault injection for prompts containing FAULT_MARKER (fail), HOLD_MARKER (slow side stages) or
    `StepHold.MARKER` (denoising steps wait for the test's release, `tests/step_hold.py`)."""
    logs = tmp_path_factory.mktemp("dynamic")
    rules = logs / "batching.json"
    rules.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "rules": [
                    {"model_contains": "tiny", "resolution": "32x32", "max_batch_size": 1},
                ],
            }
        )
    )
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--served-model-name",
            "tiny-flux-dynamic",
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "4",
            "--batching-delay-ms",
            "1500",
            "--batching-config",
            str(rules),
            "--enable-batching-metrics",
            "--max-queue-size",
            "0",
        ],
        logs / "server.log",
        env={
            "DIFFUSERVE_FAULT_INJECTION": f"prompt:{FAULT_MARKER},hold:{HOLD_MARKER},"
            f"{StepHold(logs).env()['DIFFUSERVE_FAULT_INJECTION']}"
        },
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def wan_server(tiny_wan_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Tiny Wan2.1 text-to-video, dynamic batching of 2 (shared by the video API tests); `StepHold.MARKER`
    prompts wait at their steps for the test's release."""
    logs = tmp_path_factory.mktemp("videos")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_wan_path),
            "--served-model-name",
            "tiny-wan",
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            "2",
            "--max-inference-steps",
            str(LONG_STEPS),
            "--max-queue-size",
            "0",
        ],
        logs / "server.log",
        env=StepHold(logs).env(),
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ltx2_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Tiny LTX-2 (a joint audio-video model, through the diffusers backend): its videos carry sound."""
    logs = tmp_path_factory.mktemp("ltx2")
    server = ServerProcess(
        ["--model-path", str(tiny_checkpoint("ltx2")), "--served-model-name", "tiny-ltx2"], logs / "server.log"
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def family_pipeline():
    """`family_pipeline(path, backend="auto")` -> `load_pipeline(path)`, loaded at most once per test session, so the
    family conformance suite and the per-family tests share one pipeline per tiny checkpoint. A test that changes
    the pipeline (residency, batched CFG) must put it back."""
    from diffuserve.models.loader import load_pipeline

    loaded: dict[tuple[Path, str], object] = {}

    def get(path: Path, backend: str = "auto"):
        if (path, backend) not in loaded:
            loaded[path, backend] = load_pipeline(path, backend=backend)
        return loaded[path, backend]

    return get


@pytest.fixture(scope="session")
def diffusers_pipeline():
    """`diffusers_pipeline(class_name, path)` -> `diffusers.<class_name>.from_pretrained(path)` (offline, progress
    bar off), loaded at most once per test session: the reference the family tests compare with."""
    loaded: dict[tuple[str, Path], object] = {}

    def get(class_name: str, path: Path):
        if (class_name, path) not in loaded:
            import diffusers

            from diffuserve.models.processor_substitutes import install_processor_substitutes

            install_processor_substitutes()  # Qwen processors without torchvision (a no-op where it exists)
            pipe = getattr(diffusers, class_name).from_pretrained(path, local_files_only=True)
            pipe.set_progress_bar_config(disable=True)
            loaded[class_name, path] = pipe
        return loaded[class_name, path]

    return get


@dataclass
class CliRun:
    """What one `diffuserve` command run in the test's process returned and printed."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli_main(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliRun]:
    """`cli_main(*argv)` -> `diffuserve ARGV` through the CLI's `main`, in this process: for commands that load no
    model and serve nothing (`plan`), where a real process costs seconds of interpreter and import start-up each.
    Whatever only a real process shows (exit without a traceback, torch never imported, a server that must not
    start) stays a subprocess."""
    from diffuserve.cli import main

    def run(*argv: str) -> CliRun:
        capsys.readouterr()
        code = main(list(argv))
        out = capsys.readouterr()
        return CliRun(code, out.out, out.err)

    return run
