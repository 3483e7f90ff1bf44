"""FSDP2 inference over two real gloo ranks: the DiT sharded block by block equals the single-process output
exactly (FLUX.1 and Wan2.1), and each rank holds about half of the DiT's weights."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp

from tests.distributed.test_cfg_parallel import _pixels, _requests

BUILDS = ("flux", "wan")


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.fsdp import shard_denoisers, sharded_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for build, path in checkpoints.items():
            pipe = load_pipeline(path)
            full = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
            shard_denoisers(pipe)
            held = sharded_bytes(pipe.transformer)
            with torch.inference_mode():
                pixels = _pixels(pipe.run(_requests(pipe.describe_model(), build)))
            np.save(Path(out_dir) / f"{build}-rank{rank}.npy", pixels)
            (Path(out_dir) / f"{build}-rank{rank}.json").write_text(json.dumps({"full": full, "held": held}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_outputs(tiny_checkpoint, tmp_path_factory):
    checkpoints = {build: str(tiny_checkpoint(build)) for build in BUILDS}
    out_dir = tmp_path_factory.mktemp("fsdp")
    init_file = Path(tempfile.mkdtemp()) / "rendezvous"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_main, args=(2, str(init_file), checkpoints, str(out_dir)), nprocs=2,
                       start_method="spawn", join=True)
    return checkpoints, out_dir


@pytest.mark.parametrize("build", BUILDS)
def test_fsdp_equals_the_single_process_run_and_shards_the_weights(fsdp_outputs, build):
    from diffuserve.models.loader import load_pipeline

    checkpoints, out_dir = fsdp_outputs
    pipe = load_pipeline(checkpoints[build])
    single = _pixels(pipe.run(_requests(pipe.describe_model(), build)))
    for rank in (0, 1):
        ranked = np.load(out_dir / f"{build}-rank{rank}.npy")
        assert ranked.shape == single.shape and (ranked == single).all(), (build, rank)
        sizes = json.loads((out_dir / f"{build}-rank{rank}.json").read_text())
        assert sizes["held"] <= 0.6 * sizes["full"], sizes  # about half of the DiT on each rank
