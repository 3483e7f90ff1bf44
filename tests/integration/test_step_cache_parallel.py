"""Step caches compose with the parallel strategies, the residency modes and compile: a cached batch over two real
gloo ranks (CFG parallel, Ulysses, Ring, tensor parallel, FSDP, FSDP x CFG parallel) equals the same cached batch
in one process, with the same computed / reused counts per request on every rank; under component offload and
under torch.compile it equals the resident, uncompiled run.

Every case runs a merged batch of two CFG requests whose thresholds differ, so at some steps one row computes while
the other reuses (checked). The ranks agree on each row's measure (`parallel/agreement.py`): CFG rank 0's
conditional branch decides for both ranks; sequence parallel sums the measure over the token split (a 48x48 batch
pads its 9 tokens to 10 over 2 ranks: the padding is left out). One launch of 2 ranks runs every case. Without the
agreement, CFG rank 1 decides from its negative branch (its counts differ: 5 computed instead of 4) and the
sequence-parallel ranks abort in their collectives (checked by hand).

Tolerances: CFG parallel runs the single process's arithmetic, so its pixels are equal; sequence and tensor
parallel reduce in another order (~1e-6 on the latents, their own tests), so 1/255 per pixel channel; FSDP 1/255
too (a cached FSDP batch was seen one level off on a few pixels while the uncached one is bit-identical; its
gathered weights sit at other addresses, which can move CPU kernels by ~1e-6, STACK.md).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, run_two_ranks

STEPS = 6
PIXEL_TOL = 1
CASES = {  # name -> (size, method, pixel tolerance)
    "cfg-fbcache": (64, "fbcache", 0),
    "cfg-teacache": (64, "teacache", 0),
    "ulysses-fbcache": (64, "fbcache", PIXEL_TOL),
    "ulysses-teacache": (64, "teacache", PIXEL_TOL),
    "ulysses-odd-fbcache": (48, "fbcache", PIXEL_TOL),
    "ring-fbcache": (64, "fbcache", PIXEL_TOL),
    "tp-fbcache": (64, "fbcache", PIXEL_TOL),
    "fsdp-fbcache": (64, "fbcache", PIXEL_TOL),
    "fsdp-cfg-teacache": (64, "teacache", PIXEL_TOL),
}
THRESHOLDS = {"fbcache": (0.05, 0.3), "teacache": (0.05, 0.6)}
"""Per method, the two requests' thresholds: the first computes more often than the second."""


def _batch(model, size: int, method: str):
    from diffuserve.config.step_cache import parse_step_cache
    from diffuserve.sampling import build_sampling_params

    common = {"width": size, "height": size, "num_inference_steps": STEPS, "true_cfg_scale": 4.0}
    prompts = (("a red fox", 1), ("a cat on a long sandy beach", 5))
    return [
        build_sampling_params(
            model,
            prompt=prompt,
            negative_prompt="blurry",
            seed=seed,
            step_cache=parse_step_cache(
                {"method": method, "threshold": threshold, "warmup_steps": 1, "max_cached_steps": 2}
            ),
            **common,
        )
        for (prompt, seed), threshold in zip(prompts, THRESHOLDS[method], strict=True)
    ]


def _run(pipe, case: str) -> tuple[np.ndarray, list[dict]]:
    size, method, _ = CASES[case]
    result = pipe.run(_batch(pipe.describe_model(), size, method))
    return pixels(result), [output.step_cache for output in result.outputs]


def _save(out_dir: str, case: str, rank: int, run: tuple[np.ndarray, list[dict]]) -> None:
    np.save(Path(out_dir) / f"{case}-rank{rank}.npy", run[0])
    (Path(out_dir) / f"{case}-rank{rank}.json").write_text(json.dumps(run[1]))


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel
    from diffuserve.parallel.fsdp import shard_denoisers
    from diffuserve.parallel.sequence import enable_sequence_parallel
    from diffuserve.parallel.tensor import enable_tensor_parallel

    path = checkpoints["flux"]
    with process_group(rank, world, init_file), torch.inference_mode():
        pair = dist.new_group([0, 1])
        pipe = load_pipeline(path)
        enable_cfg_parallel(pipe, pair)
        for case in ("cfg-fbcache", "cfg-teacache"):
            _save(out_dir, case, rank, _run(pipe, case))
        pipe.cfg_parallel = None
        for mode, cases in (("ulysses", ("fbcache", "teacache", "odd-fbcache")), ("ring", ("fbcache",))):
            sp = enable_sequence_parallel(
                pipe, ulysses_group=pair if mode == "ulysses" else None, ring_group=pair if mode == "ring" else None
            )
            for case in cases:
                _save(out_dir, f"{mode}-{case}", rank, _run(pipe, f"{mode}-{case}"))
            sp.remove()
        pipe = load_pipeline(path)
        enable_tensor_parallel(pipe, mesh=init_device_mesh("cpu", (2,)))
        _save(out_dir, "tp-fbcache", rank, _run(pipe, "tp-fbcache"))
        pipe = load_pipeline(path)
        shard_denoisers(pipe)
        _save(out_dir, "fsdp-fbcache", rank, _run(pipe, "fsdp-fbcache"))
        enable_cfg_parallel(pipe, pair)
        _save(out_dir, "fsdp-cfg-teacache", rank, _run(pipe, "fsdp-cfg-teacache"))


