"""The exact parallel strategies over two real gloo ranks, in one launch: each equals the single-process run.

- CFG parallel (FLUX.1 true CFG with a merged batch, Qwen-Image true CFG with norm rescaling, Wan2.1 video CFG):
  bit-identical, also with the DiT streamed layer by layer and the other components offloaded; families whose
  CFG must stay one doubled batch are refused.
- FSDP2 (FLUX.1, Qwen-Image, Wan2.1; and FSDP x CFG parallel on Wan2.1): bit-identical, each rank holding about
  half of the DiT.
- Meta-device load + FSDP: each rank reads only its own shards from the safetensors file (one pixel level: the
  materialized weights sit at other addresses than diffusers' load, which can leave them unaligned and move CPU
  kernels by ~1e-6, STACK.md); the same reader serves column- and row-wise tensor-parallel shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from diffuserve.errors import ConfigError
from tests.distributed.ranks import pixels, process_group, requests, run_two_ranks

BUILDS = ("flux", "qwen-image", "wan")


def _save(out_dir: str, name: str, frames: np.ndarray, facts: dict | None = None) -> None:
    np.save(Path(out_dir) / f"{name}.npy", frames)
    if facts is not None:
        (Path(out_dir) / f"{name}.json").write_text(json.dumps(facts))


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel
    from diffuserve.parallel.fsdp import shard_denoisers, sharded_bytes

    with process_group(rank, world, init_file), torch.inference_mode():
        for build in BUILDS:
            pipe = load_pipeline(checkpoints[build])
            enable_cfg_parallel(pipe)
            _save(out_dir, f"cfg-{build}-rank{rank}", pixels(pipe.run(requests(pipe.describe_model(), build))))
        for build in BUILDS:
            pipe = load_pipeline(checkpoints[build])
            full = sum(p.numel() * p.element_size() for p in pipe.adapter.transformer.parameters())
            shard_denoisers(pipe)
            if build == "wan":  # FSDP x CFG parallel: both ranks gather each block, each runs its own branch
                enable_cfg_parallel(pipe)
            frames = pixels(pipe.run(requests(pipe.describe_model(), build)))
            _save(
                out_dir,
                f"fsdp-{build}-rank{rank}",
                frames,
                {"full": full, "held": sharded_bytes(pipe.adapter.transformer)},
            )
        # CFG parallel over offloaded components: the DiT streamed layer by layer, the rest component-offloaded.
        pipe = load_pipeline(checkpoints["flux"])
        pipe.residency = _offloaded(pipe)
        enable_cfg_parallel(pipe)
        _save(out_dir, f"cfg-offload-rank{rank}", pixels(pipe.run(requests(pipe.describe_model(), "flux"))))
        _meta_load(rank, checkpoints, out_dir)


def _offloaded(pipe):
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    modes = {
        key: ResidencyMode.LAYERWISE_OFFLOAD if key == "transformer" else ResidencyMode.COMPONENT_OFFLOAD
        for key in pipe.components
    }
    plan = DeploymentPlan(
        components={
            k: ComponentPlan(name=k, group="dit" if k == "transformer" else "other", mode=m) for k, m in modes.items()
        }
    )
    return build_residency(plan, pipe.components, device="cpu", ledger=TransferLedger())


def _meta_load(rank: int, checkpoints: dict[str, str], out_dir: str) -> None:
    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.materialize import is_meta, materialize_module
    from diffuserve.parallel.fsdp import shard_denoisers, sharded_bytes

    path = checkpoints["flux"]
    pipe = load_pipeline(path, placement={"transformer": "meta"})
    dit = pipe.components["transformer"]
    facts = {
        "meta_at_load": is_meta(dit),
        "others_meta": any(
            is_meta(m) for k, m in pipe.components.items() if k != "transformer" and hasattr(m, "parameters")
        ),
    }
    facts["full"] = sum(p.numel() * p.element_size() for p in dit.parameters())
    shard_denoisers(pipe)
    facts["read"] = materialize_module(dit, Path(path) / "transformer", device="cpu")
    facts["held"] = sharded_bytes(dit)
    frames = pixels(pipe.run(requests(pipe.describe_model(), "flux")))
    facts["tp"] = _tensor_parallel_read(checkpoints["mlp"])
    _save(out_dir, f"meta-rank{rank}", frames, facts)


def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def _tensor_parallel_read(folder: str) -> dict:
    """A meta MLP under a colwise/rowwise TP plan, materialized per rank: its output vs the full model's."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from diffuserve.models.materialize import materialize_module

    with torch.device("meta"):
        mlp = _mlp()
    parallelize_module(mlp, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    read = materialize_module(mlp, folder, device="cpu")
    full = _mlp()
    full.load_state_dict(load_file(str(Path(folder) / "model.safetensors")))
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    diff = (mlp(x) - full(x)).abs().max().item()
    return {"read": read, "full": sum(t.numel() * t.element_size() for t in full.state_dict().values()), "diff": diff}


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint, tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    mlp_dir = tmp_path_factory.mktemp("mlp")
    torch.manual_seed(0)
    save_file(_mlp().state_dict(), str(mlp_dir / "model.safetensors"))
    checkpoints = {build: str(tiny_checkpoint(build)) for build in BUILDS} | {"mlp": str(mlp_dir)}
    out_dir = tmp_path_factory.mktemp("strategies")
    run_two_ranks(_rank_main, checkpoints, out_dir)
    return checkpoints, out_dir


@pytest.fixture(scope="module")
def single(outputs):
    """The single-process run of every build (the reference), computed once."""
    from diffuserve.models.loader import load_pipeline

    checkpoints, _ = outputs
    runs = {}
    for build in BUILDS:
        pipe = load_pipeline(checkpoints[build])
        runs[build] = pixels(pipe.run(requests(pipe.describe_model(), build)))
    return runs


@pytest.mark.parametrize("build", BUILDS)
def test_cfg_parallel_equals_the_single_process_run(outputs, single, build):
    _, out_dir = outputs
    for rank in (0, 1):
        ranked = np.load(out_dir / f"cfg-{build}-rank{rank}.npy")
        assert ranked.shape == single[build].shape and (ranked == single[build]).all(), (build, rank)  # exact


def test_cfg_parallel_over_offloaded_components_equals_the_single_process_run(outputs, single):
    _, out_dir = outputs
    for rank in (0, 1):
        ranked = np.load(out_dir / f"cfg-offload-rank{rank}.npy")
        assert (ranked == single["flux"]).all(), rank  # exact: offload moves weights, never changes arithmetic


@pytest.mark.parametrize("build", BUILDS)
def test_fsdp_equals_the_single_process_run_and_shards_the_weights(outputs, single, build):
    _, out_dir = outputs
    for rank in (0, 1):
        ranked = np.load(out_dir / f"fsdp-{build}-rank{rank}.npy")
        assert ranked.shape == single[build].shape and (ranked == single[build]).all(), (build, rank)  # exact
        sizes = json.loads((out_dir / f"fsdp-{build}-rank{rank}.json").read_text())
        assert sizes["held"] <= 0.6 * sizes["full"], sizes  # about half of the DiT on each rank


def test_meta_load_with_fsdp_reads_only_each_ranks_shard_and_equals_the_single_process_run(outputs, single):
    _, out_dir = outputs
    facts = [json.loads((out_dir / f"meta-rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, fact in enumerate(facts):
        ranked = np.load(out_dir / f"meta-rank{rank}.npy")
        assert ranked.shape == single["flux"].shape and np.abs(ranked.astype(int) - single["flux"]).max() <= 1, rank
        assert fact["meta_at_load"] and not fact["others_meta"], fact
        # Each rank read about half of the DiT, and what it read is what it holds: never the full model.
        assert fact["read"] == fact["held"] <= 0.6 * fact["full"], fact
    assert sum(f["read"] for f in facts) == facts[0]["full"], facts  # every byte of the DiT read once, by one rank


def test_meta_load_serves_tensor_parallel_shards(outputs):
    _, out_dir = outputs
    for rank in (0, 1):
        tp = json.loads((out_dir / f"meta-rank{rank}.json").read_text())["tp"]
        assert tp["diff"] <= 1e-6, tp
        # Colwise: half the rows of the first weight and bias; rowwise: half the columns, and the whole last bias.
        last_bias = 8 * 4
        assert tp["read"] == (tp["full"] - last_bias) // 2 + last_bias, tp


def test_families_with_one_doubled_cfg_batch_are_refused(tiny_checkpoint):
    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel

    sd3 = load_pipeline(tiny_checkpoint("sd3"))
    with pytest.raises(ConfigError) as err:
        enable_cfg_parallel(sd3)
    assert err.value.param == "enable_cfg_parallel" and "doubled batch" in err.value.message
