"""Random LoRA adapters for a tiny checkpoint, in diffusers' own format (`diffuserve make-tiny-lora`).

Made the way diffusers' training scripts make them: peft's `LoraConfig` added to the transformer with random
(not zero) B, the adapter's state dict taken with `get_peft_model_state_dict`, written by the pipeline class'
`save_lora_weights` (with the LoraConfig as metadata, so `load_lora_weights` reads alpha back). Fixed seed: the
same arguments write the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from diffuserve.errors import ConfigError
from diffuserve.lora.files import LORA_LOADERS

DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections every FLUX block has: what most published FLUX LoRAs adapt."""


def write_random_lora(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS,
    std: float = 0.2,
) -> Path:
    """Write a random rank-`rank` adapter for the transformer of `checkpoint` into `output_dir`; returns it.

    `std` is the spread of the random weights (B is random too, so the adapter changes the output); `alpha`
    defaults to the rank (scaling 1)."""
    import json

    import diffusers
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    index = json.loads((Path(checkpoint) / "model_index.json").read_text())
    family = "flux" if index.get("_class_name") == "FluxPipeline" else None
    if family is None:
        raise ConfigError(
            f"make-tiny-lora: {checkpoint} is a {index.get('_class_name')} checkpoint; random "
            f"adapters are made for: {', '.join(sorted(LORA_LOADERS))}."
        )
    pipeline_class = getattr(diffusers, LORA_LOADERS[family])
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(Path(checkpoint) / "transformer")
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
    pipeline_class.save_lora_weights(
        out, transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict()
    )
    return out