@pytest.fixture(scope="module")
def flux_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("flux"))


@pytest.fixture(scope="module")
def flux(flux_path: str):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(flux_path)


@pytest.fixture(scope="module")
def ranked(flux_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("step-cache-parallel")
    run_two_ranks(_rank_main, {"flux": flux_path}, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def singles(flux) -> dict[tuple[int, str], tuple[np.ndarray, list[dict]]]:
    """The one-process run of every (size, method) the cases use."""
    import torch

    runs = {}
    with torch.inference_mode():
        for case, (size, method, _) in CASES.items():
            if (size, method) not in runs:
                runs[size, method] = _run(flux, case)
    return runs


def _max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cached_batch_over_two_ranks_equals_one_process(ranked: Path, singles, case: str) -> None:
    size, method, tolerance = CASES[case]
    image, counts = singles[size, method]
    # The batch mixes rows that compute and rows that reuse at the same step: the rows decide differently.
    assert counts[0]["computed_steps"] > counts[1]["computed_steps"] and counts[1]["reused_steps"] > 0, counts
    for rank in (0, 1):
        ranked_image = np.load(ranked / f"{case}-rank{rank}.npy")
        assert json.loads((ranked / f"{case}-rank{rank}.json").read_text()) == counts, (case, rank)
        assert ranked_image.shape == image.shape and _max_diff(ranked_image, image) <= tolerance, (case, rank)


def test_a_cached_batch_under_component_offload_equals_the_resident_run(flux, singles) -> None:
    from diffuserve.config.plan import ResidencyMode
    from tests.integration.family_checks import with_residency

    image, counts = singles[64, "fbcache"]
    modes = dict.fromkeys(flux.components, ResidencyMode.COMPONENT_OFFLOAD)
    (offloaded, offloaded_counts), ledger = with_residency(flux, modes, lambda: _run(flux, "cfg-fbcache"))
    assert {move.component for move in ledger.moves()} == set(flux.components)  # the offload really ran
    assert offloaded_counts == counts and _max_diff(offloaded, image) <= PIXEL_TOL


def test_a_compiled_cached_batch_equals_the_uncompiled_one_and_rows_switching_recompile_nothing(
    flux_path: str, singles
) -> None:
    """torch.compile (`--enable-torch-compile`; the eager backend: dynamo's capture, without minutes of inductor on
    CPU) traces the blocks, not the per-row bookkeeping around them: after the first cached batch (which compiles a
    call narrowed to one row), rows switching between compute and reuse in other patterns recompile nothing."""
    import torch
    from torch._dynamo.utils import counters

    from diffuserve.config.plan import DeploymentPlan
    from diffuserve.models.loader import load_pipeline
    from diffuserve.runtime.compile import apply_compile

    image, counts = singles[64, "fbcache"]
    pipe = load_pipeline(flux_path)
    assert apply_compile(pipe.components, DeploymentPlan(enable_torch_compile=True), backend="eager")
    with torch.inference_mode():
        compiled, compiled_counts = _run(pipe, "cfg-fbcache")
        assert compiled_counts == counts and _max_diff(compiled, image) <= PIXEL_TOL
        counters.clear()
        with torch._dynamo.config.patch(error_on_recompile=True):
            first, second = _batch(pipe.describe_model(), 64, "fbcache")
            batch = [replace(first, step_cache=second.step_cache), replace(second, step_cache=first.step_cache)]
            swapped = [output.step_cache for output in pipe.run(batch).outputs]
    assert swapped != counts, swapped  # the rows' thresholds swapped: other rows reuse, at other steps
    assert not counters["stats"].get("unique_graphs"), dict(counters["stats"])
