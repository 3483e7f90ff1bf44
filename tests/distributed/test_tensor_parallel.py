"""Tensor parallel over real gloo ranks: the DiT's attention heads and MLP units split over 2 ranks equal the
single-process run (final latents within 1e-5 in fp32, pixels within 1/255) for FLUX.1, Qwen-Image and Wan2.1
on a merged batch with prompts of different lengths, each rank holds about half of the sharded weights, TP
composes with CFG parallel (CFG 2 x TP 2 for FLUX.1), and what cannot run is refused naming --tp-size. One
4-rank spawn runs both: one TP pair alone first, then CFG 2 x TP 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from diffuserve.errors import ConfigError
from tests.distributed.ranks import pixels, process_group, requests, run_ranks

BUILDS = ("flux", "qwen-image", "wan")
TP_ALONE_RANKS = (0, 1)
"""The TP pair that runs TP alone (the other pair joins only for CFG 2 x TP 2)."""
LATENT_TOLERANCE = 1e-5
"""fp32: the sharded matmuls sum in a different order (all-reduce of partial sums), nothing else changes."""


def _run(pipe, build: str) -> tuple[np.ndarray, np.ndarray]:
    """The final latents (recorded as they enter the VAE decode) and the pixels of one merged batch."""
    import torch

    latents: list[np.ndarray] = []
    decode = pipe.decode

    def recording_decode(final, state):
        latents.append(final.detach().float().cpu().numpy())
        return decode(final, state)

    pipe.decode = recording_decode
    with torch.inference_mode():
        frames = pixels(pipe.run(requests(pipe.describe_model(), build)))
    return np.concatenate(latents), frames


def _residency(components: dict):
    from diffuserve.config.plan import ComponentPlan, ResidencyMode
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import ComponentResidencyManager

    plans = {
        key: ComponentPlan(key, "other", ResidencyMode.COMPONENT_OFFLOAD) for key in components if key != "transformer"
    }
    manager = ComponentResidencyManager(components, plans, device="cpu", ledger=TransferLedger())
    manager.setup()
    return manager


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel
    from diffuserve.parallel.tensor import enable_tensor_parallel, sharded_bytes

    with process_group(rank, world, init_file):
        # Ranks {0, 1} and {2, 3} are TP pairs, {0, 2} and {1, 3} CFG pairs. First the pair {0, 1} runs TP alone
        # (both CFG branches on its two ranks) for every build, then all four run CFG 2 x TP 2 (FLUX.1: the
        # composition is the same for every family, and four ranks on two cores are costly).
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cfg", "tp"))
        runs = [("tp", build) for build in checkpoints] if rank in TP_ALONE_RANKS else []
        for mode, build in [*runs, ("cfg-tp", "flux")]:
            pipe = load_pipeline(checkpoints[build])
            keys = enable_tensor_parallel(pipe, mesh=mesh["tp"])
            if mode == "cfg-tp":
                enable_cfg_parallel(pipe, mesh["cfg"].get_group())
            else:  # as served: the sharded DiT resident, the other components offloaded between uses
                pipe.residency = _residency(pipe.components)
            held, full = sharded_bytes(pipe.adapter.transformer)
            latents, frames = _run(pipe, build)
            name = Path(out_dir) / f"{mode}-{build}-rank{rank}"
            np.savez(f"{name}.npz", latents=latents, pixels=frames)
            Path(f"{name}.json").write_text(json.dumps({"keys": keys, "held": held, "full": full}))


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint) -> dict[str, str]:
    return {build: str(tiny_checkpoint(build)) for build in BUILDS}


@pytest.fixture(scope="module")
def singles(checkpoints) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from diffuserve.models.loader import load_pipeline

    return {build: _run(load_pipeline(path), build) for build, path in checkpoints.items()}


@pytest.fixture(scope="module")
def tp_outputs(checkpoints, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("tensor-parallel")
    run_ranks(_rank_main, checkpoints, out_dir, world=4)
    return out_dir


def _assert_equal_to_single(
    out_dir: Path, mode: str, build: str, ranks: tuple[int, ...], single: tuple[np.ndarray, np.ndarray]
) -> None:
    latents, frames = single
    outputs = [np.load(out_dir / f"{mode}-{build}-rank{rank}.npz") for rank in ranks]
    for rank, ranked in enumerate(outputs):
        assert ranked["latents"].shape == latents.shape, (mode, build, rank)
        assert np.abs(ranked["latents"] - latents).max() <= LATENT_TOLERANCE, (mode, build, rank)
        diff = np.abs(ranked["pixels"].astype(np.int16) - frames.astype(np.int16))
        assert ranked["pixels"].shape == frames.shape and diff.max() <= 1, (mode, build, rank)
        # Every rank ends with the same output.
        assert (ranked["pixels"] == outputs[0]["pixels"]).all(), (mode, build, rank)


@pytest.mark.parametrize("build", BUILDS)
def test_tensor_parallel_equals_the_single_process_run_and_halves_the_weights(tp_outputs, singles, build):
    _assert_equal_to_single(tp_outputs, "tp", build, TP_ALONE_RANKS, singles[build])
    for rank in TP_ALONE_RANKS:
        facts = json.loads((tp_outputs / f"tp-{build}-rank{rank}.json").read_text())
        assert facts["keys"] == ["transformer"], facts
        # About half of the attention/MLP weights on each rank (row-wise biases stay whole, hence not exactly).
        assert 0.45 * facts["full"] <= facts["held"] <= 0.55 * facts["full"], facts


def test_tensor_parallel_composes_with_cfg_parallel(tp_outputs, singles):
    _assert_equal_to_single(tp_outputs, "cfg-tp", "flux", (0, 1, 2, 3), singles["flux"])


def test_what_tensor_parallel_cannot_run_is_refused(tiny_checkpoint, checkpoints):
    from diffusers import WanTransformer3DModel

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.tensor import check_tensor_parallel

    def refusal(pipe, degree: int) -> str:
        with pytest.raises(ConfigError) as err:
            check_tensor_parallel(pipe, degree)
        assert err.value.param == "tp_size" and err.value.message.startswith("--tp-size")
        return err.value.message

    flux = load_pipeline(checkpoints["flux"])
    assert "2 attention heads" in refusal(flux, 3) and "[1, 2]" in refusal(flux, 3)
    assert list(check_tensor_parallel(flux, 2)) == ["transformer"]
    assert list(check_tensor_parallel(load_pipeline(tiny_checkpoint("wan2.2")), 2)) == ["transformer", "transformer_2"]
    assert "no tensor-parallel plan" in refusal(load_pipeline(tiny_checkpoint("sd3")), 2)
    assert "diffusers backend" in refusal(load_pipeline(tiny_checkpoint("sd3"), backend="diffusers"), 2)
    # Heads divide but the MLP width does not: refused before any weight is sharded.
    wan = load_pipeline(checkpoints["wan"])
    config = dict(wan.adapter.transformer.config)
    config.update(ffn_dim=33)
    wan.components["transformer"] = WanTransformer3DModel.from_config(config)
    assert "not divisible by 2" in refusal(wan, 2)
