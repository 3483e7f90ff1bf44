"""Activation memory: what one request needs beside the weights, the device's budget for it, and the 400 naming
the field that makes a request too big. Pure (no torch, no I/O): `diffuserve plan`, the engine's admission and the
unit tests share it, and a check is a few multiplications on the request path.

**The estimate** (`estimate_bytes`) of one request is the sum over its `n` output rows of (a simple, conservative
formula from the checkpoint's facts, `ActivationFacts`; docs/operations.md "Activation memory"):

- images, edits, videos: the DiT's activations, `2 (CFG) x tokens x hidden x dtype bytes x DIT_WIDTHS`, with
  `tokens` = latent tokens of the output (`width x height / token_side^2`, x latent frames for video) + the text
  tokens + the input images' tokens (edits); plus the VAE decode of the output,
  `width x height x frames x vae_channels x dtype bytes x VAE_COPIES`; plus the decoded pixels as float32
  (`OUTPUT_COPIES` copies) and
  `REQUEST_FLOOR` (workspace, allocator slack);
- meshes: the octree grid, `(octree + 1)^3 x MESH_BYTES_PER_POINT` (the float32 logits, the FlashVDM masks and
  marching cubes' output), plus one decoder chunk, `chunk x decoder width x dtype bytes x MESH_CHUNK_WIDTHS`, plus
  the floor.

The constants are calibrated on the tiny checkpoints (peak RSS of a generation minus the RSS before it; the
figures are in docs/operations.md) and chosen so that every measured peak stays below its estimate.

**The budget** (`activation_budget`) is the device memory left after the weights the plan keeps on the device at
once, times a fraction (`DEVICE_FRACTION`; the CPU's available RAM times `HOST_FRACTION`), or
`--activation-memory-gib`. A request whose estimate alone is over it is refused (`check_fits`); the schedulers never
start work whose estimate does not fit beside what is running (engine/scheduler.py rule 9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from diffuserve.errors import InvalidRequestError

GIB = 1024**3
MIB = 1024**2
DIT_WIDTHS = 24
"""Hidden-size-wide tensors per token alive in one DiT block: residual, norm, q/k/v, attention output, the MLP's
4x hidden (and its activation) and the modulation copies, with room for the ones that overlap."""
VAE_COPIES = 6
"""Full-resolution feature maps alive at once in the VAE decoder's last up block (input, norm, conv output,
residual, the upsampler's), each `vae_channels` wide."""
OUTPUT_COPIES = 4
"""Float32 RGB copies of the decoded output alive at once (the VAE's output, its clamp and rescale, the host copy)."""
REQUEST_FLOOR = 64 * MIB
"""Per request, whatever its size: workspace, temporaries of encoders and schedulers, allocator slack."""
MESH_BYTES_PER_POINT = 10
"""Per octree grid point: the float32 logits (4), FlashVDM's bool masks (~2) and an allowance for marching
cubes' vertices and faces on a rough surface (4)."""
MESH_CHUNK_WIDTHS = 16
"""Decoder-width tensors per query point alive in one geometry-decoder call (Fourier features, the cross-attention
block, its 4x MLP)."""
DEVICE_FRACTION = 0.9
"""Share of an accelerator's memory left after the weights that activations may use (the rest: the CUDA context,
fragmentation, the allocator's cache)."""
HOST_FRACTION = 0.75
"""Share of the host's available RAM (after the weights) that activations may use on a CPU deployment."""


@dataclass(frozen=True)
class ActivationFacts:
    """What the estimate knows about the served checkpoint (`activation_facts` derives it from its configs)."""

    kind: str = "image"
    """image | video | mesh."""
    token_side: int = 16
    """Pixels per side of one DiT token (VAE factor x patch)."""
    frames_per_latent: int = 4
    """Video: frames per latent frame (the VAE's temporal compression)."""
    hidden_size: int = 3072
    """The DiT's width (heads x head dim)."""
    vae_channels: int = 512
    """The VAE decoder's widest feature map, in channels."""
    text_tokens: int = 512
    """Text tokens a prompt may fill (the longest encoder's)."""
    dtype_bytes: int = 2
    """Bytes per activation (the load dtype)."""
    size_multiple: int = 16
    """Width and height snap to this (the largest size that fits is a multiple of it)."""
    frame_multiple: int = 4
    """Video: num_frames - 1 is a multiple of this."""
    chunk_size: int = 32000
    """Meshes: grid points per geometry-decoder call."""
    decoder_width: int = 1024
    """Meshes: the geometry decoder's width."""
    default_octree_resolution: int = 384
    """Meshes: the octree_resolution of a request that leaves it unset."""
    max_octree_resolution: int = 512
    """Meshes: the largest octree_resolution the model takes (the search for what fits starts there)."""


