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
