"""CFG parallel over two real gloo ranks equals the single-process run exactly (FLUX.1 true CFG with a merged
batch, Qwen-Image true CFG with norm rescaling, Wan2.1 video CFG), and families whose CFG must stay one
doubled batch are refused."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp

from diffuserve.errors import ConfigError

BUILDS = ("flux", "qwen-image", "wan")


def _requests(model, build: str):
    from diffuserve.sampling import build_sampling_params

    if build == "wan":
        common = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3, "guidance_scale": 4.0}
    elif build == "flux":
        common = {"width": 64, "height": 64, "num_inference_steps": 3, "true_cfg_scale": 4.0}
    else:
        common = {"width": 64, "height": 64, "num_inference_steps": 2, "true_cfg_scale": 4.0}
    return [build_sampling_params(model, prompt="a red fox", negative_prompt="blurry", seed=1, n=2, **common),
            build_sampling_params(model, prompt="a cat on a long sandy beach", negative_prompt="dark", seed=5, **common)]


def _pixels(result) -> np.ndarray:
    frames = []
    for output in result.outputs:
        for item in output.videos or output.images:
            for frame in item if isinstance(item, list) else [item]:
                frames.append(np.asarray(frame))
    return np.stack(frames)


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for build, path in checkpoints.items():
            pipe = load_pipeline(path)
            enable_cfg_parallel(pipe)
            np.save(Path(out_dir) / f"{build}-rank{rank}.npy", _pixels(pipe.run(_requests(pipe.describe_model(), build))))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def parallel_outputs(tiny_checkpoint, tmp_path_factory):
    checkpoints = {build: str(tiny_checkpoint(build)) for build in BUILDS}
    out_dir = tmp_path_factory.mktemp("cfg-parallel")
    init_file = Path(tempfile.mkdtemp()) / "rendezvous"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_main, args=(2, str(init_file), checkpoints, str(out_dir)), nprocs=2,
                       start_method="spawn", join=True)
    return checkpoints, out_dir


@pytest.mark.parametrize("build", BUILDS)
def test_cfg_parallel_equals_the_single_process_run(parallel_outputs, build):
    from diffuserve.models.loader import load_pipeline

    checkpoints, out_dir = parallel_outputs
    pipe = load_pipeline(checkpoints[build])
    single = _pixels(pipe.run(_requests(pipe.describe_model(), build)))
    for rank in (0, 1):
        ranked = np.load(out_dir / f"{build}-rank{rank}.npy")
        assert ranked.shape == single.shape and (ranked == single).all(), (build, rank)  # exact, as promised


def test_families_with_one_doubled_cfg_batch_are_refused(tiny_checkpoint):
    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel

    sd3 = load_pipeline(tiny_checkpoint("sd3"))
    with pytest.raises(ConfigError) as err:
        enable_cfg_parallel(sd3)
    assert err.value.param == "enable_cfg_parallel" and "doubled batch" in err.value.message
