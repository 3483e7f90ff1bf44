"""FSDP2 inference over two real gloo ranks: the DiT sharded block by block equals the single-process output
exactly (FLUX.1 and Wan2.1), and each rank holds about half of the DiT's weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, requests, run_two_ranks

BUILDS = ("flux", "wan")


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.fsdp import shard_denoisers, sharded_bytes

    with process_group(rank, world, init_file):
        for build, path in checkpoints.items():
            pipe = load_pipeline(path)
            full = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
            shard_denoisers(pipe)
            held = sharded_bytes(pipe.transformer)
            with torch.inference_mode():
                frames = pixels(pipe.run(requests(pipe.describe_model(), build)))
            np.save(Path(out_dir) / f"{build}-rank{rank}.npy", frames)
            (Path(out_dir) / f"{build}-rank{rank}.json").write_text(json.dumps({"full": full, "held": held}))


@pytest.fixture(scope="module")
def fsdp_outputs(tiny_checkpoint, tmp_path_factory):
    checkpoints = {build: str(tiny_checkpoint(build)) for build in BUILDS}
    out_dir = tmp_path_factory.mktemp("fsdp")
    run_two_ranks(_rank_main, checkpoints, out_dir)
    return checkpoints, out_dir


@pytest.mark.parametrize("build", BUILDS)
def test_fsdp_equals_the_single_process_run_and_shards_the_weights(fsdp_outputs, build):
    from diffuserve.models.loader import load_pipeline

    checkpoints, out_dir = fsdp_outputs
    pipe = load_pipeline(checkpoints[build])
    single = pixels(pipe.run(requests(pipe.describe_model(), build)))
    for rank in (0, 1):
        ranked = np.load(out_dir / f"{build}-rank{rank}.npy")
        assert ranked.shape == single.shape and (ranked == single).all(), (build, rank)
        sizes = json.loads((out_dir / f"{build}-rank{rank}.json").read_text())
        assert sizes["held"] <= 0.6 * sizes["full"], sizes  # about half of the DiT on each rank
