"""Podman for the container tests: the Debian base made with debootstrap (cached), the CPU image built by `make
image-cpu`, its config as `podman image inspect` reports it, and its entrypoint run the way `docker run` starts it.

This machine cannot `podman run` (crun fails setting rlimits) nor pull from a registry (STACK.md, "Container
images"). So a `Container` is a fresh container of the image (`podman create`, never started) whose writable
filesystem `podman mount` exposes; a command runs in it with `chroot --userspec` as the image's user, in new mount
and PID namespaces (`unshare`): it is PID 1, as under Docker, sees the volumes bound in and /proc of its own
namespace, and uses the host's network (as `docker run --network host`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.serverproc import REPO, free_port

CI_CACHE = Path(os.environ.get("DIFFUSERVE_CI_CACHE", "/var/cache/diffuserve-ci"))
"""Where the debootstrapped base is kept between runs (when the machine keeps /var/cache)."""
BASE_REPO = "localhost/diffuserve-ci-bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates")
"""A Debian with Python: what python:3.11-slim-bookworm, `make image-cpu`'s default base, gives users."""
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
"""Certificate authorities this host added (a TLS-intercepting proxy in CI): the base trusts them too, or the
build's pip cannot reach PyPI through that proxy."""
IMAGE = "diffuserve:cpu"
INSTALL_HINT = "apt-get install podman debootstrap (as root; .ci/run does this)"


