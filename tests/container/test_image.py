"""The container image, built and served for real: `make image-cpu` with podman on a debootstrapped Debian
bookworm, then the image's own entrypoint run as its non-root user and as PID 1 (tests/container/podman.py says
how, on a machine that cannot `podman run`): it serves the embedded demo model with nothing mounted, answers the
official SDK, passes its own HEALTHCHECK, drains on SIGTERM and exits 0; bad mounts and flags exit 2 with one line.

Opt-in (`pytest -m container`, `make test-container`; .ci/run runs it after the suite). Measured on this 2-core
machine: 3.5 min with the base and podman's layer cache kept (the cached build ~95 s, mostly hashing the torch wheel
and the 1.5 GB virtualenv; the runs ~100 s); from nothing (debootstrap, then every layer) 22 min of wall time at a
load of 10-20 from other sessions, about 6 min of CPU time.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from diffuserve.demo import shapes
from tests.container.podman import (
    IMAGE,
    Container,
    ContainerServer,
    ImageConfig,
    base_image,
    build_cpu_image,
    cpu_torch_wheel,
    require_podman,
)
from tests.serverproc import free_port
from tests.step_hold import StepHold, running

pytestmark = [pytest.mark.container, pytest.mark.timeout(2400)]  # the first test's set-up builds the image

CACHE = "/var/cache/diffuserve"
RESULTS = "/var/lib/diffuserve"
HOLD = "/run/hold"
"""Where the test's step-hold folder is bound in the container (the release file is written from outside)."""


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[ImageConfig, str]:
    require_podman()
    work = tmp_path_factory.mktemp("image")
    started = time.monotonic()
    base = base_image()
    based = time.monotonic()
    reported = build_cpu_image(base, cpu_torch_wheel(work), work / "build.log")
    config = ImageConfig.inspect(IMAGE)
    print(f"base {based - started:.0f} s, build {time.monotonic() - based:.0f} s; {reported}")
    return config, reported


def _volume(path: Path, owner: tuple[int, int] | None) -> Path:
    """A host folder for a volume: the image's user owns it (writable), or root does (unwritable for that user)."""
    path.mkdir(parents=True)
    if owner is not None:
        os.chown(path, *owner)
    return path


def test_the_image_keeps_its_contract(image: tuple[ImageConfig, str]):
    config, reported = image
    assert reported == f"{IMAGE}: {config.size / 1e6:.0f} MB", reported  # `make image-cpu` reports the size
    assert 0 < config.size < 4e9, f"the CPU image is {config.size / 1e9:.1f} GB"
    uid, gid = config.uid_gid
    assert uid != 0 and gid != 0 and config.user.replace(":", "").isdigit(), config.user  # runAsNonRoot can check
    assert config.entrypoint[:2] == ["diffuserve", "serve"] and "--host=0.0.0.0" in config.entrypoint
    assert f"--output-dir={RESULTS}/outputs" in config.entrypoint
    assert config.ports == ["30010/tcp"]
    assert config.volumes == sorted([CACHE, RESULTS]) and config.env["DIFFUSERVE_CACHE"] == CACHE
    assert config.healthcheck["Test"][0] == "CMD" and config.healthcheck["StartPeriod"] >= 60e9  # nanoseconds


def _generate(server: ContainerServer, prompt: str) -> np.ndarray:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(prompt=prompt, size="64x64", response_format="b64_json", extra_body={"seed": 0})
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))


def _assert_draws(pixels: np.ndarray, colour: str, shape: str, position: str) -> None:
    """The demo model drew what the prompt asked (its semantic test's read-back)."""
    assert pixels.shape == (64, 64, 3)
    assert shapes.dominant_colour(pixels) == colour
    assert shapes.best_shape(pixels, position)[0] == shape


def _healthcheck(container: Container, config: ImageConfig, port: int) -> tuple[int, str]:
    """The image's own HEALTHCHECK command, run in the container against this port."""
    test = config.healthcheck["Test"]
    out = container.run(test[1:], env={"DIFFUSERVE_HEALTH_URL": f"http://127.0.0.1:{port}/health"}, timeout_s=60)
    return out.returncode, (out.stdout + out.stderr).strip()