def _first_int(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def activation_facts(
    kind: str, configs: Mapping[str, Any], *, size_multiple: int | None, dtype_bytes: int, **extra: Any
) -> ActivationFacts:
    """The facts of a diffusers-format checkpoint from its configs (`family_spec.base.CheckpointConfigs`): the DiT's
    width from `transformer` (heads x head dim, else hidden_size), the VAE's widest block from `vae`; published
    FLUX-sized figures where a config does not say (conservative). `extra` sets the other fields (meshes)."""
    dit = configs.get("transformer") or configs.get("unet") or {}
    heads, head_dim = _first_int(dit, "num_attention_heads"), _first_int(dit, "attention_head_dim")
    hidden = heads * head_dim if heads and head_dim else _first_int(dit, "hidden_size", "inner_dim", "dim")
    vae = configs.get("vae") or {}
    blocks = vae.get("block_out_channels")
    widest = max(blocks) if isinstance(blocks, (list, tuple)) and blocks else None
    if widest is None and isinstance(vae.get("base_dim"), int):  # Wan's VAE: base_dim x its largest multiplier
        widest = vae["base_dim"] * max(vae.get("dim_mult") or [4])
    temporal = _first_int(vae, "scale_factor_temporal", "temporal_compression_ratio")
    base = ActivationFacts()
    return dataclasses.replace(
        base,
        kind=kind,
        token_side=size_multiple or base.token_side,
        size_multiple=size_multiple or base.size_multiple,
        frames_per_latent=temporal or base.frames_per_latent,
        hidden_size=hidden or base.hidden_size,
        vae_channels=widest or base.vae_channels,
        dtype_bytes=dtype_bytes,
        **extra,
    )


def row_bytes(facts: ActivationFacts, params: Any) -> int:
    """Activation bytes of one output row of `params` (a SamplingParams)."""
    if facts.kind == "mesh":
        side = (params.octree_resolution or facts.default_octree_resolution) + 1
        chunk = facts.chunk_size * facts.decoder_width * facts.dtype_bytes * MESH_CHUNK_WIDTHS
        return side**3 * MESH_BYTES_PER_POINT + chunk
    frames = max(1, params.num_frames) if facts.kind == "video" else 1
    latent_frames = (frames - 1) // facts.frames_per_latent + 1 if facts.kind == "video" else 1
    pixels = params.width * params.height
    image_tokens = pixels // facts.token_side**2
    tokens = image_tokens * latent_frames + facts.text_tokens + image_tokens * len(params.image_inputs)
    dit = 2 * tokens * facts.hidden_size * facts.dtype_bytes * DIT_WIDTHS
    vae = pixels * frames * facts.vae_channels * facts.dtype_bytes * VAE_COPIES
    return dit + vae + pixels * frames * 3 * 4 * OUTPUT_COPIES


def estimate_bytes(facts: ActivationFacts, params: Any) -> int:
    """Activation bytes of one request: its `n` rows and the floor (see the module docstring)."""
    return max(1, params.n) * row_bytes(facts, params) + REQUEST_FLOOR


def _largest(fits: Callable[[int], bool], low: int, high: int, step: int) -> int | None:
    """The largest value in low, low+step, ..., <= high for which `fits` holds (monotone), None when none does."""
    if high < low or not fits(low):
        return None
    lo, hi = 0, (high - low) // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(low + mid * step) else (lo, mid - 1)
    return low + lo * step


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def check_fits(facts: ActivationFacts, params: Any, budget_bytes: int, *, source: str = "") -> int:
    """The request's estimate; raises InvalidRequestError (400) when it alone is over `budget_bytes`, naming the
    field that makes it too big and the largest value of it that fits: `n` when one row fits, else (video)
    `num_frames` when the fewest frames fit, else the size (meshes: `octree_resolution`)."""
    need = estimate_bytes(facts, params)
    if need <= budget_bytes:
        return need

    def fits(name: str) -> Callable[[int], bool]:
        return lambda value: estimate_bytes(facts, dataclasses.replace(params, **{name: value})) <= budget_bytes

    head = f"needs ~{_gib(need)} of activation memory, the budget is {_gib(budget_bytes)}{source}"
    if params.n > 1 and (most := _largest(fits("n"), 1, params.n, 1)) is not None:
        raise InvalidRequestError(f"n={params.n} {head}; the largest n that fits is {most}.", param="n")
    if facts.kind == "mesh":
        side = _largest(fits("octree_resolution"), 16, facts.max_octree_resolution, 1)
        tail = f"the largest octree_resolution that fits is {side}" if side else "not even octree_resolution 16 fits"
        asked = params.octree_resolution or facts.default_octree_resolution
        raise InvalidRequestError(f"octree_resolution={asked} {head}; {tail}.", param="octree_resolution")
    if facts.kind == "video" and params.num_frames > 1:
        step = facts.frame_multiple
        most = _largest(fits("num_frames"), 1, params.num_frames, step)
        if most is not None:
            raise InvalidRequestError(
                f"num_frames={params.num_frames} at {params.width}x{params.height} {head}; the most frames that fit "
                f"at this size are {most}.",
                param="num_frames",
            )
    square = _largest(
        lambda s: estimate_bytes(facts, dataclasses.replace(params, width=s, height=s, n=1)) <= budget_bytes,
        facts.size_multiple,
        max(params.width, params.height),
        facts.size_multiple,
    )
    tail = f"the largest square size that fits is {square}x{square}" if square else "no size fits"
    raise InvalidRequestError(f"size {params.width}x{params.height} {head}; {tail}.", param="size")


@dataclass(frozen=True)
class ActivationBudget:
    """The device's activation budget and where it came from (`diffuserve plan`, /server_info, the 400s)."""

    bytes: int | None = None
    """Bytes activations may use at once on one replica; None: unbounded (`--activation-memory-gib 0`)."""
    source: str = ""
    """How it was derived, for people: `--activation-memory-gib 8`, or the free memory and the weights."""

    def to_dict(self) -> dict[str, Any]:
        gib = None if self.bytes is None else round(self.bytes / GIB, 3)
        return {"activation_memory_gib": gib, "source": self.source}

    def describe(self) -> str:
        if self.bytes is None:
            return f"activation memory: unbounded ({self.source})"
        return f"activation memory budget: {_gib(self.bytes)} ({self.source})"


def activation_budget(
    *, override_gib: float | None, device_kind: str, free_bytes: int, weights_on_device: int
) -> ActivationBudget:
    """`--activation-memory-gib` when given (0: unbounded), else the free memory after the weights the plan keeps
    on the device at once, times DEVICE_FRACTION (an accelerator) or HOST_FRACTION (CPU: the available RAM)."""
    if override_gib is not None:
        if override_gib == 0:
            return ActivationBudget(None, "--activation-memory-gib 0")
        return ActivationBudget(int(override_gib * GIB), f"--activation-memory-gib {override_gib:g}")
    fraction = HOST_FRACTION if device_kind == "cpu" else DEVICE_FRACTION
    left = max(0, free_bytes - weights_on_device)
    where = "available RAM" if device_kind == "cpu" else f"free {device_kind} memory"
    return ActivationBudget(
        int(left * fraction),
        f"{fraction:.0%} of {where} {_gib(free_bytes)} after {_gib(weights_on_device)} of weights",
    )


def weights_on_device(plan: Any, profile: Any, device_kind: str) -> int:
    """Bytes of weights the deployment plan keeps on one device at once, from the plan's modes and the profile's
    per-component bytes (so a quantized checkpoint's smaller bytes follow): resident components whole, plus the
    largest one moved on for its use (component / snapshot offload: whole; layer-wise: its resident layers, the
    streamed layers in flight and what is outside its layers). On CPU the host is the device: every weight."""
    sizes = {name: comp for name, comp in profile.components.items()}
    if device_kind == "cpu":
        return sum(comp.param_bytes for comp in sizes.values())
    resident = transient = 0
    for name, part in plan.components.items():
        comp = sizes.get(name)
        if comp is None:
            continue
        mode = str(getattr(part.mode, "value", part.mode))
        if mode == "resident":
            resident += comp.param_bytes
        elif mode == "layerwise-offload":
            layer = comp.layer_bytes()
            outside = comp.param_bytes - (comp.layers_bytes or comp.param_bytes)
            resident += layer * part.resident_layers
            transient = max(transient, layer * (max(1, part.prefetch_size) + 1) + outside)
        else:
            transient = max(transient, comp.param_bytes)
    return resident + transient


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (what the kernel can give without swapping); 0 where unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
