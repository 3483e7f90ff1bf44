"""Packed mixed-size calls compose (issue 31 item 4), on the tiny FLUX.1 checkpoint: rows of different sizes in one
denoiser call with batched CFG, per-row LoRA adapters, per-row step caches, component offload and the flex_attention
kernel each equal their requests run alone (<= 1/255); a composition not proven packed (image-conditioned rows) runs
its size groups as separate calls and still equals them. The plain packed check (and the two-pass CFG one) is the
conformance suite's `test_packed_rows_equal_their_singletons`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diffuserve.config.plan import ResidencyMode
from diffuserve.config.step_cache import StepCacheSettings
from diffuserve.pipelines import packing
from diffuserve.sampling import SamplingParams
from diffuserve.step_cache import rows as step_cache_rows
from tests.integration.family_checks import max_pixel_diff, simulate_steps, with_residency

pytestmark = pytest.mark.timeout(300)


def _batch(steps: int = 2, **common: Any) -> list[SamplingParams]:
    return [
        SamplingParams(prompt="a cat", width=64, height=64, seed=1, num_inference_steps=steps, **common),
        SamplingParams(
            prompt="a small green dog with a hat", width=96, height=64, seed=9, num_inference_steps=steps, **common
        ),
        SamplingParams(prompt="a red cube", width=64, height=96, seed=4, num_inference_steps=steps, **common),
    ]


@pytest.fixture(scope="module")
def native(tiny_flux_path: Path, family_pipeline) -> Any:
    return family_pipeline(tiny_flux_path)


def _counted(native: Any, batch: list[SamplingParams]) -> tuple[list[Any], int]:
    calls: list[int] = []
    hook = native.adapter.transformer.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        return [out.images for out in native.run(batch).outputs], len(calls)
    finally:
        hook.remove()


def _assert_singletons(native: Any, batch: list[SamplingParams], got: list[Any]) -> None:
    for params, images in zip(batch, got, strict=True):
        assert [im.size for im in images] == [(params.width, params.height)] * params.n
        assert max_pixel_diff(images, native.run([params]).outputs[0].images) <= 1, (params.width, params.height)


@pytest.fixture
def batched_cfg(native: Any) -> Iterator[None]:
    before = native.batched_cfg
    native.batched_cfg = True
    try:
        yield
    finally:
        native.batched_cfg = before


def test_batched_cfg_doubles_the_packed_call(native: Any, batched_cfg: None) -> None:
    batch = _batch(true_cfg_scale=2.0, negative_prompt="blurry")
    got, calls = _counted(native, batch)
    assert calls == 2  # one doubled call per step
    _assert_singletons(native, batch, got)


def test_component_offload_reproduces_the_resident_packed_run(native: Any) -> None:
    batch = _batch()
    resident = [out.images for out in native.run(batch).outputs]
    offloaded, ledger = with_residency(
        native, {"transformer": ResidencyMode.COMPONENT_OFFLOAD}, lambda: [o.images for o in native.run(batch).outputs]
    )
    assert any(m.component == "transformer" for m in ledger.moves())  # the transformer really moved
    for a, b in zip(resident, offloaded, strict=True):
        assert max_pixel_diff(a, b) == 0


def test_flex_kernel_equals_the_key_mask(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable-length kernel (flex_attention's block mask, CUDA's choice) runs the same logic on CPU."""
    batch = _batch(steps=1)[:2]
    masked = [out.images for out in native.run(batch).outputs]
    monkeypatch.setattr(packing, "packed_kernel", lambda device, split=False: "flex")
    flex = [out.images for out in native.run(batch).outputs]
    for a, b in zip(masked, flex, strict=True):
        assert max_pixel_diff(a, b) <= 1


