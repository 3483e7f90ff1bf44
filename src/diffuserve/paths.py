"""Where diffuserve keeps files it was not told where to put: the cache folder and what lives under it.

Imports nothing of diffuserve (config/ and models/ both read it, and neither may pull the other in), and no torch.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$DIFFUSERVE_CACHE`, or `~/.cache/diffuserve`."""
    env = os.environ.get("DIFFUSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "diffuserve"


def default_output_dir() -> Path:
    """The results store's folder when --output-dir is not given: `outputs` under the cache folder."""
    return default_cache_dir() / "outputs"
