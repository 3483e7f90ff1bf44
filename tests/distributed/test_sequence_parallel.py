"""Sequence parallel (Ulysses, Ring, Ulysses x Ring, and CFG parallel x Ulysses) over real gloo ranks equals the
single-process run: the final float32 latents within 1e-5 and the pixels within 1/255, on every rank.

Every run is the merged two-request batch of `ranks.requests` (CFG, n=2, prompts of different token lengths, so
Qwen-Image's text mask pads), plus a FLUX request whose 9 image tokens do not divide the degree (padding), plus a
FLUX.1 and a Qwen-Image batch of three sizes (and text lengths) run as ONE packed call per step and branch
(`pipelines/packing.py`; checked by counting those calls): the padded sequence (9 tokens, padded to 10) is split
like any other, so a rank's share holds rows' padding, and one ring block holds none of the smallest row's tokens.
Some runs are under component or layer-wise offload of every component. One launch of 4 ranks runs every case.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diffuserve.errors import ConfigError
from tests.distributed.ranks import pixels, process_group, requests, run_ranks

LATENT_TOLERANCE = 1e-5
"""Max abs difference of the final fp32 latents (the reduction order of attention changes)."""
PIXEL_TOLERANCE = 1
"""Max difference of the decoded 8-bit pixels."""

# (name, build, ulysses, ring, residency of every component)
TWO_RANKS = (
    ("flux-u2", "flux", 2, 1, None),
    ("flux-r2", "flux", 1, 2, "layerwise-offload"),
    ("flux-odd-u2", "flux-odd", 2, 1, None),
    ("flux-odd-r2", "flux-odd", 1, 2, None),
    ("qwen-image-u2", "qwen-image", 2, 1, "component-offload"),
    ("qwen-image-r2", "qwen-image", 1, 2, None),
    ("wan-u2", "wan", 2, 1, None),
    ("wan-r2", "wan", 1, 2, "component-offload"),
    ("wan2.2-ti2v-u2", "wan2.2-ti2v", 2, 1, None),  # per-token timesteps: split with the tokens
    ("flux-packed-r2", "flux-packed", 1, 2, None),
    ("qwen-image-packed-u2", "qwen-image-packed", 2, 1, None),  # per-row text lengths too
)
# (name, build, mesh dims): 4 ranks
FOUR_RANKS = (
    ("qwen-image-cfg2-u2", "qwen-image", ("cfg", "ulysses")),
    ("flux-packed-cfg2-u2", "flux-packed", ("cfg", "ulysses")),  # each CFG rank's packed call split in two
    ("flux-odd-r2-u2", "flux-odd", ("ring", "ulysses")),
    ("wan-r2-u2", "wan", ("ring", "ulysses")),
)
PACKED = (("a red fox", 1, 48, 48, 2), ("a long sandy beach", 5, 32, 32, 1), ("a tower", 7, 32, 48, 1))
"""The `flux-packed` batch: (prompt, seed, width, height, n)."""


def _batch(pipe, build: str):
    if build.endswith("-packed"):  # 48x48 (9 tokens), 32x32 (4) and 32x48 (6): one packed call, true CFG
        from diffuserve.sampling import build_sampling_params

        common = {"num_inference_steps": 2, "true_cfg_scale": 4.0, "negative_prompt": "dark"}
        return [
            build_sampling_params(pipe.describe_model(), prompt=prompt, seed=seed, width=w, height=h, n=n, **common)
            for prompt, seed, w, h, n in PACKED
        ]
    if build == "flux-odd":  # 48x48: 3x3 = 9 image tokens, padded to a multiple of the degree
        from diffuserve.sampling import build_sampling_params

        return [
            build_sampling_params(
                pipe.describe_model(), prompt="a small odd square", seed=3, width=48, height=48, num_inference_steps=2
            )
        ]
    return requests(pipe.describe_model(), "wan" if build.startswith("wan") else build)


def _run(pipe, build: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(final latents, pixels, packed denoiser calls) of the build's batch (a packed batch decodes per size: its
    latents flattened and concatenated)."""
    captured, packed = [], []
    decode, predict_packed = pipe.decode, getattr(pipe.adapter, "predict_packed", None)

    def capture(latents, state):
        captured.append(latents.float().cpu().numpy().copy())
        return decode(latents, state)

    def count(*args):
        packed.append(1)
        return predict_packed(*args)

    pipe.decode = capture
    if predict_packed is not None:
        pipe.adapter.predict_packed = count
    try:
        result = pipe.run(_batch(pipe, build))
    finally:
        del pipe.decode
        if predict_packed is not None:
            del pipe.adapter.predict_packed
    latents = captured[0] if len(captured) == 1 else np.concatenate([c.ravel() for c in captured])
    return latents, pixels(result), len(packed)


