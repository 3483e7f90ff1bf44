"""A server whose model cannot load exits non-zero at start-up, naming the broken part."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.serverproc import free_port


def test_broken_checkpoint_exits_1_naming_the_part(tiny_flux_path: Path, tmp_path: Path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_flux_path, broken)
    for item in (broken / "tokenizer_2").iterdir():
        item.unlink()
    out = subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", "serve", "--model-path", str(broken), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "tokenizer_2" in out.stderr and "failed to load" in out.stderr


def test_a_missing_adapter_exits_2_before_the_model_loads(tiny_flux_path: Path, tmp_path: Path):
    """`--lora-modules x=nope` is a bad path like any other: one line naming the flag and the path, exit 2, no load."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffuserve.cli",
            "serve",
            "--model-path",
            str(tiny_flux_path),
            "--port",
            str(free_port()),
            "--lora-modules",
            "x=nope",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--lora-modules: x=nope: 'nope' does not exist" in out.stderr, out.stderr[-2000:]
    assert "loading" not in out.stderr.lower() and "model loaded" not in out.stderr, out.stderr[-2000:]
