"""Per-request LoRA over two real gloo ranks equals the single-process run (pixels within 1/255, on every rank):
a merged true-CFG batch whose rows use different adapters (one, two summed, none) under tensor parallel (A / B
cut like their base weight, the row-parallel partial joining the base's all-reduce), CFG parallel, Ulysses
sequence parallel and FSDP. One 2-rank launch runs every mode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, run_two_ranks

PIXEL_TOLERANCE = 1
MODES = ("tp", "cfg", "sp", "fsdp")


def _batch(adapters: bool = True):
    import dataclasses

    from diffuserve.sampling import SamplingParams

    common = {"width": 64, "height": 64, "num_inference_steps": 3, "true_cfg_scale": 4.0, "negative_prompt": "dark"}
    batch = [
        SamplingParams(prompt="a red fox", seed=1, lora=(("style", 1.0),), n=2, **common),
        SamplingParams(prompt="a cat on a long sandy beach", seed=5, lora=(("style", 0.5), ("mlp", 1.5)), **common),
        SamplingParams(prompt="a boat", seed=7, **common),
    ]
    return batch if adapters else [dataclasses.replace(p, lora=()) for p in batch]


def _pipeline(paths: dict[str, str]):
    import torch

    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline

    pipe = load_pipeline(paths["checkpoint"])
    adapters = {k: v for k, v in paths.items() if k != "checkpoint"}
    install_lora(pipe, "flux", adapters, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    return pipe


def _run(pipe, adapters: bool = True) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return pixels(pipe.run(_batch(adapters)))


def _rank_main(rank: int, world: int, init_file: str, paths: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from diffuserve.lora.sharding import adapted_layers
    from diffuserve.parallel.cfg_parallel import CfgParallel
    from diffuserve.parallel.fsdp import shard_denoisers
    from diffuserve.parallel.sequence import enable_sequence_parallel
    from diffuserve.parallel.tensor import enable_tensor_parallel

    out = Path(out_dir)
    with process_group(rank, world, init_file):
        pipe = _pipeline(paths)
        pipe.cfg_parallel = CfgParallel(dist.group.WORLD)  # each rank runs one CFG branch of every row
        np.save(out / f"cfg-rank{rank}.npy", _run(pipe))
        pipe.cfg_parallel = None
        sp = enable_sequence_parallel(pipe, ulysses_group=dist.group.WORLD)
        np.save(out / f"sp-rank{rank}.npy", _run(pipe))
        sp.remove()

        pipe = _pipeline(paths)
        enable_tensor_parallel(pipe, mesh=init_device_mesh("cpu", (world,)))
        shapes = {
            n: [list(m._buffers[k].shape) for k in sorted(m._buffers)]
            for n, (m, _) in adapted_layers(pipe.adapter.transformer).items()
        }
        (out / f"tp-rank{rank}.json").write_text(json.dumps(shapes))
        np.save(out / f"tp-rank{rank}.npy", _run(pipe))

        pipe = _pipeline(paths)
        shard_denoisers(pipe)
        np.save(out / f"fsdp-rank{rank}.npy", _run(pipe))


@pytest.fixture(scope="module")
def paths(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from diffuserve.lora.tiny import write_random_lora

    root = tmp_path_factory.mktemp("loras-parallel")
    # Column-parallel (q/k/v, proj_mlp, the MLP's up projection) and row-parallel layers (to_out, the MLP's down
    # projection, the single blocks' packed proj_out), and the replicated final proj_out.
    mlp = ("to_q", "to_v", "proj_mlp", "proj_out", "ff.net.0.proj", "ff.net.2", "to_out.0", "to_add_out")
    return {
        "checkpoint": str(tiny_flux_path),
        "style": str(write_random_lora(tiny_flux_path, root / "style", rank=4, seed=1)),
        "mlp": str(write_random_lora(tiny_flux_path, root / "mlp", rank=2, seed=3, targets=mlp)),
    }


@pytest.fixture(scope="module")
def outputs(paths, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("lora-parallel")
    run_two_ranks(_rank_main, paths, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def single(paths) -> np.ndarray:
    pipe = _pipeline(paths)
    base, adapted = _run(pipe, adapters=False), _run(pipe)
    assert np.abs(base[:3].astype(np.int16) - adapted[:3].astype(np.int16)).max() > 3  # the adapters change rows
    return adapted


@pytest.mark.parametrize("mode", MODES)
def test_mixed_adapter_batch_over_two_ranks_equals_one_process(outputs, single, mode) -> None:
    for rank in (0, 1):
        ranked = np.load(outputs / f"{mode}-rank{rank}.npy")
        assert ranked.shape == single.shape
        assert np.abs(ranked.astype(np.int16) - single.astype(np.int16)).max() <= PIXEL_TOLERANCE, (mode, rank)


def test_tensor_parallel_cuts_a_and_b_like_their_base_weight(outputs) -> None:
    shapes = json.loads((outputs / "tp-rank0.json").read_text())
    # (slots, rank, in) A / (slots, out, rank) B; the tiny FLUX is 32 wide, its MLP 128, so a rank holds half.
    assert shapes["transformer_blocks.0.attn.to_q"] == [[2, 4, 32], [2, 16, 4]]  # column: B's out rows halved
    assert shapes["transformer_blocks.0.attn.to_out.0"] == [[2, 4, 16], [2, 32, 4]]  # row: A's in columns halved
    assert shapes["single_transformer_blocks.0.proj_out"] == [[2, 4, 80], [2, 32, 4]]  # packed row: (32 + 128) / 2
    assert shapes["proj_out"][0][2] == 32  # replicated (not in the plan): whole slots
