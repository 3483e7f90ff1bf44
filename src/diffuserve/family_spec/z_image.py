"""Z-Image and Z-Image-Turbo (Qwen3 encoder)."""

from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import (
    CheckpointConfigs,
    FamilySpec,
    GuidanceRule,
    LatentGeometry,
    ProfileFacts,
    SamplingDefaults,
    TextEncoderFacts,
)
from diffuserve.family_spec.checkpoint import square_default
from diffuserve.family_spec.components import autoencoder_kl_factor
from diffuserve.family_spec.request_rules import RequestRules, TokenCount, check_strength, no_crop

# The chat-templated prompt, max_sequence_length 512 (the adapter also caps it by the DiT's caption axis).


def z_image_geometry(configs: CheckpointConfigs) -> LatentGeometry:
    """diffusers calls the transformer with its default patch size 2: sizes divide by the VAE factor x 2."""
    return LatentGeometry(vae_factor=autoencoder_kl_factor(configs["vae"]), patch=2)


def z_image_max_latent_side(cfg: dict) -> tuple[int, int]:
    """RoPE tables: image token (row, col) indices index `axes_lens` 1 and 2 (the caption occupies indices 1..len,
    padded to 32, of axis 0 and the image frame the next one, so axis 0 bounds the text length instead); one token
    is a 2x2 latent patch."""
    axes = list(cfg["axes_lens"])
    return axes[1] * 2, axes[2] * 2


def z_image_defaults(
    defaults: SamplingDefaults, configs: CheckpointConfigs, geometry: LatentGeometry
) -> SamplingDefaults:
    """The size: the VAE's sample_size is the training resolution in pixels (1024 upstream; a tiny checkpoint's is
    its small native size), within the RoPE tables (`axes_lens` 1 and 2 index image rows and columns)."""
    axes = list(configs["transformer"]["axes_lens"])
    pixels = min(
        int(configs["vae"].get("sample_size") or 1024),
        axes[1] * geometry.size_multiple,
        axes[2] * geometry.size_multiple,
    )
    return square_default(defaults, geometry, pixels)


# Z-Image's timestep and caption embedders (diffusers: precision sensitive), patch embedders, the adaLN modulation and
# the final layers stay in the compute dtype.
Z_IMAGE_QUANT_KEEP = ("t_embedder.*", "cap_embedder.*", "all_x_embedder.*", "all_final_layer.*", "*adaLN_modulation*")


def check_z_image(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """Z-Image takes an input image only to inpaint it, without a crop; the strength."""
    if params.image_inputs and params.mask_input is None:
        raise InvalidRequestError(
            "Z-Image takes an input image only to inpaint it: send a mask with the image.", param="mask"
        )
    no_crop(params, "diffusers' ZImageInpaintPipeline has no crop")
    check_strength(params)


SPEC = FamilySpec(
    quant_keep=Z_IMAGE_QUANT_KEEP,
    name="z_image",
    guidance=GuidanceRule(scale_field="guidance_scale", runs_when="above_zero"),
    request_check=check_z_image,
    text_encoders=(TextEncoderFacts("tokenizer", "text_encoder (Qwen3)", 512),),
    pipeline_classes=("ZImagePipeline", "ZImageInpaintPipeline"),
    # Edits with a mask, as ZImageInpaintPipeline (pipelines/inpaint.py); an image without a mask is refused.
    # Edits of different strengths share a call: each row starts at its own step of the shared schedule.
    strength_per_row=True,
    tasks=frozenset({"t2i", "inpaint"}),
    max_image_inputs=1,
    model_id_patterns=(r"z[-_]?image",),
    native_adapter="diffuserve.families.z_image.adapter:ZImageAdapter",
    required_components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    lora_loader="ZImageLoraLoaderMixin",
    # Z-Image-Turbo samples without CFG in 8-9 steps; single-GPU no-offload measured faster than FSDP/SP.
    defaults=SamplingDefaults(num_inference_steps=9, guidance_scale=0.0),
    checkpoint_defaults=z_image_defaults,
    latent_geometry=z_image_geometry,
    max_latent_side=z_image_max_latent_side,
    # The native adapter streams the refiners and the main layers (tests: layer-wise equals resident).
    profile=ProfileFacts(default_uses_cfg=False, dit_supports_layerwise=True),
    # diffusers runs the positive and negative rows through one transformer call; the transformer pads the rows of
    # a call to a common length, so matching its batch composition keeps results bit-equal.
    cfg_batched=True,
    # Flow-match per request; masked text rows are padded per step like a merged batch (verified row by row).
    supports_continuous=True,
    # Its transformer takes images of any size as a list, padding and masking them itself (pipelines/packing.py).
    packs_mixed_sizes=True,
    text_encoder_keys=("text_encoder",),
    # In execution order: the image-token refiner, the caption refiner, then the main single-stream layers.
    layer_containers={
        "ZImageTransformer2DModel": (
            ("noise_refiner", "n_refiner_layers"),
            ("context_refiner", "n_refiner_layers"),
            ("layers", "n_layers"),
        )
    },
    tiny_builds={"z-image": "diffuserve.families.z_image.tiny:build"},
)