def _under(pipe, residency: str | None, run):
    """`run()` with every component under `residency` (layer-wise where a component has layers, else component
    offload), installed before `run` attaches sequence parallel (as serving loads, then parallelises)."""
    if residency is None:
        return run()
    from diffuserve.config.plan import ResidencyMode
    from tests.integration.family_checks import layered_components, with_residency

    mode = ResidencyMode(residency)
    layered = set(layered_components(pipe))
    modes = {
        name: (
            mode if mode is not ResidencyMode.LAYERWISE_OFFLOAD or name in layered else ResidencyMode.COMPONENT_OFFLOAD
        )
        for name in pipe.components
    }
    result, ledger = with_residency(pipe, modes, run)
    assert {m.component for m in ledger.moves()} == set(pipe.components)  # the offload really ran
    return result


def _checkpoint(checkpoints: dict[str, str], build: str) -> str:
    return checkpoints["flux" if build.startswith("flux") else build.removesuffix("-packed")]


def _save(out_dir: str, name: str, rank: int, result: tuple[np.ndarray, np.ndarray, int], sp) -> None:
    np.save(Path(out_dir) / f"{name}-rank{rank}-latents.npy", result[0])
    np.save(Path(out_dir) / f"{name}-rank{rank}-pixels.npy", result[1])
    np.save(Path(out_dir) / f"{name}-rank{rank}-calls.npy", np.array([sp.calls, sp.attention_calls, result[2]]))


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    """One launch of 4 ranks for every case: the 2-rank cases on the pairs (0, 1) and (2, 3), half each, at once;
    then the 4-rank cases."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import CfgParallel
    from diffuserve.parallel.sequence import enable_sequence_parallel

    with process_group(rank, world, init_file):
        pipes: dict[str, object] = {}

        def pipeline(build: str):
            path = _checkpoint(checkpoints, build)
            if path not in pipes:
                pipes[path] = load_pipeline(path)
            return pipes[path]

        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        pair = pairs[rank // 2]
        for name, build, ulysses, ring, residency in TWO_RANKS[rank // 2 :: 2]:
            pipe = pipeline(build)

            def split_run(pipe=pipe, build=build, ulysses=ulysses, ring=ring):
                sp = enable_sequence_parallel(
                    pipe, ulysses_group=pair if ulysses > 1 else None, ring_group=pair if ring > 1 else None
                )
                try:
                    return _run(pipe, build), sp
                finally:
                    sp.remove()

            result, sp = _under(pipe, residency, split_run)
            _save(out_dir, name, dist.get_rank(pair), result, sp)
        for name, build, dims in FOUR_RANKS:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
            pipe = pipeline(build)
            if dims[0] == "cfg":
                pipe.cfg_parallel = CfgParallel(mesh["cfg"].get_group())
                sp = enable_sequence_parallel(pipe, ulysses_group=mesh["ulysses"].get_group())
            else:
                sp = enable_sequence_parallel(
                    pipe, ulysses_group=mesh["ulysses"].get_group(), ring_group=mesh["ring"].get_group()
                )
            _save(out_dir, name, rank, _run(pipe, build), sp)
            sp.remove()
            pipe.cfg_parallel = None


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {build: str(tiny_checkpoint(build)) for build in ("flux", "qwen-image", "wan", "wan2.2-ti2v")}


@pytest.fixture(scope="module")
def singles(checkpoints):
    from diffuserve.models.loader import load_pipeline

    out = {}
    for build in ("flux", "flux-odd", "flux-packed", "qwen-image", "qwen-image-packed", "wan", "wan2.2-ti2v"):
        out[build] = _run(load_pipeline(_checkpoint(checkpoints, build)), build)
    return out


@pytest.fixture(scope="module")
def ranked(checkpoints, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sequence-parallel")
    run_ranks(_rank_main, checkpoints, out_dir, world=4)
    return out_dir


def _assert_matches(out_dir: Path, name: str, world: int, single: tuple[np.ndarray, np.ndarray, int]) -> None:
    latents, image, packed = single
    for rank in range(world):
        calls, attention_calls, ranked_packed = np.load(out_dir / f"{name}-rank{rank}-calls.npy")
        assert calls > 0 and attention_calls >= calls, (name, rank)  # the split really ran, in every block
        assert (ranked_packed > 0) == (packed > 0), (name, rank, packed, ranked_packed)  # packed where one process is
        ranked_latents = np.load(out_dir / f"{name}-rank{rank}-latents.npy")
        ranked_pixels = np.load(out_dir / f"{name}-rank{rank}-pixels.npy")
        assert ranked_latents.shape == latents.shape and ranked_pixels.shape == image.shape, (name, rank)
        diff = float(np.abs(ranked_latents - latents).max())
        assert diff <= LATENT_TOLERANCE, (name, rank, diff)
        assert int(np.abs(ranked_pixels.astype(int) - image.astype(int)).max()) <= PIXEL_TOLERANCE, (name, rank)
    # Every rank returns the same bytes (the gathered output), so the recipe after each call agrees everywhere.
    first = np.load(out_dir / f"{name}-rank0-latents.npy")
    for rank in range(1, world):
        assert (np.load(out_dir / f"{name}-rank{rank}-latents.npy") == first).all(), (name, rank)


@pytest.mark.parametrize("case", TWO_RANKS, ids=[c[0] for c in TWO_RANKS])
def test_two_ranks_equal_the_single_process_run(ranked, singles, case):
    name, build = case[0], case[1]
    _assert_matches(ranked, name, 2, singles[build])


@pytest.mark.parametrize("case", FOUR_RANKS, ids=[c[0] for c in FOUR_RANKS])
def test_four_ranks_equal_the_single_process_run(ranked, singles, case):
    name, build = case[0], case[1]
    _assert_matches(ranked, name, 4, singles[build])


def test_what_cannot_run_is_refused(tiny_checkpoint):
    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.sequence import check_sequence_parallel

    flux = load_pipeline(tiny_checkpoint("flux"))  # 2 attention heads
    with pytest.raises(ConfigError) as err:
        check_sequence_parallel(flux, ulysses_degree=4, ring_degree=1)
    assert (
        err.value.param == "ulysses_degree" and "[1, 2]" in err.value.message and "--ring-degree" in err.value.message
    )
    check_sequence_parallel(flux, ulysses_degree=2, ring_degree=3)  # Ring takes any degree
    sd3 = load_pipeline(tiny_checkpoint("sd3"))  # a native family without a sequence split
    with pytest.raises(ConfigError) as err:
        check_sequence_parallel(sd3, ulysses_degree=1, ring_degree=2)
    assert err.value.param == "ring_degree" and "no sequence split" in err.value.message
    backend = load_pipeline(tiny_checkpoint("flux"), backend="diffusers")
    with pytest.raises(ConfigError) as err:
        check_sequence_parallel(backend, ulysses_degree=2, ring_degree=1)
    assert err.value.param == "ulysses_degree" and "--backend native" in err.value.message


def test_blockwise_attention_merges_to_the_whole():
    """Ring's arithmetic in one process: the CPU kernel and the float32 formula (the path of other devices) agree,
    and partial attentions over disjoint key blocks (one masked, one with no key for a row) merge to attention over
    all keys."""
    import torch

    from diffuserve.parallel.attention import block_attention, math_attention, merge_partial

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    k2, v2 = (torch.randn(2, 3, 4, 8, generator=gen) for _ in range(2))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    bias = torch.zeros(2, 5).masked_fill(~mask, float("-inf"))[:, None, None]
    kernel, kernel_lse = block_attention(q, k, v, mask, None)
    formula, formula_lse = math_attention(q, k, v, bias, None)
    assert torch.allclose(kernel, formula, atol=1e-6) and torch.allclose(kernel_lse, formula_lse, atol=1e-6)
    out, lse = merge_partial(*merge_partial(None, None, kernel, kernel_lse), *block_attention(q, k2, v2, None, None))
    # A third block holding none of row 1's keys (a packed row's padding on a ring block) adds nothing to row 1.
    k3, v3 = (torch.randn(2, 3, 2, 8, generator=gen) for _ in range(2))
    empty = torch.tensor([[True, True], [False, False]])
    out, lse = merge_partial(out, lse, *block_attention(q, k3, v3, empty, None))
    whole = torch.nn.functional.scaled_dot_product_attention(
        q,
        torch.cat([k, k2, k3], 2),
        torch.cat([v, v2, v3], 2),
        attn_mask=torch.cat([mask, torch.ones(2, 4, dtype=torch.bool), empty], 1)[:, None, None],
    )
    assert (out - whole).abs().max() < 1e-6
