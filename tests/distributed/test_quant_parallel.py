"""Quantized DiTs (`--quantization`, issue 28 item 4) over two real gloo ranks equal one process with the same
quantization (pixels within 1/255, on every rank): CFG parallel, Ulysses and Ring sequence parallel, tensor
parallel (the quantized layers' int8 / float8 weights cut by hand with their per-row scales: column-wise with their
rows, whole for row-wise, FLUX single blocks' packed `proj_out` included) and FSDP2 (int8 / float8 weights, fp32
scales and biases in one all-gather), for fp8 and int8 on tiny FLUX.1; int8-dynamic under TP (where its
per-token activation scales see a slice of each token); TP also on Wan2.1 (its all-reduced q/k norms); and
per-request LoRA over an int8-dynamic base under TP. One 2-rank launch runs every case.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, requests, run_two_ranks

PIXEL_TOLERANCE = 1
"""Max difference of the decoded 8-bit pixels (the reduction order of attention and of the TP sums changes)."""
MODES = ("cfg", "ulysses", "ring", "tp", "fsdp")
CASES = [(mode, "flux", method) for method in ("fp8", "int8") for mode in MODES] + [
    # int8-dynamic where it differs: under TP a row-parallel layer quantizes each rank's slice of the activations
    # with its own per-token scale (the other modes give a rank whole tokens: the per-token scales are the same).
    ("tp", "flux", "int8-dynamic"),
    ("tp", "wan", "int8"),
]


def _load(path: str, build: str, method: str):
    from diffuserve import family_spec
    from diffuserve.models.loader import load_pipeline

    keep = family_spec.spec_for("wan" if build == "wan" else "flux").quant_keep
    return load_pipeline(path, quantization={"transformer": (method, keep)})


def _lora_batch():
    from diffuserve.sampling import SamplingParams

    common = {"width": 64, "height": 64, "num_inference_steps": 3, "true_cfg_scale": 4.0, "negative_prompt": "dark"}
    return [
        SamplingParams(prompt="a red fox", seed=1, lora=(("style", 1.0),), n=2, **common),
        SamplingParams(prompt="a cat on a long sandy beach", seed=5, lora=(("style", 0.5),), **common),
        SamplingParams(prompt="a boat", seed=7, **common),
    ]


def _with_lora(pipe, paths: dict[str, str]):
    import torch

    from diffuserve.lora.slots import install_lora

    install_lora(pipe, "flux", {"style": paths["style"]}, max_loras=1, max_rank=4, device="cpu", dtype=torch.float32)
    return pipe


def _run(pipe, build: str, lora: bool = False) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return pixels(pipe.run(_lora_batch() if lora else requests(pipe.describe_model(), build)))


def _parallel(pipe, mode: str, world: int):
    """Apply `mode` to a loaded pipeline; returns (held, full) bytes of the sharded quantized weights, or None."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from diffuserve.parallel.cfg_parallel import CfgParallel
    from diffuserve.parallel.fsdp import shard_denoisers
    from diffuserve.parallel.sequence import enable_sequence_parallel
    from diffuserve.parallel.tensor import enable_tensor_parallel, sharded_bytes

    if mode == "cfg":
        pipe.cfg_parallel = CfgParallel(dist.group.WORLD)
    elif mode == "ulysses":
        enable_sequence_parallel(pipe, ulysses_group=dist.group.WORLD)
    elif mode == "ring":
        enable_sequence_parallel(pipe, ring_group=dist.group.WORLD)
    elif mode == "tp":
        enable_tensor_parallel(pipe, mesh=init_device_mesh("cpu", (world,)))
        return sharded_bytes(pipe.adapter.transformer)
    else:
        shard_denoisers(pipe)
    return None


def _rank_main(rank: int, world: int, init_file: str, paths: dict[str, str], out_dir: str) -> None:
    import torch

    out = Path(out_dir)
    with process_group(rank, world, init_file):
        facts = {}
        for mode, build, method in CASES:
            pipe = _load(paths[build], build, method)
            facts[f"{mode}-{build}-{method}"] = _parallel(pipe, mode, world)
            np.save(out / f"{mode}-{build}-{method}-rank{rank}.npy", _run(pipe, build))
        pipe = _with_lora(_load(paths["flux"], "flux", "int8-dynamic"), paths)
        _parallel(pipe, "tp", world)
        to_q = pipe.adapter.transformer.transformer_blocks[0].attn.to_q
        facts["lora-tp-to_q"] = [list(to_q.weight.shape), str(to_q.weight.dtype), list(to_q.weight_scale.shape)]
        assert to_q.weight.dtype == torch.int8
        np.save(out / f"lora-tp-rank{rank}.npy", _run(pipe, "flux", lora=True))
        (out / f"facts-rank{rank}.json").write_text(json.dumps(facts))


@pytest.fixture(scope="module")
def paths(tiny_flux_path: Path, tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from diffuserve.lora.tiny import write_random_lora

    root = tmp_path_factory.mktemp("loras-quant-parallel")
    return {
        "flux": str(tiny_flux_path),
        "wan": str(tiny_checkpoint("wan")),
        "style": str(write_random_lora(tiny_flux_path, root / "style", rank=4, seed=1)),
    }


@pytest.fixture(scope="module")
def outputs(paths, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("quant-parallel")
    run_two_ranks(_rank_main, paths, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def single(paths) -> dict[str, np.ndarray]:
    """One process with the same quantization: every (build, method) of CASES, and the LoRA batch."""
    runs = {(b, m): _run(_load(paths[b], b, m), b) for b, m in {(b, m) for _, b, m in CASES}}
    runs[("lora", "int8-dynamic")] = _run(_with_lora(_load(paths["flux"], "flux", "int8-dynamic"), paths), "", True)
    return runs


def _max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.mark.parametrize(("mode", "build", "method"), CASES, ids=["-".join(c) for c in CASES])
def test_quantized_dit_over_two_ranks_equals_one_process(outputs, single, mode, build, method) -> None:
    for rank in (0, 1):
        ranked = np.load(outputs / f"{mode}-{build}-{method}-rank{rank}.npy")
        assert _max_diff(ranked, single[(build, method)]) <= PIXEL_TOLERANCE, (mode, build, method, rank)


def test_tensor_parallel_cuts_quantized_weights_with_their_scales(outputs, single) -> None:
    for rank in (0, 1):
        facts = json.loads((outputs / f"facts-rank{rank}.json").read_text())
        for method in ("fp8", "int8", "int8-dynamic"):
            held, full = facts[f"tp-flux-{method}"]
            assert 0 < held and held * 2 == full, (method, held, full)  # each rank holds half of the cut tensors
        # The tiny FLUX is 32 wide: a column-parallel to_q keeps 16 int8 rows and their 16 scales.
        assert facts["lora-tp-to_q"] == [[16, 32], "torch.int8", [16]], facts["lora-tp-to_q"]


def test_lora_over_a_quantized_base_under_tensor_parallel_equals_one_process(outputs, single) -> None:
    reference = single[("lora", "int8-dynamic")]
    for rank in (0, 1):
        assert _max_diff(np.load(outputs / f"lora-tp-rank{rank}.npy"), reference) <= PIXEL_TOLERANCE, rank
