"""A `--transformer-path` GGUF transformer over two real gloo ranks: CFG parallel and Ulysses sequence parallel
(each rank holds the whole packed weights) equal the single-process run (pixels within 1/255, on every rank). TP
and FSDP are refused at start-up (tests/integration/test_quantized_files_cli.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, run_two_ranks

MODES = ("cfg", "sp")


def _pipeline(paths: dict[str, str]):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(paths["checkpoint"], transformer_path=paths["file"])


def _run(pipe) -> np.ndarray:
    """Two true-CFG requests (one with n=2) in one batch."""
    import torch

    from diffuserve.sampling import SamplingParams

    common = {"width": 64, "height": 64, "num_inference_steps": 3, "true_cfg_scale": 4.0, "negative_prompt": "dark"}
    batch = [
        SamplingParams(prompt="a red fox", seed=1, n=2, **common),
        SamplingParams(prompt="a boat", seed=7, **common),
    ]
    with torch.inference_mode():
        return pixels(pipe.run(batch))


def _rank_main(rank: int, world: int, init_file: str, paths: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist

    from diffuserve.parallel.cfg_parallel import CfgParallel
    from diffuserve.parallel.sequence import enable_sequence_parallel

    out = Path(out_dir)
    with process_group(rank, world, init_file):
        pipe = _pipeline(paths)
        pipe.cfg_parallel = CfgParallel(dist.group.WORLD)  # each rank runs one CFG branch of every row
        np.save(out / f"cfg-rank{rank}.npy", _run(pipe))
        pipe.cfg_parallel = None
        sp = enable_sequence_parallel(pipe, ulysses_group=dist.group.WORLD)
        np.save(out / f"sp-rank{rank}.npy", _run(pipe))
        sp.remove()


@pytest.fixture(scope="module")
def paths(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import diffusers

    from tests.quant_files import original_layout, write_gguf

    file = tmp_path_factory.mktemp("gguf-parallel") / "flux-q8.gguf"
    sd = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_path / "transformer").state_dict()
    write_gguf(file, original_layout("flux", sd), "Q8_0", "flux")
    return {"checkpoint": str(tiny_flux_path), "file": str(file)}


@pytest.fixture(scope="module")
def outputs(paths, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("gguf-parallel-out")
    run_two_ranks(_rank_main, paths, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def single(paths) -> np.ndarray:
    return _run(_pipeline(paths))


@pytest.mark.parametrize("mode", MODES)
def test_gguf_transformer_over_two_ranks_equals_one_process(outputs, single, mode) -> None:
    for rank in (0, 1):
        ranked = np.load(outputs / f"{mode}-rank{rank}.npy")
        assert ranked.shape == single.shape
        assert np.abs(ranked.astype(np.int16) - single.astype(np.int16)).max() <= 1, (mode, rank)