def test_step_caches_decide_per_packed_row(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """fbcache on packed rows: one call per step, and each row measures its first-block change over its real
    tokens only (the padding left out), so it takes the same decisions, with the same measures, as its request run
    alone. The thresholds differ by request, so rows reuse while others compute in the same call (the narrowing
    cuts the per-row RoPE tables and the key mask to the computing rows)."""
    measured: list[list[float | None]] = []  # per fbcache decision: each row's measure (None: it had none)
    changes = step_cache_rows.changes

    def recorded(call: Any, now: torch.Tensor) -> list[float | None]:
        measured.append(changes(call, now))
        return measured[-1]

    monkeypatch.setattr(step_cache_rows, "changes", recorded)
    batch = [
        dataclasses.replace(p, step_cache=StepCacheSettings(method="fbcache", warmup_steps=1, threshold=threshold))
        for p, threshold in zip(_batch(steps=5), (0.05, 0.2, 0.5), strict=True)
    ]
    batch[1] = dataclasses.replace(batch[1], n=2)
    calls: list[int] = []
    hook = native.adapter.transformer.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        packed = native.run(batch).outputs
    finally:
        hook.remove()
    assert len(calls) == 5  # one packed call per step
    per_row = list(measured)  # the packed call's rows are in the batch's order (its sizes are grouped already)
    first = 0
    for params, out in zip(batch, packed, strict=True):
        measured.clear()
        alone = native.run([params]).outputs[0]
        assert out.step_cache == alone.step_cache, (params.width, params.height)
        assert _measures(per_row, first, params.n) == pytest.approx(_measures(measured, 0, params.n), rel=1e-4)
        assert max_pixel_diff(out.images, alone.images) <= 1, (params.width, params.height)
        first += params.n
    reused = [out.step_cache["reused_steps"] for out in packed]
    assert reused[0] == 0 and reused[2] > 0, f"no call mixed computing and reusing rows: {reused}"


def test_step_caches_in_a_continuous_packed_group(native: Any) -> None:
    """The continuous loop's packed calls carry the rows' step caches: a 64x64 request starts alone, a wider one
    joins at its second step, so the first one's Taylor factors span calls of different padded lengths (kept at
    its real tokens, else the expansion restarts and its forecast last step moves its pixels); rows forecast
    beside rows that compute; each equals its request alone."""
    a, b = (
        dataclasses.replace(
            p,
            step_cache=StepCacheSettings(
                method="taylorseer", warmup_steps=1, refresh_interval=k, compute_last_step=False, max_cached_steps=5
            ),
        )
        for p, k in zip(_batch(steps=5)[:2], (3, 2), strict=False)
    )
    whole: dict[int, Any] = {}
    got = simulate_steps(native, {0: [a], 1: [b]}, whole)
    for i, params in enumerate([a, b]):
        alone = native.run([params]).outputs[0]
        assert whole[i].step_cache == alone.step_cache
        assert max_pixel_diff(got[i], alone.images) <= 1, (params.width, params.height)
    assert whole[0].step_cache["reused_steps"] > 0


def _measures(steps: list[list[float | None]], first: int, n: int) -> list[float]:
    """Rows first..first+n's measures, decision after decision (-1: the row had none, warm-up or decided)."""
    return [-1.0 if m is None else m for step in steps for m in step[first : first + n]]


def test_a_composition_not_packed_runs_its_size_groups_as_separate_calls(native: Any) -> None:
    """What `packing_problem` names (here image-conditioned rows) runs one call per size group per step, and each
    request still equals its run alone."""
    import io

    from PIL import Image

    source = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 90)).save(source, format="PNG")
    batch = [dataclasses.replace(p, image_inputs=(source.getvalue(),), strength=0.7) for p in _batch(steps=2)[:2]]
    assert native.packing_problem(batch[0], batch) is not None
    got, calls = _counted(native, batch)
    assert calls == 2 * 2  # two size groups, each its own call per step
    _assert_singletons(native, batch, got)


def test_the_cost_gate_splits_a_batch_into_runs_of_neighbouring_sizes(native: Any) -> None:
    """`packing_call_tokens` (pipelines/pack_plan.py) at 10 tokens per call: 128x128 (64 tokens) splits from the
    three small sizes (16, 24, 24 tokens), which still share one packed call: two calls per step, every request
    equal to its run alone and answered in the batch's order."""
    batch = [SamplingParams(prompt="a big cat", width=128, height=128, seed=3, num_inference_steps=2), *_batch(2)]
    before = native.adapter.packing_call_tokens
    native.adapter.packing_call_tokens = 10.0
    try:
        got, calls = _counted(native, batch)
    finally:
        native.adapter.packing_call_tokens = before
    assert calls == 2 * 2  # [16 24 24 packed] + [64], each one call per step
    _assert_singletons(native, batch, got)


