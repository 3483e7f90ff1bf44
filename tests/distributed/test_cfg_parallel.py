"""CFG parallel over two real gloo ranks equals the single-process run exactly (FLUX.1 true CFG with a merged
batch, Qwen-Image true CFG with norm rescaling, Wan2.1 video CFG), and families whose CFG must stay one
doubled batch are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diffuserve.errors import ConfigError
from tests.distributed.ranks import pixels, process_group, requests, run_two_ranks

BUILDS = ("flux", "qwen-image", "wan")


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel

    with process_group(rank, world, init_file):
        for build, path in checkpoints.items():
            pipe = load_pipeline(path)
            enable_cfg_parallel(pipe)
            np.save(Path(out_dir) / f"{build}-rank{rank}.npy", pixels(pipe.run(requests(pipe.describe_model(), build))))


@pytest.fixture(scope="module")
def parallel_outputs(tiny_checkpoint, tmp_path_factory):
    checkpoints = {build: str(tiny_checkpoint(build)) for build in BUILDS}
    out_dir = tmp_path_factory.mktemp("cfg-parallel")
    run_two_ranks(_rank_main, checkpoints, out_dir)
    return checkpoints, out_dir


@pytest.mark.parametrize("build", BUILDS)
def test_cfg_parallel_equals_the_single_process_run(parallel_outputs, build):
    from diffuserve.models.loader import load_pipeline

    checkpoints, out_dir = parallel_outputs
    pipe = load_pipeline(checkpoints[build])
    single = pixels(pipe.run(requests(pipe.describe_model(), build)))
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
