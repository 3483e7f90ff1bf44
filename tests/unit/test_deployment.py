"""Plan resolution: the seed's deployment rules as table cases, plus profiles read from checkpoint headers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diffuserve.config.argparse_dataclass import parse_bool
from diffuserve.config.deployment import DeploymentArgs, format_plan, resolve_plan
from diffuserve.config.model_profiles import (
    ComponentProfile,
    ModelProfile,
    family_profile,
    profile_from_checkpoint,
    resolve_layer_containers,
)
from diffuserve.config.plan import Lifetime, ResidencyMode
from diffuserve.errors import CheckpointError, ConfigError
from diffuserve.hardware import GIB, HardwareInfo, describe_hardware

R, CO, SO, LW = "resident", "component-offload", "snapshot-offload", "layerwise-offload"


def comp(name: str, group: str, gib: float, layers: int = 0, layers_gib: float = 0.0) -> ComponentProfile:
    return ComponentProfile(
        name=name,
        group=group,
        class_name=f"{name}Class",
        param_bytes=int(gib * GIB),
        layer_container_paths=("blocks",) if layers else (),
        num_layers=layers,
        layers_bytes=int(layers_gib * GIB),
        has_layers=layers > 0,
    )


def profile(family: str, **overrides: Any) -> ModelProfile:
    """Realistic sizes: FLUX (24 GiB DiT, 9 GiB T5), Wan 14B video, Qwen-Image, Sana without DiT presets."""
    comps = {
        "flux": [
            comp("transformer", "dit", 24, 57, 22.8),
            comp("text_encoder", "text_encoder", 0.25, 12),
            comp("text_encoder_2", "text_encoder", 9, 24),
            comp("vae", "vae", 0.3, 8),
        ],
        "qwen_image": [
            comp("transformer", "dit", 38, 60),
            comp("text_encoder", "text_encoder", 16, 28),
            comp("vae", "vae", 0.5, 8),
        ],
        "wan": [
            comp("transformer", "dit", 28, 40),
            comp("text_encoder", "text_encoder", 11, 24),
            comp("image_encoder", "image_encoder", 1.2, 32),
            comp("vae", "vae", 0.5),
        ],
        "sana": [
            comp("transformer", "dit", 3.2, 20),
            comp("text_encoder", "text_encoder", 5, 26),
            comp("vae", "vae", 0.6),
        ],
    }[family]
    return dataclasses.replace(family_profile(family), components={c.name: c for c in comps}, **overrides)


def plan_for(
    family: str = "flux",
    gib: float | list[float] = 80.0,
    num_gpus: int = 1,
    prof: ModelProfile | None = None,
    hardware: HardwareInfo | None = None,
    **args: Any,
):
    gpus = len(gib) if isinstance(gib, list) else num_gpus
    hw = hardware or describe_hardware(gpus, gib)
    return resolve_plan(DeploymentArgs(num_gpus=num_gpus, **args), hw, prof or profile(family))


def modes(plan) -> dict[str, str]:
    return {name: c.mode.value for name, c in plan.components.items()}


CPU = HardwareInfo(device_kind="cpu", host_memory_bytes=16 * GIB)

# (id, plan kwargs, expected component modes, expected plan attributes)
CASES: list[tuple[str, dict[str, Any], dict[str, str], dict[str, Any]]] = [
    # -- auto: the 45 GiB DiT threshold, decided by the smallest free memory of the selected GPUs
    ("auto_44.9_offloads_dit", {"gib": 44.9}, {"transformer": CO, "text_encoder_2": CO}, {}),
    # Issue 22 item 5: a small encoder stays resident when the DiT does and the whole model fits comfortably.
    ("auto_45_keeps_dit", {"gib": 45.0}, {"transformer": R, "text_encoder_2": LW, "text_encoder": R}, {}),
    ("auto_small_encoder_offloaded_with_the_dit", {"gib": 44.9}, {"transformer": CO, "text_encoder": CO}, {}),
    ("auto_46_keeps_dit", {"gib": 46.0}, {"transformer": R}, {}),
    ("auto_min_over_selected_gpus", {"gib": [80.0, 40.0], "num_gpus": 2}, {"transformer": CO}, {}),
    ("auto_unselected_gpu_ignored", {"gib": [80.0, 40.0], "num_gpus": 1}, {"transformer": R}, {}),
    ("auto_tight_gpu_streams_dit", {"gib": 16.0}, {"transformer": LW}, {}),
    ("auto_tight_gpu_no_dit_preset", {"family": "sana", "gib": 3.5}, {"transformer": CO}, {}),
    ("auto_vae_below_threshold", {"gib": 23.9}, {"vae": CO}, {}),
    ("auto_vae_at_threshold", {"gib": 24.0}, {"vae": R}, {}),
    ("auto_small_encoder_not_streamed", {"gib": 80.0}, {"text_encoder": R, "text_encoder_2": LW}, {}),
    # -- video: DiT residency is per model profile; FSDP/CFG parallel on validated multi-GPU set-ups
    (
        "auto_video_dit_offloaded_on_big_gpu",
        {"family": "wan", "gib": 80.0},
        {"transformer": CO},
        {"use_fsdp_inference": False},
    ),
    (
        "auto_video_fsdp_replaces_offload",
        {"family": "wan", "gib": 80.0, "num_gpus": 2},
        {"transformer": R},
        {"use_fsdp_inference": True, "enable_cfg_parallel": True},
    ),
    (
        "explicit_fsdp_false_stays_off",
        {"family": "wan", "gib": 80.0, "num_gpus": 2, "use_fsdp_inference": False},
        {"transformer": CO},
        {"use_fsdp_inference": False, "enable_cfg_parallel": True},
    ),
    (
        "explicit_fsdp_true_replaces_mode_offload",
        {"family": "qwen_image", "gib": 40.0, "num_gpus": 2, "use_fsdp_inference": True},
        {"transformer": R},
        {"use_fsdp_inference": True},
    ),
    (
        "explicit_cfg_false_stays_off",
        {"family": "wan", "gib": 80.0, "num_gpus": 2, "enable_cfg_parallel": False},
        {},
        {"enable_cfg_parallel": False, "use_fsdp_inference": True},
    ),
    (
        "explicit_dit_residency_blocks_auto_fsdp",
        {"family": "wan", "gib": 80.0, "num_gpus": 2, "dit_cpu_offload": True},
        {"transformer": CO},
        {"use_fsdp_inference": False},
    ),
    (
        "image_family_without_fsdp_profile",
        {"family": "qwen_image", "gib": 40.0, "num_gpus": 2},
        {"transformer": LW},
        {"use_fsdp_inference": False, "enable_cfg_parallel": True},
    ),
    (
        "parallel_policy_blocks_auto_cfg",
        {"family": "qwen_image", "gib": 80.0, "num_gpus": 2, "sp_degree": 2},
        {},
        {"enable_cfg_parallel": False, "sp_degree": 2},
    ),
    ("no_cfg_family_no_cfg_parallel", {"gib": 80.0, "num_gpus": 2}, {}, {"enable_cfg_parallel": False}),
    # -- speed / memory / manual presets
    (
        "speed_all_resident_no_memory_check",
        {"gib": 8.0, "performance_mode": "speed"},
        {"transformer": R, "text_encoder": R, "text_encoder_2": R, "vae": R},
        {"enable_torch_compile": False},
    ),
    (
        "speed_explicit_offload_wins",
        {"gib": 8.0, "performance_mode": "speed", "dit_cpu_offload": True},
        {"transformer": CO, "vae": R},
        {},
    ),
    (
        "speed_cfg_parallel_on_2_gpus",
        {"family": "qwen_image", "performance_mode": "speed", "num_gpus": 2},
        {},
        {"enable_cfg_parallel": True, "use_fsdp_inference": False},
    ),
    (
        "memory_flux",
        {"gib": 80.0, "performance_mode": "memory"},
        {"transformer": LW, "text_encoder": CO, "text_encoder_2": LW, "vae": LW},
        {},
    ),
    (
        "memory_no_dit_layerwise_preset",
        {"family": "sana", "performance_mode": "memory"},
        {"transformer": CO, "vae": CO},
        {},
    ),
    (
        "memory_vae_resident_recipe",
        {"performance_mode": "memory", "component_residency": ["vae=resident"]},
        {"vae": R, "transformer": LW},
        {},
    ),
    (
        "manual_changes_nothing",
        {"family": "qwen_image", "gib": 8.0, "num_gpus": 2, "performance_mode": "manual"},
        {"transformer": R, "text_encoder": R, "vae": R},
        {"use_fsdp_inference": False, "enable_cfg_parallel": False},
    ),
    (
        "manual_legacy_flags",
        {"performance_mode": "manual", "text_encoder_cpu_offload": True},
        {"transformer": R, "text_encoder": CO, "text_encoder_2": CO},
        {},
    ),
    # -- canonical selectors vs legacy flags vs mode defaults
    (
        "selector_overrides_only_matching_legacy",
        {
            "gib": 80.0,
            "text_encoder_cpu_offload": False,
            "vae_cpu_offload": True,
            "component_residency": ["text_encoder_2=layerwise-offload"],
        },
        {"text_encoder": R, "text_encoder_2": LW, "vae": CO, "transformer": R},
        {},
    ),
    (
        "selector_beats_legacy_same_component",
        {"gib": 30.0, "dit_cpu_offload": True, "component_residency": ["dit=resident"]},
        {"transformer": R},
        {},
    ),
    (
        "key_beats_group_beats_all",
        {"component_residency": ["all=component-offload", "text_encoder=snapshot-offload", "text_encoder_2=resident"]},
        {"transformer": CO, "text_encoder": SO, "text_encoder_2": R, "vae": CO},
        {},
    ),
    ("later_selector_wins_on_tie", {"component_residency": ["vae=resident", "vae=snapshot-offload"]}, {"vae": SO}, {}),
    (
        "legacy_dit_layerwise_under_speed",
        {"performance_mode": "speed", "dit_layerwise_offload": True},
        {"transformer": LW, "vae": R},
        {},
    ),
    (
        "legacy_dit_layerwise_false_under_memory",
        {"performance_mode": "memory", "dit_layerwise_offload": False},
        {"transformer": CO, "vae": LW},
        {},
    ),
    (
        "legacy_layerwise_list",
        {"performance_mode": "manual", "layerwise_offload_components": "dit, vae"},
        {"transformer": LW, "vae": LW, "text_encoder": R},
        {},
    ),
    # -- no accelerator: auto does not invent GPU memory; offload modes still run on the CPU
    (
        "cpu_auto_all_resident",
        {"hardware": CPU},
        {"transformer": R, "text_encoder": R, "text_encoder_2": R, "vae": R},
        {},
    ),
    (
        "cpu_memory_really_offloads",
        {"hardware": CPU, "performance_mode": "memory"},
        {"transformer": LW, "text_encoder": CO},
        {},
    ),
    (
        "cpu_snapshot_allowed",
        {"hardware": CPU, "component_residency": ["dit=snapshot-offload"]},
        {"transformer": SO},
        {},
    ),
    (
        "cpu_ranks_not_limited_by_gpus",
        {"hardware": CPU, "num_gpus": 2, "family": "qwen_image"},
        {"transformer": R},
        {"num_gpus": 2, "enable_cfg_parallel": True},
    ),
]


@pytest.mark.parametrize("kwargs,expected_modes,expected_attrs", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resolution_table(
    kwargs: dict[str, Any], expected_modes: dict[str, str], expected_attrs: dict[str, Any]
) -> None:
    plan = plan_for(**kwargs)
    assert {k: modes(plan)[k] for k in expected_modes} == expected_modes, format_plan(plan)
    for attr, value in expected_attrs.items():
        assert getattr(plan, attr) == value, (attr, format_plan(plan))
    assert plan.trace, "every plan explains itself"


# (id, plan kwargs, ConfigError.param, text that must be in the message)
ERRORS: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "layerwise_without_layers",
        {"family": "wan", "component_residency": ["vae=layerwise-offload"]},
        "component_residency",
        "declares no layer",
    ),
    (
        "legacy_list_without_layers",
        {"family": "wan", "layerwise_offload_components": "vae"},
        "layerwise_offload_components",
        "declares no layer",
    ),
    (
        "all_layerwise_reaches_layerless_vae",
        {"family": "sana", "component_residency": ["all=layerwise-offload"]},
        "component_residency",
        "vae",
    ),
    ("unknown_component", {"component_residency": ["transfomer=resident"]}, "component_residency", "'transformer'"),
    ("unknown_mode", {"component_residency": ["dit=layerwise"]}, "component_residency", "'layerwise-offload'"),
    ("selector_without_equals", {"component_residency": ["dit"]}, "component_residency", "NAME=VALUE"),
    (
        "unknown_lifetime",
        {"performance_mode": "memory", "layerwise_residency_lifetime": ["dit=forever"]},
        "layerwise_residency_lifetime",
        "forward, permanent",
    ),
    ("unknown_performance_mode", {"performance_mode": "fast"}, "performance_mode", "not one of"),
    (
        "snapshot_of_fsdp_shard",
        {"family": "wan", "num_gpus": 2, "use_fsdp_inference": True, "component_residency": ["dit=snapshot-offload"]},
        "use_fsdp_inference",
        "offloads transformer",
    ),
    ("fsdp_on_one_gpu", {"use_fsdp_inference": True}, "use_fsdp_inference", "--num-gpus 1"),
    ("cfg_parallel_on_one_gpu", {"enable_cfg_parallel": True}, "num_gpus", "2 ranks"),
    ("degrees_exceed_gpus", {"num_gpus": 2, "sp_degree": 2, "tp_size": 2}, "num_gpus", "4 ranks"),
    ("more_gpus_than_present", {"gib": [80.0, 80.0], "num_gpus": 3}, "num_gpus", "only 2"),
    (
        "graph_needs_cuda",
        {"hardware": CPU, "enable_breakable_cuda_graph": True, "warmup_resolutions": ["512x512"]},
        "enable_breakable_cuda_graph",
        "CUDA",
    ),
    (
        "graph_needs_resolutions",
        {"enable_breakable_cuda_graph": True},
        "warmup_resolutions",
        "every serving resolution",
    ),
    (
        "graph_image_only",
        {"family": "wan", "enable_breakable_cuda_graph": True, "warmup_resolutions": ["832x480"]},
        "enable_breakable_cuda_graph",
        "image pipelines",
    ),
    ("bad_warmup_resolution", {"warmup_resolutions": ["1024*1024"]}, "warmup_resolutions", "WxH"),
    (
        "too_many_resident_layers",
        {"performance_mode": "memory", "layerwise_resident_layers": ["dit=58"]},
        "layerwise_resident_layers",
        "57 layers",
    ),
    (
        "ratio_out_of_range",
        {"performance_mode": "memory", "layerwise_resident_layers": ["dit=1.5"]},
        "layerwise_resident_layers",
        "between 0 and 1",
    ),
    (
        "bad_count_on_ignored_component",
        {"gib": 80.0, "layerwise_resident_layers": ["vae=lots"]},
        "layerwise_resident_layers",
        "vae=lots",
    ),
    (
        "bad_lifetime_on_ignored_component",
        {"gib": 80.0, "layerwise_residency_lifetime": ["vae=forever"]},
        "layerwise_residency_lifetime",
        "forward, permanent",
    ),
    (
        "negative_prefetch",
        {"performance_mode": "memory", "dit_offload_prefetch_size": -1},
        "dit_offload_prefetch_size",
        "0 or more",
    ),
    (
        "contradicting_legacy_layerwise",
        {"dit_layerwise_offload": False, "layerwise_offload_components": "dit"},
        "layerwise_offload_components",
        "drop one",
    ),
]


@pytest.mark.parametrize("kwargs,param,text", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_unsupported_choices_fail_naming_the_flag(kwargs: dict[str, Any], param: str, text: str) -> None:
    with pytest.raises(ConfigError) as err:
        plan_for(**kwargs)
    assert err.value.param == param
    assert text in err.value.message


# -- layer-wise knobs -------------------------------------------------------------------------------------
PERM = {"gib": 24.0, "performance_mode": "memory", "layerwise_resident_layers": ["dit=40", "text_encoder_2=20"]}


def test_permanent_sets_that_do_not_fit_fail_but_forward_is_accepted() -> None:
    # DiT: 40 x 0.4 GiB = 16 GiB; T5: 20 x 0.375 GiB = 7.5 GiB; together with the streaming buffers > 24 GiB.
    with pytest.raises(ConfigError) as err:
        plan_for(**PERM, layerwise_residency_lifetime=["all=permanent"])
    assert err.value.param == "layerwise_residency_lifetime"
    assert "24.00 GiB free" in err.value.message
    plan = plan_for(**PERM)  # forward: each set is on the device only while its component runs
    assert plan.components["transformer"].lifetime is Lifetime.FORWARD
    assert plan.components["transformer"].resident_layers == 40


def test_permanent_that_fits_is_placed_and_traced() -> None:
    plan = plan_for(
        gib=24.0,
        performance_mode="memory",
        layerwise_resident_layers=["dit=40"],
        dit_layerwise_residency_lifetime="permanent",
    )
    assert plan.components["transformer"].lifetime is Lifetime.PERMANENT
    assert any(line.startswith("permanent:") and "fits" in line for line in plan.trace)


def test_permanent_fit_is_not_checked_on_a_cpu_host() -> None:
    plan = plan_for(
        hardware=CPU, **{k: v for k, v in PERM.items() if k != "gib"}, layerwise_residency_lifetime=["all=permanent"]
    )
    assert plan.components["text_encoder_2"].lifetime is Lifetime.PERMANENT
    assert any("fit check skipped" in line for line in plan.trace)


def test_canonical_lifetime_beats_legacy_dit_lifetime() -> None:
    plan = plan_for(
        hardware=CPU,
        performance_mode="memory",
        dit_layerwise_residency_lifetime="permanent",
        layerwise_residency_lifetime=["transformer=forward"],
        layerwise_resident_layers=["dit=2"],
    )
    assert plan.components["transformer"].lifetime is Lifetime.FORWARD


def test_resident_layer_ratio_prefetch_and_ignored_knobs() -> None:
    plan = plan_for(
        gib=80.0,
        performance_mode="memory",
        dit_offload_prefetch_size=0,
        layerwise_resident_layers=["text_encoder_2=0.25", "text_encoder=3"],
    )
    assert plan.components["text_encoder_2"].resident_layers == 6  # 0.25 x 24 layers
    assert plan.components["transformer"].prefetch_size == 1  # 0 means 1
    assert plan.components["text_encoder"].resident_layers == 0  # component-offload: knob ignored, traced
    assert any("text_encoder=3 ignored" in line for line in plan.trace)
    assert plan_for(performance_mode="memory", dit_offload_prefetch_size=3).components["transformer"].prefetch_size == 3


def test_pinning_follows_cuda_and_the_flag() -> None:
    assert plan_for(performance_mode="memory").components["transformer"].pin_memory is True
    assert plan_for(performance_mode="memory", pin_cpu_memory=False).components["transformer"].pin_memory is False
    plan = plan_for(hardware=CPU, performance_mode="memory", pin_cpu_memory=True)
    assert plan.components["transformer"].pin_memory is False
    assert any("pin_cpu_memory: ignored on cpu" in line for line in plan.trace)


# -- compile ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,validated,explicit,expected",
    [
        ("speed", False, None, False),
        ("speed", True, None, True),
        ("auto", True, None, True),
        ("manual", True, None, False),
        ("speed", True, False, False),
        ("manual", False, True, True),
    ],
)
def test_compile_follows_profile_unless_explicit(
    mode: str, validated: bool, explicit: bool | None, expected: bool
) -> None:
    prof = profile("flux", compile_validated=validated)
    plan = plan_for(prof=prof, performance_mode=mode, enable_torch_compile=explicit)
    assert plan.enable_torch_compile is expected
    assert plan.offload_during_compile is True


def test_breakable_graph_with_resolutions_on_cuda() -> None:
    plan = plan_for(
        enable_breakable_cuda_graph=True, warmup_resolutions=["1024x1024", "768X512"], offload_during_compile=False
    )
    assert plan.enable_breakable_cuda_graph is True
    assert plan.warmup_resolutions == ["1024x1024", "768x512"]
    assert plan.offload_during_compile is False


# -- traces and output ----------------------------------------------------------------------------------------
def test_trace_names_the_rule_and_the_figures() -> None:
    plan = plan_for(gib=[80.0, 40.0], num_gpus=2)
    assert any(
        "transformer: component-offload (auto: min free 40.0 GiB over 2 GPUs < 45 GiB" in line for line in plan.trace
    )
    explicit = plan_for(dit_cpu_offload=False, gib=10.0)
    assert "transformer: resident (explicit --dit-cpu-offload false)" in explicit.trace


def test_format_plan_and_json() -> None:
    plan = plan_for(performance_mode="memory", layerwise_resident_layers=["dit=4"])
    text = format_plan(plan)
    assert "transformer" in text and "layerwise-offload" in text and "Why:" in text
    assert "fsdp=off" in text and "compile=off" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["components"]["transformer"]["resident_layers"] == 4
    assert data["components"]["transformer"]["mode"] == LW


def test_parse_bool() -> None:
    assert [parse_bool(t) for t in ("true", "False", "1", "0", "yes", "off")] == [True, False, True, False, True, False]
    with pytest.raises(argparse.ArgumentTypeError, match="maybe"):
        parse_bool("maybe")


def test_every_flag_has_help_and_docstring_default_none_or_list() -> None:
    for f in dataclasses.fields(DeploymentArgs):
        assert f.metadata.get("help"), f.name
    args = DeploymentArgs()
    assert args.performance_mode == "auto"
    assert args.enable_cfg_parallel is None and args.component_residency == []
    mode_field = next(f for f in dataclasses.fields(DeploymentArgs) if f.name == "performance_mode")
    assert mode_field.metadata["aliases"] == ["--mode"]


# -- profile_from_checkpoint: JSON and safetensors headers only ---------------------------------------------
def _save(path: Path, shapes: dict[str, tuple[int, ...]]) -> int:
    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
    save_file(tensors, str(path))
    return sum(t.numel() * 4 for t in tensors.values())


def _config(folder: Path, data: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("ckpt")
    (root / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "FluxPipeline",
                "_diffusers_version": "0.35.0",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "tokenizer": ["transformers", "CLIPTokenizer"],
                "text_encoder": ["transformers", "CLIPTextModel"],
                "text_encoder_2": ["transformers", "T5EncoderModel"],
                "transformer": ["diffusers", "FluxTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKL"],
                "image_encoder": [None, None],
            }
        )
    )
    (root / "scheduler").mkdir()
    sizes = {}
    _config(root / "transformer", {"_class_name": "FluxTransformer2DModel", "num_layers": 2, "num_single_layers": 3})
    dit = {f"transformer_blocks.{i}.attn.to_q.weight": (8, 8) for i in range(2)}
    dit |= {f"single_transformer_blocks.{i}.proj_out.weight": (4, 8) for i in range(3)} | {"x_embedder.weight": (8, 4)}
    sizes["transformer"] = _save(root / "transformer" / "diffusion_pytorch_model.safetensors", dit)
    # An fp16 variant next to the plain file must not be counted twice.
    _save(root / "transformer" / "diffusion_pytorch_model.fp16.safetensors", dit)
    sizes["transformer_layers"] = 4 * (2 * 64 + 3 * 32)
    _config(root / "text_encoder", {"architectures": ["CLIPTextModel"], "num_hidden_layers": 2})
    sizes["text_encoder"] = _save(
        root / "text_encoder" / "model.safetensors",
        {
            "text_model.encoder.layers.0.mlp.fc1.weight": (4, 4),
            "text_model.encoder.layers.1.mlp.fc1.weight": (4, 4),
            "text_model.embeddings.token_embedding.weight": (16, 4),
        },
    )
    _config(root / "text_encoder_2", {"architectures": ["T5EncoderModel"], "num_layers": 3})
    sizes["text_encoder_2"] = _save(
        root / "text_encoder_2" / "model-00001-of-00002.safetensors",
        {"encoder.block.0.w": (4, 4), "encoder.block.1.w": (4, 4)},
    )
    sizes["text_encoder_2"] += _save(
        root / "text_encoder_2" / "model-00002-of-00002.safetensors",
        {"encoder.block.2.w": (4, 4), "shared.weight": (10, 4)},
    )
    _config(root / "vae", {"_class_name": "AutoencoderKL", "block_out_channels": [4, 8]})
    sizes["vae"] = _save(
        root / "vae" / "diffusion_pytorch_model.safetensors",
        {
            "encoder.down_blocks.0.conv.weight": (4, 4),
            "decoder.up_blocks.1.conv.weight": (4, 4),
            "decoder.conv_out.weight": (3, 4),
        },
    )
    return root, sizes


def test_profile_from_checkpoint_reads_sizes_layers_and_groups(checkpoint: tuple[Path, dict[str, int]]) -> None:
    root, sizes = checkpoint
    prof = profile_from_checkpoint(root)
    assert prof.family == "flux" and prof.kind == "image"
    assert list(prof.components) == [
        "text_encoder",
        "text_encoder_2",
        "transformer",
        "vae",
    ]  # no tokenizer/scheduler/null
    dit = prof.components["transformer"]
    assert (dit.group, dit.param_bytes, dit.num_layers) == ("dit", sizes["transformer"], 5)
    assert dit.layer_container_paths == ("transformer_blocks", "single_transformer_blocks")
    assert dit.layers_bytes == sizes["transformer_layers"] and dit.has_layers
    te, t5, vae = prof.components["text_encoder"], prof.components["text_encoder_2"], prof.components["vae"]
    assert (te.group, te.num_layers, te.param_bytes) == ("text_encoder", 2, sizes["text_encoder"])
    assert (t5.num_layers, t5.param_bytes) == (3, sizes["text_encoder_2"])  # both shards counted
    assert (vae.group, vae.num_layers) == ("vae", 4)  # 2 down + 2 up blocks from block_out_channels
    # The profile drives a plan without loading anything.
    plan = resolve_plan(DeploymentArgs(performance_mode="memory"), CPU, prof)
    assert plan.components["transformer"].mode is ResidencyMode.LAYERWISE_OFFLOAD


def test_profile_family_override_and_generic(checkpoint: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    root, _ = checkpoint
    assert profile_from_checkpoint(root, family="wan").kind == "video"
    i2v = profile_from_checkpoint(root, family="wan_i2v")  # a registry variant takes its base family's defaults
    assert (i2v.family, i2v.kind, i2v.fsdp_can_replace_dit_offload) == ("wan_i2v", "video", True)
    ltx = profile_from_checkpoint(root, family="ltx")  # registry-known, no profile of ours: generic, video
    assert (ltx.kind, ltx.dit_resident_threshold_gib) == ("video", None)
    assert (
        profile_from_checkpoint(root, family="glm_image").dit_resident_threshold_gib == 45.0
    )  # spec without plan facts
    assert profile_from_checkpoint(root, family="flux2").dit_resident_threshold_gib == 80.0  # ~32B DiT: its own figure
    with pytest.raises(ConfigError, match="'qwen_image'"):
        profile_from_checkpoint(root, family="qwen-image")
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "SomeNewPipeline", "unet": ["diffusers", "MyUNet"]})
    )
    _config(tmp_path / "unet", {"_class_name": "MyUNet"})
    _save(tmp_path / "unet" / "diffusion_pytorch_model.safetensors", {"down.0.w": (2, 2)})
    prof = profile_from_checkpoint(tmp_path)
    assert prof.family == "generic"
    assert prof.components["unet"].group == "dit" and not prof.components["unet"].has_layers
    with pytest.raises(ConfigError, match="declares no layer"):
        resolve_plan(DeploymentArgs(component_residency=["dit=layerwise-offload"]), CPU, prof)


def test_profile_rejects_broken_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model_index.json is missing"):
        profile_from_checkpoint(tmp_path)
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]})
    )
    with pytest.raises(CheckpointError, match="folder .* is missing"):
        profile_from_checkpoint(tmp_path)
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        profile_from_checkpoint(tmp_path)


def test_profiling_and_resolving_never_import_torch(checkpoint: tuple[Path, dict[str, int]]) -> None:
    root, _ = checkpoint
    code = (
        "import sys; from pathlib import Path\n"
        "from diffuserve.config.model_profiles import profile_from_checkpoint\n"
        "from diffuserve.config.deployment import DeploymentArgs, resolve_plan, format_plan\n"
        "from diffuserve.hardware import describe_hardware\n"
        f"p = profile_from_checkpoint(Path({str(root)!r}))\n"
        "format_plan(resolve_plan(DeploymentArgs(), describe_hardware(1, 40.0), p))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_load_dtype_counts_float_weights_at_the_loaded_size(checkpoint: tuple[Path, dict[str, int]]) -> None:
    root, sizes = checkpoint
    prof = profile_from_checkpoint(root, load_dtype="bfloat16")  # the files hold float32
    assert prof.components["transformer"].param_bytes == sizes["transformer"] // 2
    assert prof.components["transformer"].layers_bytes == sizes["transformer_layers"] // 2
    with pytest.raises(ConfigError, match="'int8'"):
        profile_from_checkpoint(root, load_dtype="int8")


def test_resolve_layer_containers_finds_nested_paths() -> None:
    import torch.nn as nn

    clip = nn.Module()
    clip.text_model = nn.Module()
    clip.text_model.encoder = nn.Module()
    clip.text_model.encoder.layers = nn.ModuleList([nn.Linear(2, 2)])
    comp_ = ComponentProfile(
        name="text_encoder", layer_container_paths=("encoder.layers",), num_layers=1, has_layers=True
    )
    assert resolve_layer_containers(clip, comp_) == ["text_model.encoder.layers"]
    clip.vision = nn.Module()
    clip.vision.encoder = nn.Module()
    clip.vision.encoder.layers = nn.ModuleList()
    with pytest.raises(CheckpointError, match="several"):
        resolve_layer_containers(clip, comp_)
    missing = ComponentProfile(name="x", class_name="X", layer_container_paths=("blocks",))
    with pytest.raises(CheckpointError, match="matches none"):
        resolve_layer_containers(clip, missing)


def test_plan_and_start_up_refuse_a_diffusers_backend_split_with_the_same_words(checkpoint) -> None:
    """`diffuserve plan --backend diffusers --enable-cfg-parallel` and `serve` with the same flags stop at the same
    plan check, before any weight loads, with one message."""
    from diffuserve.config.server_args import ServerArgs
    from diffuserve.launch.setup import plan_deployment
    from diffuserve.plan_command import print_plan

    root, _ = checkpoint
    flags = {"num_gpus": 2, "enable_cfg_parallel": True}
    with pytest.raises(ConfigError) as planned:
        print_plan({"model_path": str(root), "backend": "diffusers", "gpu_memory_gib": 80.0, **flags})
    with pytest.raises(ConfigError) as started:
        plan_deployment(
            ServerArgs(model_path=str(root), backend="diffusers", deployment=DeploymentArgs(**flags)),
            root,
            "cpu",
            log_plan=False,
        )
    assert planned.value.message == started.value.message
    assert planned.value.param == "enable_cfg_parallel" and "runs on the diffusers backend" in planned.value.message
    # The same checkpoint natively: the plan describes it from its configs (no weights) and accepts the flag.
    natively = profile_from_checkpoint(root)
    assert natively.backend == "native" and natively.checkpoint is not None
    assert natively.checkpoint.size_multiple == 2 * 2  # this VAE has two levels (factor 2), FLUX packs 2x2


def test_start_up_refuses_a_token_budget_below_one_request_of_the_largest_size(checkpoint) -> None:
    """`--batching-max-tokens` below one row of the largest size the model allows exits 2 (a ConfigError) before any
    weight loads, naming both flags and the size; at one row it starts (a larger request would run alone)."""
    from diffuserve.config.model_profiles import profile_from_checkpoint
    from diffuserve.config.server_args import ServerArgs
    from diffuserve.launch.setup import plan_deployment

    root, _ = checkpoint
    facts = profile_from_checkpoint(root).checkpoint
    assert facts is not None and facts.size_multiple
    width, height = (
        (facts.max_width, facts.max_height) if facts.max_width else (facts.defaults.width, facts.defaults.height)
    )
    one_row = (width // facts.size_multiple) * (height // facts.size_multiple)
    args = {"model_path": str(root), "batching_mode": "dynamic", "batching_max_size": 4}
    with pytest.raises(ConfigError) as refused:
        plan_deployment(ServerArgs(**args, batching_max_tokens=one_row - 1), root, "cpu", log_plan=False)
    message = refused.value.message
    assert refused.value.param == "batching_max_tokens" and f"--batching-max-tokens {one_row - 1} " in message
    assert "--batching-max-size 4" in message and f"{width}x{height}" in message and f"at least {one_row}" in message
    plan_deployment(ServerArgs(**args, batching_max_tokens=one_row), root, "cpu", log_plan=False)


def test_plan_and_start_up_refuse_continuous_for_a_model_that_cannot_step(checkpoint) -> None:
    """`--batching-mode continuous` for a model whose denoiser cannot step row by row (here: the diffusers
    backend) stops `plan` and `serve` at the same check, before any weight loads, with one message naming the
    flag and the families that can; natively the same checkpoint plans fine."""
    from diffuserve.config.server_args import ServerArgs
    from diffuserve.launch.setup import plan_deployment
    from diffuserve.plan_command import print_plan

    root, _ = checkpoint
    with pytest.raises(ConfigError) as planned:
        print_plan({"model_path": str(root), "backend": "diffusers", "batching_mode": "continuous"})
    with pytest.raises(ConfigError) as started:
        plan_deployment(
            ServerArgs(model_path=str(root), backend="diffusers", batching_mode="continuous", batching_max_size=4),
            root,
            "cpu",
            log_plan=False,
        )
    assert planned.value.message == started.value.message
    assert planned.value.param == "batching_mode"
    assert planned.value.message.startswith("--batching-mode continuous: the flux model runs on the diffusers backend")
    assert "Use --batching-mode dynamic" in planned.value.message and "wan" in planned.value.message
    plan_deployment(
        ServerArgs(model_path=str(root), batching_mode="continuous", batching_max_size=4), root, "cpu", log_plan=False
    )