def require_podman() -> None:
    """Skip with one line where podman cannot run here; in CI (`CI` set) fail instead: .ci/run installs it."""
    missing = [tool for tool in ("podman", "debootstrap", "unshare", "chroot") if shutil.which(tool) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed: {INSTALL_HINT}"
    elif os.geteuid() != 0:
        reason = "needs root (podman mount and chroot into the image)"
    else:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must build and run the container image, but {reason}")
    pytest.skip(reason)


def _run(argv: list[str], timeout_s: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    assert out.returncode == 0, (
        f"{shlex.join(argv)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


def base_image() -> str:
    """The Debian bookworm base with Python, as a local image; built once (debootstrap, ~2 min) and kept as a
    tarball under CI_CACHE, keyed by the package list and the host's added CAs."""
    cas = sorted(LOCAL_CAS.glob("*.crt"))
    key = hashlib.sha256(repr(DEBIAN_PACKAGES).encode() + b"".join(p.read_bytes() for p in cas)).hexdigest()[:12]
    tag = f"{BASE_REPO}:{key}"
    if subprocess.run(["podman", "image", "exists", tag]).returncode == 0:
        return tag
    tarball = CI_CACHE / f"bookworm-{key}.tar"
    if not tarball.is_file():
        rootfs = CI_CACHE / f"rootfs-{key}.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        CI_CACHE.mkdir(parents=True, exist_ok=True)
        packages = ",".join(DEBIAN_PACKAGES)
        _run(["debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs)], timeout_s=900)
        for ca in cas:
            shutil.copy(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
        if cas:
            _run(["chroot", str(rootfs), "update-ca-certificates"])
        # pip reads its own CA bundle (certifi), not the system's: point it at the system's.
        (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        partial = tarball.with_suffix(".partial")
        _run(["tar", "-C", str(rootfs), "-cf", str(partial), "."])
        partial.rename(tarball)
        shutil.rmtree(rootfs)
    _run(["podman", "import", str(tarball), tag])
    return tag


def cpu_torch_wheel(folder: Path) -> Path | None:
    """This venv's own CPU torch as a wheel (pip download, from wherever pip finds it here), so the image runs the
    torch the suite ran; None where pip cannot get it (the build then installs torch from PyTorch's CPU index)."""
    version = importlib.metadata.version("torch")
    if "+cpu" not in version:
        return None
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    if subprocess.run([*argv, "-d", str(folder), f"torch=={version}"], capture_output=True).returncode != 0:
        return None
    return next(folder.glob("torch-*.whl"), None)


def build_cpu_image(base: str, wheel: Path | None, log: Path) -> str:
    """`make image-cpu` with podman on `base`; returns the size line it printed."""
    # --no-print-directory: under `make test-container` this is a sub-make, which would end with "Leaving directory"
    argv = [
        "make",
        "--no-print-directory",
        "image-cpu",
        "CONTAINER_TOOL=podman",
        f"BASE_IMAGE={base}",
        f"IMAGE={IMAGE.split(':')[0]}",
    ]
    argv += [f"TORCH_WHEEL={wheel}"] if wheel else []
    with log.open("w") as out:
        code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=1500).returncode
    text = log.read_text(errors="replace")
    assert code == 0, f"{shlex.join(argv)} failed ({code}):\n{text[-5000:]}"
    return next(line for line in reversed(text.strip().splitlines()) if line.startswith(f"{IMAGE}: "))


@dataclass
class ImageConfig:
    """What `podman image inspect` says of the image (Docker's format: HEALTHCHECK included)."""

    name: str
    size: int
    user: str
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    ports: list[str]
    volumes: list[str]
    healthcheck: dict

    @classmethod
    def inspect(cls, name: str) -> ImageConfig:
        (info,) = json.loads(_run(["podman", "image", "inspect", name]).stdout)
        config = info["Config"]
        return cls(
            name=name,
            size=int(info["Size"]),
            user=config.get("User", ""),
            env=dict(item.split("=", 1) for item in config.get("Env", [])),
            entrypoint=config.get("Entrypoint") or [],
            cmd=config.get("Cmd") or [],
            ports=sorted(config.get("ExposedPorts") or {}),
            volumes=sorted(config.get("Volumes") or {}),
            healthcheck=info.get("Healthcheck") or config.get("Healthcheck") or {},  # podman's place, Docker's
        )

    @property
    def uid_gid(self) -> tuple[int, int]:
        uid, _, gid = self.user.partition(":")
        return int(uid), int(gid or uid)


@dataclass
class Container:
    """A fresh container of `config`'s image, its filesystem mounted; `volumes` maps a path in it to a host folder
    bound there for every command (`docker run -v HOST:PATH`). Use it as a context manager."""

    config: ImageConfig
    volumes: dict[str, Path] = field(default_factory=dict)
    name: str = field(default_factory=lambda: f"diffuserve-test-{uuid.uuid4().hex[:8]}")
    root: Path = Path("/nonexistent")

    def __enter__(self) -> Container:
        _run(["podman", "create", "--name", self.name, self.config.name])
        self.root = Path(_run(["podman", "mount", self.name]).stdout.strip())
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["podman", "umount", self.name], capture_output=True)
        subprocess.run(["podman", "rm", "--force", "--volumes", self.name], capture_output=True)

    def home(self) -> str:
        uid = str(self.config.uid_gid[0])
        for line in (self.root / "etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if fields[2] == uid:
                return fields[5]
        raise AssertionError(f"user {uid} is not in the image's /etc/passwd")

    def argv(self, command: list[str]) -> list[str]:
        """`command` (resolved on the image's PATH) as PID 1 of new namespaces, chrooted as the image's user."""
        root = shlex.quote(str(self.root))
        binds = [f"mount -t proc proc {root}/proc", f"mount --rbind /dev {root}/dev"]
        for path, host in self.volumes.items():
            target = shlex.quote(f"{self.root}{path}")
            binds += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(host))} {target}"]
        uid, gid = self.config.uid_gid
        script = "; ".join(["set -eu", *binds, f'exec chroot --userspec={uid}:{gid} {root} "$@"'])
        unshare = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child"]
        return [*unshare, "sh", "-c", script, "sh", *command]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The image's environment (not this process's), as the runtime gives it."""
        return {**self.config.env, "HOME": self.home(), **(extra or {})}

    def run(self, command: list[str], env: dict[str, str] | None = None, timeout_s: float = 180):
        return subprocess.run(self.argv(command), env=self.env(env), capture_output=True, text=True, timeout=timeout_s)


@dataclass
class ContainerServer:
    """The image's entrypoint (plus `args`) running in `container`, on a free port of the host's network."""

    container: Container
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300) -> ContainerServer:
        command = [*self.container.config.entrypoint, *self.container.config.cmd, "--port", str(self.port), *self.args]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.container.argv(command), env=self.container.env(self.env), stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the entrypoint exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"not healthy after {timeout_s}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def pid1(self) -> int:
        """The host's id of the entrypoint's process (unshare's child, which exec'd chroot, then diffuserve)."""
        assert self.proc is not None
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            except OSError:
                continue  # gone meanwhile
            if int(fields.get("PPid", "0")) == self.proc.pid:
                return int(status.parent.name)
        raise AssertionError("the entrypoint's process is gone")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # unshare --kill-child takes PID 1 (and so its namespace) with it
            self.proc.wait(30)
        self._log.close()