def test_per_row_lora_in_a_packed_call(tiny_flux_path: Path, tmp_path: Path) -> None:
    from diffuserve.lora.slots import install_lora
    from diffuserve.lora.tiny import write_random_lora
    from diffuserve.models.loader import load_pipeline

    native = load_pipeline(tiny_flux_path)
    style = write_random_lora(tiny_flux_path, tmp_path / "style", rank=4, seed=1)
    install_lora(
        native, native.family, {"style": str(style)}, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32
    )
    batch = _batch()
    batch = [
        dataclasses.replace(batch[0], lora=(("style", 1.5),)),
        batch[1],
        dataclasses.replace(batch[2], lora=(("style", -1.0),)),
    ]
    got, calls = _counted(native, batch)
    assert calls == 2
    _assert_singletons(native, batch, got)
    plain = native.run([dataclasses.replace(batch[0], lora=())]).outputs[0].images
    assert max_pixel_diff(got[0], plain) > 3, "the adapter changed nothing: the test would not see a broken path"


def test_compiled_packed_calls_do_not_recompile_per_mix(tiny_flux_path: Path) -> None:
    """`--enable-torch-compile` compiles the repeated blocks with dynamic shapes, so the packed sequence length is
    symbolic: after the first mix of two rows, mixes of other packed lengths run the same graphs (dynamo counters),
    and a compiled packed call equals the eager one. (No length buckets are needed: see docs/batching.md.)"""
    from torch._dynamo.utils import counters

    from diffuserve.config.plan import DeploymentPlan
    from diffuserve.models.loader import load_pipeline
    from diffuserve.runtime.compile import apply_compile

    native = load_pipeline(tiny_flux_path)

    def mix(*sizes: tuple[int, int]) -> list[SamplingParams]:
        return [
            SamplingParams(prompt="a cat", width=w, height=h, num_inference_steps=1, seed=i)
            for i, (w, h) in enumerate(sizes)
        ]

    eager = [out.images for out in native.run(mix((32, 32), (48, 32))).outputs]
    assert apply_compile(native.components, DeploymentPlan(enable_torch_compile=True), backend="eager")
    compiled = [out.images for out in native.run(mix((32, 32), (48, 32))).outputs]
    for a, b in zip(eager, compiled, strict=True):
        assert max_pixel_diff(a, b) <= 1
    native.run(mix((32, 32), (64, 32)))  # the second length: dynamo marks the sequence dim dynamic here
    graphs = counters["stats"]["unique_graphs"]
    native.run(mix((48, 48), (32, 32)))
    assert counters["stats"]["unique_graphs"] == graphs, "a packed mix of another length recompiled"


def test_a_continuous_group_of_several_sizes_steps_packed(native: Any) -> None:
    """Requests of other sizes (and step counts) join a running step group: one packed call per step, each request
    equal to its run alone; requests of two sizes finishing together decode per size."""
    from tests.integration.family_checks import simulate_steps

    first, second, third = _batch(steps=3)
    third = dataclasses.replace(third, num_inference_steps=2)  # joins at step 1 and finishes with the first
    calls: list[int] = []
    hook = native.adapter.transformer.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        stepped = simulate_steps(native, {0: [first], 1: [second, third]})
    finally:
        hook.remove()
    assert len(calls) == 4  # ticks 0..3: one call each, whatever the sizes in the group
    for index, params in enumerate((first, second, third)):
        assert max_pixel_diff(stepped[index], native.run([params]).outputs[0].images) <= 1, index


def test_previews_of_a_packed_batch_come_in_request_order(native: Any) -> None:
    batch = _batch(steps=1)  # 64x64, 96x64, 64x96: the packed call orders them by size
    batch = [batch[1], batch[0], dataclasses.replace(batch[2], width=96, height=64)]  # sizes A, B, A
    seen: list[list[list[Any]]] = []
    native.run(batch, on_preview=lambda step, steps, make: seen.append(make()))
    assert [[im.size for im in request] for request in seen[-1]] == [[(p.width, p.height)] for p in batch]
