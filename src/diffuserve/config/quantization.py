"""Which component is quantized with which method (`--quantization`), and what that does to the plan's bytes.

Pure (no torch): `plan` and start-up resolve the same thing with the same words. The grammar is
`--component-residency`'s (`config/residency_selectors.py`): `COMPONENT=METHOD` where COMPONENT is a model_index.json
key, a group (`dit`, `text_encoder`, `image_encoder`, ...) or `all`, the most specific selector winning; a bare
METHOD means the denoiser(s) (`dit=METHOD`). `none` keeps a component in the compute dtype.

Only Linear layers are quantized, and only in components made of them: the denoiser, text and image encoders. A
VAE (convolutions, and the decode's precision is the image's) or another component named explicitly is refused;
`all` passes over them. Each family's spec lists the DiT modules it keeps in high precision (`quant_keep`:
embedders, timestep / modulation / adaLN projections, norms, the final projection), and
`--quantization-ignored-layers` adds globs for every quantized component.

The plan counts a quantized component at its quantized size, from the safetensors headers: every 2-D `.weight`
that is not kept (and not an embedding table, which is no Linear) becomes 1 byte per element plus one fp32 scale
per output row; the rest stays at the load dtype. The deployment modes then read those bytes (a DiT that needs
offload in bf16 may stay resident in fp8).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diffuserve.config.deployment_args import flag_param
from diffuserve.config.model_profiles import LOAD_DTYPE_SIZES, ModelProfile, component_profile
from diffuserve.config.plan import DeploymentPlan
from diffuserve.config.quant_args import METHODS, NONE, QuantArgs
from diffuserve.config.residency_selectors import choose, select_targets, split_selector
from diffuserve.errors import ConfigError

FLAG = "--quantization"
QUANTIZABLE_GROUPS = ("dit", "text_encoder", "image_encoder")
"""Component groups made of Linear layers (the others are refused when named, skipped under `all`)."""
NOT_LINEAR = ("*embed_tokens", "shared", "*token_embedding", "*position_embedding", "*relative_attention_bias", "*wte")
"""2-D `.weight` tensors of the text encoders that belong to embedding tables, not Linears (the byte count skips
them; at load only `torch.nn.Linear` modules are quantized anyway)."""
SCALE_BYTES = 4
"""One fp32 scale per output row."""
ACTIVATION_DEVICES = {"int8-dynamic": ("cpu", "cuda"), "fp8": ("cpu", "cuda"), "int8": ("cpu", "cuda")}
"""Device kinds whose torch has each method's kernels (int8 `_int_mm`, float8 dtypes)."""


@dataclass(frozen=True)
class ComponentQuant:
    """One quantized component."""

    method: str
    """fp8 | int8 | int8-dynamic."""
    keep: tuple[str, ...]
    """Module-name globs kept in the compute dtype (the family's list for a DiT, then --quantization-ignored-layers)."""
    source: str
    """The selector that chose it (for messages)."""


@dataclass
class QuantPlan:
    """Each quantized component's method and kept layers, and why."""

    components: dict[str, ComponentQuant] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)

    def method(self, name: str) -> str | None:
        found = self.components.get(name)
        return found.method if found else None


