"""Random LoRA adapters for a tiny checkpoint, in diffusers' own format (`diffuserve make-tiny-lora`).

Made the way diffusers' training scripts make them: peft's `LoraConfig` added to the transformer with random
(not zero) B, the adapter's state dict taken with `get_peft_model_state_dict`, written by the pipeline class'
`save_lora_weights` (with the LoraConfig as metadata, so `load_lora_weights` reads alpha back). Fixed seed: the
same arguments write the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from diffuserve.errors import ConfigError
from diffuserve.lora.files import lora_loader

DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections every block of the native families has (FLUX.1 / .2, Qwen-Image, Z-Image, SD3,
SANA, Wan name them alike): what most published LoRAs adapt."""


def write_random_lora(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS,
    std: float = 0.2,
    component: str = "transformer",
) -> Path:
    """Write a random rank-`rank` adapter for the denoiser `component` of `checkpoint` into `output_dir` (saved
    by the family's `*LoraLoaderMixin`, keys `transformer.*` as diffusers saves any denoiser's); returns it.

    `std` is the spread of the random weights (B is random too, so the adapter changes the output); `alpha`
    defaults to the rank (scaling 1). `component="transformer_2"`: for Wan2.2 A14B's low-noise expert."""
    import json

    import diffusers
    import diffusers.loaders
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from diffuserve.family_spec import all_specs, family_from_class

    index = json.loads((Path(checkpoint) / "model_index.json").read_text())
    family = family_from_class(str(index.get("_class_name")))
    if family is None or component not in index:
        what = f"has no {component}" if family is not None else f"is a {index.get('_class_name')} checkpoint"
        raise ConfigError(f"make-tiny-lora: {checkpoint} {what}; give a tiny checkpoint of a family that takes LoRAs.")
    if all_specs()[family].lora_loader is None and hasattr(getattr(diffusers, index["_class_name"]), "lora_state_dict"):
        loader = getattr(diffusers, index["_class_name"])  # a diffusers-backend family whose pipeline reads LoRAs
    else:
        loader = getattr(diffusers.loaders, lora_loader(family))
    model_class = getattr(diffusers, index[component][1])
    transformer = model_class.from_pretrained(Path(checkpoint) / component)
    config = LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else rank, init_lora_weights=False, target_modules=list(targets)
    )
    torch.manual_seed(seed)
    transformer.add_adapter(config, adapter_name="default")
    state = get_peft_model_state_dict(transformer, adapter_name="default")
    generator = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=generator) * std for k, v in sorted(state.items())}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    loader.save_lora_weights(out, transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict())
    return out
