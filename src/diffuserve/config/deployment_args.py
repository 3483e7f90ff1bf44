"""`DeploymentArgs`: every deployment flag (performance mode, residency, layer-wise offload, compile, GPUs and
parallelism), declared once. None (or an empty list) means "not set", so a performance mode may fill it; the
resolution from flags + hardware + model profile to a plan is `config/deployment.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffuserve.config.argparse_dataclass import flag
from diffuserve.config.plan import Lifetime, ResidencyMode
from diffuserve.errors import ConfigError

PERFORMANCE_MODES = ("manual", "auto", "speed", "memory")
RESIDENCY_MODES = tuple(m.value for m in ResidencyMode)
LIFETIMES = tuple(lt.value for lt in Lifetime)
_MODE_G = "Deployment: performance mode and residency"
_LAYER_G = "Deployment: layer-wise offload"
_COMPILE_G = "Deployment: compile and CUDA graphs"
_PAR_G = "Deployment: GPUs and parallelism"


@dataclass
class DeploymentArgs:
    """Every deployment flag; None (or an empty list) means "not set", so the mode may fill it."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve", "generate", "plan")
    """Every deployment flag is taken by `serve`, `generate` and `plan` (see argparse_dataclass.py)."""

    performance_mode: str = flag(
        "auto",
        "Preset: manual, auto, speed or memory. Explicit flags always win.",
        _MODE_G,
        choices=list(PERFORMANCE_MODES),
        aliases=["--mode"],
    )
    """manual | auto | speed | memory."""
    component_residency: list[str] = flag(
        [],
        "COMPONENT=MODE selectors; COMPONENT is a model_index.json key or dit, text_encoder, image_encoder, vae, all "
        "(or video_vae: a video model's VAE); "
        "MODE is resident, component-offload, snapshot-offload or layerwise-offload.",
        _MODE_G,
        nargs="+",
        metavar="COMPONENT=MODE",
    )
    """Canonical residency selectors (override only the legacy flags of the components they name)."""
    dit_cpu_offload: bool | None = flag(None, "Legacy: offload the DiT between uses (component offload).", _MODE_G)
    """Legacy DiT offload switch."""
    text_encoder_cpu_offload: bool | None = flag(None, "Legacy: offload the text encoders between uses.", _MODE_G)
    """Legacy text-encoder offload switch."""
    image_encoder_cpu_offload: bool | None = flag(None, "Legacy: offload the image encoder between uses.", _MODE_G)
    """Legacy image-encoder offload switch."""
    vae_cpu_offload: bool | None = flag(None, "Legacy: offload the VAE between uses.", _MODE_G)
    """Legacy VAE offload switch."""
    dit_layerwise_offload: bool | None = flag(None, "Legacy: stream the DiT layer by layer.", _LAYER_G)
    """Legacy DiT layer-wise switch."""
    layerwise_offload_components: str | None = flag(
        None,
        "Legacy: comma list of components or groups to stream layer by layer (e.g. dit,text_encoder,vae).",
        _LAYER_G,
        metavar="LIST",
    )
    """Comma list of keys/groups made layer-wise."""
    layerwise_resident_layers: list[str] = flag(
        [],
        "COMP=N: keep N layers (a count, or a ratio 0<r<1) of a layer-wise component on the device; COMP as in "
        "--component-residency (video_vae: a video model's VAE).",
        _LAYER_G,
        nargs="+",
        metavar="COMP=N",
    )
    """Resident layer sets of layer-wise components."""
    layerwise_residency_lifetime: list[str] = flag(
        [],
        "COMP=forward|permanent: forward places the resident set per run; permanent places it at load (must fit); "
        "COMP as in --component-residency (video_vae: a video model's VAE).",
        _LAYER_G,
        nargs="+",
        metavar="COMP=LIFETIME",
    )
    """Lifetime of each resident layer set."""
    dit_layerwise_residency_lifetime: str | None = flag(
        None, "Legacy: lifetime of the DiT's resident layer set.", _LAYER_G, choices=list(LIFETIMES)
    )
    """forward | permanent for the DiT (a canonical selector for the same component wins)."""
    dit_offload_prefetch_size: int | None = flag(
        None,
        "Layers in flight ahead of the computing one when streaming (0 means 1; default 1).",
        _LAYER_G,
        metavar="N",
    )
    """Prefetch depth of layer-wise streaming."""
    pin_cpu_memory: bool | None = flag(
        None, "Keep host copies of offloaded weights in pinned memory (CUDA only; default on with CUDA).", _LAYER_G
    )
    """Pinned host copies (ignored without CUDA)."""
    enable_torch_compile: bool | None = flag(
        None, "torch.compile the DiT (default off unless the family has a validated compile path).", _COMPILE_G
    )
    """torch.compile switch."""
    offload_during_compile: bool | None = flag(
        None, "Offload the DiT and evict other components during compile warm-up (default on).", _COMPILE_G
    )
    """Offload while compiling so max-autotune fits tighter GPUs."""
    enable_breakable_cuda_graph: bool | None = flag(
        None, "Capture breakable CUDA graphs for image pipelines (CUDA only; needs --warmup-resolutions).", _COMPILE_G
    )
    """Breakable CUDA graph switch."""
    warmup_resolutions: list[str] = flag(
        [], "Serving resolutions to warm up / capture, as WxH (e.g. 1024x1024).", _COMPILE_G, nargs="+", metavar="WxH"
    )
    """Resolutions warmed up at start-up."""
    num_gpus: int | None = flag(None, "GPUs (or ranks on a CPU host) to deploy on (default 1).", _PAR_G, metavar="N")
    """Number of selected devices; the smallest free memory among them decides."""
    use_fsdp_inference: bool | None = flag(
        None, "Shard the DiT over the GPUs with FSDP (auto turns it on only where it replaces DiT offload).", _PAR_G
    )
    """FSDP switch."""
    enable_cfg_parallel: bool | None = flag(None, "Split the positive/negative CFG branches over two GPUs.", _PAR_G)
    """CFG parallel switch."""
    ulysses_degree: int | None = flag(
        None,
        "Ulysses sequence-parallel degree: attention heads split over this many ranks, tokens exchanged all-to-all "
        "(default 1).",
        _PAR_G,
        metavar="N",
    )
    """Ulysses degree (must divide the DiT's attention heads)."""
    ring_degree: int | None = flag(
        None,
        "Ring sequence-parallel degree: key/value blocks passed around this many ranks (default 1).",
        _PAR_G,
        metavar="N",
    )
    """Ring-attention degree."""
    sp_degree: int | None = flag(
        None,
        "Sequence-parallel degree = --ulysses-degree x --ring-degree; given alone it runs as Ulysses (default 1).",
        _PAR_G,
        metavar="N",
    )
    """Total sequence-parallel degree."""
    tp_size: int | None = flag(
        None,
        "Tensor-parallel degree: the DiT's attention heads and MLPs split over this many ranks (default 1).",
        _PAR_G,
        metavar="N",
        aliases=["--tp-degree"],
    )
    """Tensor-parallel degree (`--tp-degree` is the older name)."""
    dp_size: int | None = flag(
        None,
        "Data-parallel replicas: --num-gpus is split into this many replicas of num_gpus/dp ranks behind the one "
        "endpoint; each batch goes to the least-loaded replica (default: 1, or the ranks no parallel degree uses).",
        _PAR_G,
        metavar="N",
    )
    """Data-parallel replicas."""


# -- flag helpers shared by the resolution modules ------------------------------------------------------------
def flag_param(flag: str) -> str:
    """ConfigError.param is the field name (`component_residency`), as in the rest of the config errors."""
    return flag.split()[0].lstrip("-").replace("-", "_")


def flag_name(name: str) -> str:
    """`dit_cpu_offload` -> `--dit-cpu-offload`."""
    return "--" + name.replace("_", "-")


def positive(flag: str, value: int | None, default: int = 1) -> int:
    """A count flag (degrees, GPUs): unset means `default`, else it must be at least 1."""
    if value is None:
        return default
    if value < 1:
        raise ConfigError(f"{flag} must be at least 1, got {value}.", param=flag_param(flag))
    return value