def test_the_entrypoint_serves_as_pid_1_and_drains_on_sigterm(image: tuple[ImageConfig, str], tmp_path: Path):
    config, _ = image
    hold = StepHold(_volume(tmp_path / "hold", None))
    hold.release_file.parent.chmod(0o755)
    results = _volume(tmp_path / "results", config.uid_gid)
    # Nothing on the cache: the demo model installed in the image at build time serves ("no model mounted").
    with Container(config, {RESULTS: results, HOLD: hold.release_file.parent}) as container:
        fault = f"hold_step:{StepHold.MARKER},release:{HOLD}/{hold.release_file.name}"
        server = ContainerServer(container, [], tmp_path / "serve.log", env={"DIFFUSERVE_FAULT_INJECTION": fault})
        try:
            server.start()
            nspid = (Path("/proc") / str(server.pid1()) / "status").read_text().split("NSpid:")[1].split("\n")[0]
            assert nspid.split()[-1] == "1", f"the entrypoint is not PID 1 in its namespace (NSpid {nspid})"
            assert _healthcheck(container, config, server.port) == (0, "")
            _assert_draws(_generate(server, "a red circle in the top left"), "red", "circle", "top left")
            # The marker is words in the prompt (the demo model draws something else): the held run's reference
            # is the same prompt and seed, unheld.
            held_prompt = f"a blue square in the bottom right {StepHold.MARKER}"
            hold.release()
            reference = _generate(server, held_prompt)

            hold.arm()  # the next request is held at its steps: SIGTERM comes while it runs
            answer: dict[str, np.ndarray] = {}
            request = threading.Thread(target=lambda: answer.update(pixels=_generate(server, held_prompt)))
            request.start()
            deadline = time.monotonic() + 120
            while not running(server):  # type: ignore[arg-type]  (duck-typed: base_url)
                assert time.monotonic() < deadline and request.is_alive(), "the held request never ran"
                time.sleep(0.05)
            os.kill(server.pid1(), signal.SIGTERM)  # as `docker stop` / the kubelet: to PID 1, from outside
            while httpx.get(f"{server.base_url}/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "/health never turned 503 (draining) after SIGTERM"
                time.sleep(0.05)
            code, line = _healthcheck(container, config, server.port)
            assert code == 1 and line.endswith("answered 503"), (code, line)
            hold.release()
            request.join(120)
            # Answered, though SIGTERM came first, and the same image as unheld (one process, batch of one: exact).
            assert "pixels" in answer and np.array_equal(answer["pixels"], reference)
            # Drained (the held request got its image, not a 503 of the shutdown timeout), then exit 0.
            assert server.proc is not None
            exit_code = server.proc.wait(120)
            assert exit_code == 0, server.log()[-3000:]
            store = results / "outputs" / "results.db"  # the results store, on the volume, made by the image's user
            assert store.is_file() and (store.stat().st_uid, store.stat().st_gid) == config.uid_gid
        finally:
            server.stop()


BAD_INPUTS = {
    "model-path": ({}, ["--model-path", "/models/FLUX.1-dev"], ["--model-path", "/models/FLUX.1-dev"]),
    "cache": ({CACHE: None}, [], [f"{CACHE}/models", "DIFFUSERVE_CACHE"]),
    "results": ({RESULTS: None}, [], ["--output-dir", f"{RESULTS}/outputs"]),
    "port": ({}, [], ["--port"]),
}
"""Case -> (volumes bound, None = an unwritable root-owned folder; extra flags; what the one line must name).
`cache`: a root-owned cache volume that has a models/ folder but no demo model (it is not the image's content)."""


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_mounts_and_flags_exit_2_with_one_line(image: tuple[ImageConfig, str], tmp_path: Path, case: str):
    config, _ = image
    volumes, flags, named = BAD_INPUTS[case]
    binds = {path: _volume(tmp_path / path.strip("/").replace("/", "-"), None) for path in volumes}
    if case == "cache":
        (binds[CACHE] / "models").mkdir()
    with socket.socket() as taken, Container(config, binds) as container:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1] if case == "port" else free_port()
        named = [*named, str(port)] if case == "port" else named
        out = container.run([*config.entrypoint, *config.cmd, "--port", str(port), *flags], timeout_s=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, f"exit {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
    assert lines and lines[-1].startswith("diffuserve serve: configuration error: "), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and sum("error" in line.lower() for line in lines) == 1, out.stderr
    assert all(word in lines[-1] for word in named), (lines[-1], named)
