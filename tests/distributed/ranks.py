"""What the distributed tests share: the requests every rank runs, their pixels, and a 2-rank gloo launch."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp


def requests(model, build: str):
    """Two requests with CFG (one with n=2, prompts of different lengths): what every rank and the reference run."""
    from diffuserve.sampling import build_sampling_params

    if build == "wan":
        common = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3, "guidance_scale": 4.0}
    elif build == "flux":
        common = {"width": 64, "height": 64, "num_inference_steps": 3, "true_cfg_scale": 4.0}
    else:
        common = {"width": 64, "height": 64, "num_inference_steps": 2, "true_cfg_scale": 4.0}
    return [
        build_sampling_params(model, prompt="a red fox", negative_prompt="blurry", seed=1, n=2, **common),
        build_sampling_params(model, prompt="a cat on a long sandy beach", negative_prompt="dark", seed=5, **common),
    ]


def pixels(result) -> np.ndarray:
    """Every image (or video frame) of a BatchResult, stacked (flattened and concatenated when their sizes differ,
    as in a packed mixed-size batch)."""
    frames = []
    for output in result.outputs:
        for item in output.videos or output.images:
            for frame in item if isinstance(item, list) else [item]:
                frames.append(np.asarray(frame))
    if len({frame.shape for frame in frames}) > 1:
        return np.concatenate([frame.ravel() for frame in frames])
    return np.stack(frames)


@contextlib.contextmanager
def process_group(rank: int, world: int, init_file: str) -> Iterator[None]:
    """A gloo group for this rank (one torch thread), destroyed on exit."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(rank_main: Callable[..., None], checkpoints: dict[str, str], out_dir: Path, world: int = 2) -> None:
    """Spawn `rank_main(rank, world, init_file, checkpoints, out_dir)` on `world` ranks and wait for all."""
    init_file = Path(tempfile.mkdtemp()) / "rendezvous"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        rank_main,
        args=(world, str(init_file), checkpoints, str(out_dir)),
        nprocs=world,
        start_method="spawn",
        join=True,
    )


def run_two_ranks(rank_main: Callable[..., None], checkpoints: dict[str, str], out_dir: Path) -> None:
    """`run_ranks` on 2 ranks."""
    run_ranks(rank_main, checkpoints, out_dir, world=2)
