"""Which checkpoint a folder holds, without loading it: `checkpoint_fingerprint` (a content hash the exact-result
cache keys on and `diffuserve calibrate-cache` writes into its file), and `check_calibration`, the start-up check
that a `--step-cache-calibration` file was made for the checkpoint being served."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from diffuserve.errors import ConfigError

_WHOLE_FILE_BYTES = 1 << 20
"""Files up to this size (configs, tokenizers, tiny weights) are hashed whole."""
_SAMPLE_BYTES = 1 << 16
"""Larger files (real weights) are hashed by their size and three samples of this size (start, middle, end): reading
tens of GB at every start-up would take minutes, and a fine-tune or another checkpoint differs in every sample."""


def checkpoint_fingerprint(path: Path | str) -> str:
    """A short hash of a checkpoint folder's content (file names, sizes, small files whole, large ones sampled).

    The same bytes give the same fingerprint wherever the folder lies (a copy, another mount); another checkpoint, a
    fine-tune or an edited config gives another. Hidden files and folders (`.cache`, `.git`) are left out."""
    root = Path(path)
    digest = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        rel = file.relative_to(root).as_posix() if file != root else file.name
        if any(part.startswith(".") for part in Path(rel).parts):
            continue
        size = file.stat().st_size
        digest.update(f"{rel}\0{size}\0".encode())
        with file.open("rb") as handle:
            if size <= _WHOLE_FILE_BYTES:
                digest.update(handle.read())
                continue
            for offset in (0, size // 2, size - _SAMPLE_BYTES):
                handle.seek(offset)
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:20]


def _read(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--step-cache-calibration: cannot read {path!r} ({exc}).") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--step-cache-calibration: {path!r} is not a `diffuserve calibrate-cache` file.")
    return data


def check_calibration(path: str, model_path: Path, *, model_id: str | None = None, backend: str = "auto") -> None:
    """Refuse, naming `--step-cache-calibration`, a file this server cannot use for `model_path`: one calibrated for
    another family or another checkpoint (the `family` and `checkpoint` it records), or whose ratios do not match its
    own step count. A key the file lacks (files written by hand or by older versions) is not checked."""
    from diffuserve.models.registry import resolve_model

    data = _read(path)
    ratios = data.get("mag_ratios")
    redo = f"run `diffuserve calibrate-cache --model-path {model_path} --output FILE` and pass that FILE"
    if not isinstance(ratios, list) or len(ratios) < 2:
        raise ConfigError(f"--step-cache-calibration: {path!r} holds no 'mag_ratios' list of at least 2 steps; {redo}.")
    steps = data.get("num_inference_steps")
    if steps is not None and steps != len(ratios):
        raise ConfigError(
            f"--step-cache-calibration: {path!r} says num_inference_steps={steps} but holds {len(ratios)} ratios "
            f"(edited or truncated); {redo}."
        )
    family = resolve_model(model_path, model_id=model_id, backend=backend).family
    if data.get("family") not in (None, family):
        raise ConfigError(
            f"--step-cache-calibration: {path!r} was calibrated on a {data['family']} checkpoint, and this server "
            f"serves {family} ({model_path}); magnitude ratios are per checkpoint: {redo}."
        )
    if data.get("checkpoint") not in (None, checkpoint_fingerprint(model_path)):
        made_from = data.get("model_path", "another checkpoint")
        raise ConfigError(
            f"--step-cache-calibration: {path!r} was calibrated on another checkpoint ({made_from}, fingerprint "
            f"{data['checkpoint']}) than the one served ({model_path}); magnitude ratios are per checkpoint: {redo}."
        )
