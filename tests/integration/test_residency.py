"""Residency runtime on CPU with tiny real model classes (FLUX transformer, CLIP, T5, VAE).

On CPU the host is also the device, so "device bytes" are the bytes attached to the modules; the
ledger is how these tests see which components/layers hold weights and how many bytes each
request moves. Outputs are compared with the plain (resident) run; the runtime only re-attaches
the very same tensors on CPU, so the tolerance is 1e-6 and the observed difference is 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from diffusers.hooks import HookRegistry

from diffuserve.config.plan import ComponentPlan, DeploymentPlan, Lifetime, ResidencyMode
from diffuserve.errors import ConfigError
from diffuserve.runtime.layerwise import LAYER_HOOK, START_HOOK, default_layer_specs
from diffuserve.runtime.ledger import TransferLedger
from diffuserve.runtime.residency import (
    GUARD_HOOK,
    ComponentResidencyManager,
    OffloadedWeightsError,
    build_residency,
)

pytestmark = pytest.mark.timeout(120)

TOL = 1e-6
GROUPS = {"transformer": "dit", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder", "vae": "vae"}


def tensor_bytes(module: torch.nn.Module) -> int:
    """Unique parameter + buffer bytes (tied weights once): the reference for bytes moved."""
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


@dataclass
class Case:
    module: torch.nn.Module
    run: Callable[[], torch.Tensor]
    reference: torch.Tensor
    forwards_per_use: int
    """How many times a use runs the module (the DiT runs once per step)."""
    layers_run: list[str]
    """Declared layers one forward executes, in order (a VAE decode skips the encoder)."""
    layer_bytes: dict[str, int]
    total: int

    @property
    def rest(self) -> int:
        return self.total - sum(self.layer_bytes.values())


def _layers(module: torch.nn.Module, specs: list[str]) -> dict[str, torch.nn.Module]:
    return {f"{s}.{i}": m for s in specs for i, m in enumerate(module.get_submodule(s))}


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    dit = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    ).eval()
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=37,
            projection_dim=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    ).eval()
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=99,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
        )
    ).eval()
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
    ).eval()
    g = torch.Generator().manual_seed(1)
    dit_in = dict(
        hidden_states=torch.randn(1, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )
    ids = torch.randint(0, 99, (2, 7), generator=g)
    z = torch.randn(1, 4, 8, 8, generator=g)
    runs: dict[str, tuple[torch.nn.Module, Callable[[], torch.Tensor], int, list[str]]] = {
        "transformer": (dit, lambda: dit(**dit_in)[0], 2, ["transformer_blocks", "single_transformer_blocks"]),
        "text_encoder": (clip, lambda: clip(ids).pooler_output, 1, default_layer_specs("text_encoder", clip)),
        "text_encoder_2": (t5, lambda: t5(ids).last_hidden_state, 1, ["encoder.block"]),
        "vae": (vae, lambda: vae.decode(z).sample, 1, ["decoder.up_blocks"]),
    }
    out: dict[str, Case] = {}
    with torch.no_grad():
        for name, (module, run, forwards, specs_run) in runs.items():
            all_layers = _layers(module, default_layer_specs(name, module) or [])
            out[name] = Case(
                module=module,
                run=run,
                reference=run().clone(),
                forwards_per_use=forwards,
                layers_run=list(_layers(module, specs_run)),
                layer_bytes={n: tensor_bytes(m) for n, m in all_layers.items()},
                total=tensor_bytes(module),
            )
    return out


@contextlib.contextmanager
def managed(
    cases: dict[str, Case], plans: dict[str, ComponentPlan], budget: int | None = None
) -> Iterator[tuple[ComponentResidencyManager, TransferLedger]]:
    ledger = TransferLedger()
    manager = ComponentResidencyManager(
        {n: cases[n].module for n in plans},
        plans,
        device=torch.device("cpu"),
        ledger=ledger,
        device_budget_bytes=budget,
    )
    manager.setup()
    try:
        yield manager, ledger
    finally:
        manager.close()


def plan(name: str, mode: ResidencyMode, **kw) -> ComponentPlan:
    return ComponentPlan(name=name, group=GROUPS[name], mode=mode, **kw)


def run_use(manager: ComponentResidencyManager, case: Case, name: str) -> torch.Tensor:
    with torch.inference_mode(), manager.use(name):
        outs = [case.run() for _ in range(case.forwards_per_use)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    return outs[0]


# 1. Every mode on every component: equal outputs, where the weights are, bytes per request ----------


@pytest.mark.parametrize("mode", list(ResidencyMode), ids=lambda m: m.value)
@pytest.mark.parametrize("name", list(GROUPS))
def test_mode_matches_resident_and_moves_the_minimum(cases: dict[str, Case], name: str, mode: ResidencyMode) -> None:
    case = cases[name]
    with managed(cases, {name: plan(name, mode)}) as (manager, ledger):
        offloaded = mode is not ResidencyMode.RESIDENT
        # Between requests only resident weights are attached.
        assert ledger.device_bytes(name) == (0 if offloaded else case.total)
        ledger.begin_window()
        with torch.inference_mode(), manager.use(name):
            inside = ledger.on_device().get(name, set())
            outs = [case.run() for _ in range(case.forwards_per_use)]
        summary = ledger.window_summary()
        assert ledger.device_bytes(name) == (0 if offloaded else case.total)

    for out in outs:
        assert (out - case.reference).abs().max().item() <= TOL
    moved = summary.bytes_moved.get(name, {})
    streamed = case.forwards_per_use * sum(case.layer_bytes[n] for n in case.layers_run)
    expected = {
        ResidencyMode.RESIDENT: ({}, {None}),
        ResidencyMode.COMPONENT_OFFLOAD: ({"h2d": case.total, "d2h": case.total}, {None}),
        ResidencyMode.SNAPSHOT_OFFLOAD: ({"h2d": case.total, "free": case.total}, {None}),
        # Non-layer weights once per use, each layer the forward runs once per forward; nothing
        # else (the VAE encoder's blocks are never prefetched during a decode).
        ResidencyMode.LAYERWISE_OFFLOAD: ({"h2d": case.rest + streamed, "free": case.rest + streamed}, {None}),
    }[mode]
    assert moved == expected[0]
    # On entering `use` (before any forward), only the whole unit / the non-layer rest is attached.
    assert inside == expected[1]
    if mode is ResidencyMode.LAYERWISE_OFFLOAD:
        h2d_layers = [m.layer for m in summary.moves if m.direction == "h2d" and m.layer]
        assert h2d_layers == case.layers_run * case.forwards_per_use


@pytest.mark.parametrize("mode", [m for m in ResidencyMode if m is not ResidencyMode.RESIDENT], ids=lambda m: m.value)
@pytest.mark.parametrize("name", list(GROUPS))
def test_forward_without_onload_fails(cases: dict[str, Case], name: str, mode: ResidencyMode) -> None:
    case = cases[name]
    with managed(cases, {name: plan(name, mode)}):
        with torch.no_grad(), pytest.raises(OffloadedWeightsError, match=f"use\\('{name}'\\)"):
            case.run()
        # The guard only improves the message: with every hook removed the weights are still not
        # reachable, because they are genuinely detached from the module.
        for sub in case.module.modules():
            if hasattr(sub, "_diffusers_hook"):
                for hook in (GUARD_HOOK, LAYER_HOOK, START_HOOK):
                    sub._diffusers_hook.remove_hook(hook, recurse=False)
        assert all(p.numel() == 0 for p in case.module.parameters())
        # (Which error depends on the model: a shape check or a kernel's size mismatch.)
        with torch.no_grad(), pytest.raises((RuntimeError, ValueError, IndexError)) as info:
            case.run()
        assert not isinstance(info.value, OffloadedWeightsError)
    # close() gives the weights back: the plain module runs again and matches.
    with torch.no_grad():
        assert (case.run() - case.reference).abs().max().item() <= TOL


# 2. Layer-wise streaming: the prefetch window, resident sets and their lifetimes ----------------


def _watch_layers(case: Case, ledger: TransferLedger, name: str) -> tuple[list, list, list]:
    """Note which layers hold device weights while each layer computes (inside its attention) and
    right after it returns."""
    during: list[tuple[str, set]] = []
    after: list[tuple[str, set]] = []
    handles = []
    for lname, layer in _layers(case.module, ["transformer_blocks", "single_transformer_blocks"]).items():

        def note(_mod, _args, lname=lname):
            during.append((lname, set(ledger.on_device().get(name, set()))))

        def note_after(_mod, _args, _out, lname=lname):
            after.append((lname, set(ledger.on_device().get(name, set()))))

        handles.append(layer.attn.register_forward_pre_hook(note))
        handles.append(layer.register_forward_hook(note_after))
    return during, after, handles


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_window(cases: dict[str, Case], prefetch: int) -> None:
    name, case = "transformer", cases["transformer"]
    order = case.layers_run  # 5 layers: 2 double-stream then 3 single-stream blocks
    resident = order[:1]
    streamed = order[1:]
    depth = max(1, prefetch)
    p = plan(name, ResidencyMode.LAYERWISE_OFFLOAD, prefetch_size=prefetch, resident_layers=1)
    with managed(cases, {name: p}) as (manager, ledger):
        seen, after, handles = _watch_layers(case, ledger, name)
        try:
            ledger.begin_window()
            out = run_use(manager, case, name)
            summary = ledger.window_summary()
        finally:
            for h in handles:
                h.remove()
    assert (out - case.reference).abs().max().item() <= TOL
    # While layer i runs: the rest, the resident set, layer i and exactly the next `depth` streamed
    # layers (the double->single boundary is crossed: the lists are siblings).
    assert [lname for lname, _ in seen] == order * case.forwards_per_use
    for lname, attached in seen:
        i = streamed.index(lname) if lname in streamed else -1
        window = set(streamed[i + 1 : i + 1 + depth]) | ({lname} if i >= 0 else set())
        assert attached == {None, *resident, *window}, lname
    # A streamed layer is dropped right after it runs.
    for lname, attached in after:
        assert (lname in attached) == (lname in resident), lname
    # The same invariant from the ledger's full timeline: never more than depth+1 streamed layers.
    on: set[str] = set()
    peak_streamed = 0
    for m in summary.moves:
        if m.layer in streamed:
            (on.add if m.direction == "h2d" else on.discard)(m.layer)
            peak_streamed = max(peak_streamed, len(on))
    assert peak_streamed == min(depth + 1, len(streamed))
    # Each streamed layer once per forward, the forward-lifetime resident layer once per use.
    h2d = [m.layer for m in summary.moves if m.direction == "h2d"]
    assert all(h2d.count(n) == case.forwards_per_use for n in streamed)
    assert h2d.count(resident[0]) == 1
    largest = sorted((case.layer_bytes[n] for n in streamed), reverse=True)
    weights_peak = case.rest + case.layer_bytes[resident[0]] + sum(largest[: depth + 1])
    assert summary.peak_device_bytes <= weights_peak


def test_permanent_resident_set_moves_nothing_per_request(cases: dict[str, Case]) -> None:
    name, case = "transformer", cases["transformer"]
    order = case.layers_run
    p = plan(name, ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=2, lifetime=Lifetime.PERMANENT)
    with managed(cases, {name: p}) as (manager, ledger):
        # Placed at load, and still there between requests.
        assert ledger.on_device()[name] == set(order[:2])
        setup_bytes = ledger.device_bytes(name)
        assert setup_bytes == sum(case.layer_bytes[n] for n in order[:2])
        for _ in range(2):  # two requests
            ledger.begin_window()
            out = run_use(manager, case, name)
            summary = ledger.window_summary()
            assert (out - case.reference).abs().max().item() <= TOL
            assert not [m for m in summary.moves if m.layer in order[:2]]
            streamed = case.forwards_per_use * sum(case.layer_bytes[n] for n in order[2:])
            assert summary.bytes_moved[name] == {"h2d": case.rest + streamed, "free": case.rest + streamed}
            assert ledger.on_device()[name] == set(order[:2])


def test_all_layers_permanent_moves_only_the_rest(cases: dict[str, Case]) -> None:
    name, case = "transformer", cases["transformer"]
    p = plan(name, ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=5, lifetime=Lifetime.PERMANENT)
    with managed(cases, {name: p}) as (manager, ledger):
        ledger.begin_window()
        out = run_use(manager, case, name)
        assert ledger.window_summary().bytes_moved[name] == {"h2d": case.rest, "free": case.rest}
    assert (out - case.reference).abs().max().item() <= TOL


def test_forward_lifetime_places_resident_set_per_use(cases: dict[str, Case]) -> None:
    name, case = "transformer", cases["transformer"]
    order = case.layers_run
    p = plan(name, ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=2, lifetime=Lifetime.FORWARD)
    with managed(cases, {name: p}) as (manager, ledger):
        assert ledger.device_bytes(name) == 0
        ledger.begin_window()
        with torch.inference_mode(), manager.use(name):
            assert ledger.on_device()[name] == {None, *order[:2]}
            for _ in range(case.forwards_per_use):
                case.run()
        assert ledger.device_bytes(name) == 0
        h2d = [m.layer for m in ledger.window_summary().moves if m.direction == "h2d"]
    assert h2d.count(order[0]) == h2d.count(order[1]) == 1


def test_nested_use_loads_once(cases: dict[str, Case]) -> None:
    name, case = "vae", cases["vae"]
    with managed(cases, {name: plan(name, ResidencyMode.COMPONENT_OFFLOAD)}) as (manager, ledger):
        ledger.begin_window()
        with torch.no_grad(), manager.use(name):
            with manager.use(name):
                case.run()
            assert ledger.device_bytes(name) == case.total  # the inner exit did not offload
            case.run()
        assert ledger.window_summary().bytes_moved[name] == {"h2d": case.total, "d2h": case.total}


def test_close_removes_every_hook(cases: dict[str, Case]) -> None:
    name, case = "transformer", cases["transformer"]
    with managed(cases, {name: plan(name, ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=1)}):
        assert HookRegistry.check_if_exists_or_initialize(case.module).get_hook(GUARD_HOOK) is not None
    for sub in case.module.modules():
        if hasattr(sub, "_diffusers_hook"):
            assert not sub._diffusers_hook.hooks


def test_ledger_feeds_prometheus_metrics(cases: dict[str, Case]) -> None:
    from diffuserve.engine.metrics import EngineMetrics

    metrics = EngineMetrics()
    name, case = "text_encoder_2", cases["text_encoder_2"]
    with managed(cases, {name: plan(name, ResidencyMode.COMPONENT_OFFLOAD)}) as (manager, ledger):
        ledger.forward_to(metrics)
        run_use(manager, case, name)
    text = metrics.render()[0].decode()

    def sample(metric: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{metric}{{{want}}} not in /metrics")

    assert sample("diffuserve_transfer_bytes_total", component=name, direction="h2d") == case.total
    assert sample("diffuserve_transfer_bytes_total", component=name, direction="d2h") == case.total
    assert sample("diffuserve_device_bytes", component=name) == 0
    assert sample("diffuserve_device_peak_bytes", component=name) == case.total


# 3. Start-up checks -----------------------------------------------------------------------------


def test_permanent_sets_that_do_not_fit_fail_naming_the_flag(cases: dict[str, Case]) -> None:
    dit, te = cases["transformer"], cases["text_encoder_2"]
    dit_layers = sum(dit.layer_bytes.values())
    te_layers = sum(te.layer_bytes.values())
    plans = {
        "transformer": plan(
            "transformer", ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=5, lifetime=Lifetime.PERMANENT
        ),
        "text_encoder_2": plan(
            "text_encoder_2", ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=2, lifetime=Lifetime.PERMANENT
        ),
    }
    # Together the two permanent sets are one byte over the budget; each alone would fit.
    budget = dit_layers + te_layers - 1
    with pytest.raises(ConfigError) as info:
        with managed(cases, plans, budget=budget):
            pass
    msg = info.value.message
    assert info.value.param == "dit_layerwise_residency_lifetime"  # the field, as config errors do
    assert "--dit-layerwise-residency-lifetime" in msg and "--layerwise-residency-lifetime" in msg
    # Nothing was placed or detached: the modules still run as loaded.
    with torch.no_grad():
        assert (dit.run() - dit.reference).abs().max().item() <= TOL
    # The same sets with lifetime `forward` only need the largest one at a time.
    for p in plans.values():
        p.lifetime = Lifetime.FORWARD
    fwd_budget = max(dit.total, te.total)
    with managed(cases, plans, budget=fwd_budget) as (manager, _):
        assert manager.permanent_bytes() == 0


def test_resident_component_that_does_not_fit_names_component_residency(cases: dict[str, Case]) -> None:
    plans = {"vae": plan("vae", ResidencyMode.RESIDENT)}
    with pytest.raises(ConfigError, match="--component-residency") as info:
        with managed(cases, plans, budget=cases["vae"].total - 1):
            pass
    assert info.value.param == "component_residency"


def test_failed_setup_undoes_what_it_placed(cases: dict[str, Case], monkeypatch: pytest.MonkeyPatch) -> None:
    from diffuserve.runtime import layerwise

    def out_of_memory(self) -> None:
        raise MemoryError("simulated out-of-memory while placing a permanent set")

    monkeypatch.setattr(layerwise.LayerwiseStrategy, "setup", out_of_memory)
    plans = {
        "vae": plan("vae", ResidencyMode.COMPONENT_OFFLOAD),
        "transformer": plan("transformer", ResidencyMode.LAYERWISE_OFFLOAD),
    }
    with pytest.raises(MemoryError):
        with managed(cases, plans):
            pass
    # The VAE was detached before the failure; it has its weights and no hooks again.
    with torch.no_grad():
        assert (cases["vae"].run() - cases["vae"].reference).abs().max().item() <= TOL
    assert not cases["vae"].module._diffusers_hook.hooks


def test_layerwise_without_layers_or_with_too_many_resident_layers(cases: dict[str, Case]) -> None:
    ledger = TransferLedger()
    lonely = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="--component-residency") as info:
        ComponentResidencyManager(
            {"proj": lonely},
            {"proj": ComponentPlan("proj", "other", ResidencyMode.LAYERWISE_OFFLOAD)},
            device="cpu",
            ledger=ledger,
        )
    assert "declares no layer structure" in info.value.message
    with pytest.raises(ConfigError, match="--layerwise-resident-layers") as info:
        with managed(cases, {"text_encoder": plan("text_encoder", ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=3)}):
            pass
    assert "declares 2 layers" in info.value.message


def test_default_layer_specs(cases: dict[str, Case]) -> None:
    assert default_layer_specs("transformer", cases["transformer"].module) == [
        "transformer_blocks",
        "single_transformer_blocks",
    ]
    assert default_layer_specs("text_encoder", cases["text_encoder"].module) in (
        ["text_model.encoder.layers"],
        ["encoder.layers"],
    )  # transformers 4 / 5 layouts
    assert default_layer_specs("text_encoder_2", cases["text_encoder_2"].module) == ["encoder.block"]
    assert default_layer_specs("vae", cases["vae"].module) == ["decoder.up_blocks", "encoder.down_blocks"]
    assert default_layer_specs("proj", torch.nn.Linear(2, 2)) is None


def test_build_residency_defaults_missing_components_to_resident(cases: dict[str, Case]) -> None:
    ledger = TransferLedger()
    dp = DeploymentPlan(
        components={
            "vae": plan("vae", ResidencyMode.SNAPSHOT_OFFLOAD),
            "transformer_2": plan("transformer", ResidencyMode.COMPONENT_OFFLOAD),
        }
    )
    manager = build_residency(
        dp,
        {"vae": cases["vae"].module, "text_encoder": cases["text_encoder"].module, "tokenizer": object()},
        device="cpu",
        ledger=ledger,
    )
    try:
        assert manager.describe()["text_encoder"]["mode"] == "resident"
        assert manager.describe()["vae"] == {"mode": "snapshot-offload", "bytes": cases["vae"].total}
        assert ledger.device_bytes() == cases["text_encoder"].total
    finally:
        manager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layerwise_pinned_prefetch_matches_and_ledger_agrees_with_allocator(cases: dict[str, Case]) -> None:
    """The CUDA path: pinned host copies, copy stream + events, ledger vs max_memory_allocated."""
    import copy

    name = "transformer"
    module = copy.deepcopy(cases[name].module)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16),
        encoder_hidden_states=torch.randn(1, 8, 32),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
    )
    inputs = {k: v.cuda() for k, v in inputs.items()}
    with torch.no_grad():
        reference = module.cuda()(**inputs, return_dict=False)[0]
    module.cpu()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    ledger = TransferLedger()
    p = plan(name, ResidencyMode.LAYERWISE_OFFLOAD, prefetch_size=2, resident_layers=1, pin_memory=True)
    manager = build_residency(DeploymentPlan(components={name: p}), {name: module}, device="cuda", ledger=ledger)
    try:
        with torch.no_grad(), manager.use(name):
            outs = [module(**inputs, return_dict=False)[0] for _ in range(3)]
        torch.cuda.synchronize()
        for out in outs:
            # Same device, same kernels: only a changed weight could move the result.
            assert (out - reference).abs().max().item() <= TOL
        check = ledger.check_against_cuda(baseline_bytes=baseline)
        assert check.ok, check.message
        assert ledger.device_bytes(name) == 0
    finally:
        manager.close()


# 4. End to end through the native FLUX pipeline -------------------------------------------------


@pytest.fixture(scope="module")
def flux_pipeline(tiny_flux_path):
    from diffuserve.models.loader import load_pipeline

    return load_pipeline(tiny_flux_path, device="cpu", dtype="float32")


def _images(pipeline) -> list:
    import numpy as np

    from diffuserve.sampling import SamplingParams

    params = SamplingParams(prompt="a red cat", width=64, height=64, num_inference_steps=3, seed=7, n=2)
    result = pipeline.run([params])
    return [np.asarray(im) for im in result.outputs[0].images]


E2E_PLANS = {
    "mixed": {
        "transformer": dict(mode=ResidencyMode.LAYERWISE_OFFLOAD, prefetch_size=1, resident_layers=1),
        "text_encoder": dict(mode=ResidencyMode.COMPONENT_OFFLOAD),
        "text_encoder_2": dict(mode=ResidencyMode.SNAPSHOT_OFFLOAD),
        "vae": dict(mode=ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=1),
    },
    "swapped": {
        "transformer": dict(mode=ResidencyMode.COMPONENT_OFFLOAD),
        "text_encoder": dict(mode=ResidencyMode.LAYERWISE_OFFLOAD, prefetch_size=2),
        "text_encoder_2": dict(mode=ResidencyMode.LAYERWISE_OFFLOAD),
        "vae": dict(mode=ResidencyMode.SNAPSHOT_OFFLOAD),
    },
    "permanent": {
        "transformer": dict(mode=ResidencyMode.LAYERWISE_OFFLOAD, resident_layers=1, lifetime=Lifetime.PERMANENT),
        "vae": dict(mode=ResidencyMode.COMPONENT_OFFLOAD),
    },
}


@pytest.mark.parametrize("plan_name", list(E2E_PLANS))
def test_flux_pipeline_with_residency_matches_resident(flux_pipeline, plan_name: str) -> None:
    pipe = flux_pipeline
    reference = _images(pipe)
    steps = 3
    dp = DeploymentPlan(components={n: plan(n, **kw) for n, kw in E2E_PLANS[plan_name].items()})
    ledger = TransferLedger()
    pipe.residency = build_residency(dp, pipe.components, device="cpu", ledger=ledger)
    try:
        before = ledger.device_bytes()
        ledger.begin_window()
        images = _images(pipe)
        summary = ledger.window_summary()
        # Same tensors, same kernels: the PNG-bound pixels are identical, not merely close.
        assert len(images) == len(reference) == 2
        for got, ref in zip(images, reference, strict=True):
            assert (got == ref).all()
        # Offloaded components hold device weights only during their own stage: replaying the
        # request's moves, at most one component holds more than it held before the request.
        offloaded = set(E2E_PLANS[plan_name])
        delta: dict[str, int] = {}
        for m in summary.moves:
            delta[m.component] = delta.get(m.component, 0) + (m.nbytes if m.direction == "h2d" else -m.nbytes)
            held = {c for c, b in delta.items() if b > 0}
            assert len(held) <= 1, (m, held)
        assert {m.component for m in summary.moves} == offloaded
        # The DiT runs once per step; a streamed DiT layer moves once per step.
        dit_plan = E2E_PLANS[plan_name]["transformer"]
        if dit_plan["mode"] is ResidencyMode.LAYERWISE_OFFLOAD:
            h2d = [m.layer for m in summary.moves if m.component == "transformer" and m.direction == "h2d"]
            layers = default_layer_specs("transformer", pipe.adapter.transformer)
            names = [f"{s}.{i}" for s in layers for i in range(len(pipe.adapter.transformer.get_submodule(s)))]
            assert h2d.count(names[0]) == (0 if dit_plan.get("lifetime") is Lifetime.PERMANENT else 1)
            assert all(h2d.count(n) == steps for n in names[1:])
        # After the request every component holds what it held before (0, or its permanent set).
        assert all(b == 0 for b in delta.values())
        assert ledger.device_bytes() == before
    finally:
        pipe.residency.close()
        from diffuserve.pipelines.base import AllResident

        pipe.residency = AllResident()


@pytest.mark.parametrize("mode", [ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD])
def test_diffusers_backend_with_offload_matches_resident(tiny_sd3_path, mode: ResidencyMode) -> None:
    """An unmodified diffusers pipeline calls its modules itself: every component is onloaded for
    the whole call, and its output still equals the resident run."""
    import numpy as np

    from diffuserve.models.loader import load_pipeline
    from diffuserve.sampling import SamplingParams

    pipe = load_pipeline(tiny_sd3_path, backend="diffusers")  # SD3 has a native adapter too
    params = [SamplingParams(prompt="a tree", seed=3, num_inference_steps=2)]
    reference = np.asarray(pipe.run(params).outputs[0].images[0])
    dp = DeploymentPlan(components={n: ComponentPlan(name=n, group="other", mode=mode) for n in pipe.components})
    ledger = TransferLedger()
    pipe.residency = build_residency(dp, pipe.components, device="cpu", ledger=ledger)
    try:
        assert ledger.device_bytes() == 0  # everything is off the device between requests
        ledger.begin_window()
        got = np.asarray(pipe.run(params).outputs[0].images[0])
        assert (got == reference).all()
        assert {m.component for m in ledger.window_summary().moves} == set(pipe.components)
        assert ledger.device_bytes() == 0
    finally:
        pipe.residency.close()