def keeps(name: str, patterns: Sequence[str]) -> bool:
    """Whether module `name` (dotted, inside its component) matches a never-quantize glob."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _items(args: QuantArgs) -> list[tuple[str, str]]:
    return [split_selector(FLAG, item) if "=" in item else ("dit", item.strip()) for item in args.quantization]


def resolve_quantization(args: QuantArgs, profile: ModelProfile, device_kind: str) -> QuantPlan:
    """component -> method for this model on this device kind; exits 2 (ConfigError) naming the flag on an unknown
    method or component, a component that cannot be quantized, or a method the device has no kernels for."""
    plan = QuantPlan()
    if not args.quantization:
        if args.quantization_ignored_layers:
            plan.trace.append("quantization: --quantization-ignored-layers given without --quantization (no effect)")
        return plan
    items = _items(args)
    for _, value in items:
        choose(FLAG, value, (*METHODS, NONE))
    from diffuserve import family_spec

    family_keep = family_spec.spec_for(profile.family).quant_keep if profile.family in family_spec.all_specs() else ()
    for comp, (method, source) in select_targets(FLAG, items, profile).items():
        group = profile.components[comp].group
        if method == NONE:
            continue
        if group not in QUANTIZABLE_GROUPS:
            if source.split()[1].startswith("all="):
                plan.trace.append(f"{comp}: not quantized ({group} components keep the compute dtype; {source})")
                continue
            raise ConfigError(
                f"{source}: {comp} ({profile.components[comp].class_name or group}) cannot be quantized; "
                f"--quantization applies to the {', '.join(QUANTIZABLE_GROUPS)} components (their Linear layers).",
                param=flag_param(FLAG),
            )
        if device_kind not in ACTIVATION_DEVICES[method]:
            raise ConfigError(
                f"{source}: {method} needs kernels this {device_kind} device does not have (it runs on "
                f"{' and '.join(ACTIVATION_DEVICES[method])}); pick another method or device.",
                param=flag_param(FLAG),
            )
        keep = (*(family_keep if group == "dit" else ()), *args.quantization_ignored_layers)
        plan.components[comp] = ComponentQuant(method, tuple(dict.fromkeys(keep)), source)
        plan.trace.append(f"{comp}: {method} ({source}); {len(keep)} never-quantized pattern(s)")
    return plan


def quantized_bytes(keep: Sequence[str]) -> Callable[[str, list[int], int], int]:
    """The size of one tensor once its component is quantized (see the module docstring)."""

    def size(name: str, shape: list[int], nbytes: int) -> int:
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or keeps(module, keep) or keeps(module, NOT_LINEAR):
            return nbytes
        return shape[0] * shape[1] + shape[0] * SCALE_BYTES

    return size


def quantized_profile(
    profile: ModelProfile, quant: QuantPlan, model_path: Path, load_dtype: str | None
) -> ModelProfile:
    """The profile with each quantized component counted at its quantized size (weights + scales)."""
    if not quant.components:
        return profile
    components = dict(profile.components)
    for name, q in quant.components.items():
        old = components[name]
        if (model_path / name).is_dir():
            new = component_profile(name, old.class_name, model_path / name, load_dtype, resize=quantized_bytes(q.keep))
            new = dataclasses.replace(new, group=old.group)
        else:  # a layout without component folders (Hunyuan3D-2): every weight at 1 byte per element
            elem = LOAD_DTYPE_SIZES.get(load_dtype or "", 2)
            new = dataclasses.replace(old, param_bytes=old.param_bytes // elem, layers_bytes=old.layers_bytes // elem)
        components[name] = dataclasses.replace(new, unquantized_bytes=old.param_bytes)
        quant.trace.append(f"{name}: {q.method} weights {_size(new.param_bytes)} (from {_size(old.param_bytes)})")
    return profile.with_components(components)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def annotate(plan: DeploymentPlan, quant: QuantPlan) -> None:
    """Put each component's method and kept layers on the deployment plan (what /server_info, `plan` and the
    loader read), with the quantization's reasons in the plan's trace."""
    for name, q in quant.components.items():
        plan.components[name].quantization = q.method
        plan.components[name].quant_keep = q.keep
    plan.trace.extend(f"quantization: {line}" for line in quant.trace)


def plan_quantization(
    args: QuantArgs | None, profile: ModelProfile, device_kind: str, model_path: Path, load_dtype: str | None
) -> tuple[QuantPlan, ModelProfile]:
    """The quantization plan and the profile counted at the quantized sizes (what the residency modes read)."""
    quant = resolve_quantization(args or QuantArgs(), profile, device_kind)
    return quant, quantized_profile(profile, quant, model_path, load_dtype)
