"""The Hunyuan3D-2 family spec (read by the registry, the plan and `make-tiny`; no torch here)."""

from typing import Any

from diffuserve.errors import InvalidRequestError
from diffuserve.family_spec.base import FamilySpec, ProfileFacts, SamplingDefaults
from diffuserve.family_spec.request_rules import RequestRules, TokenCount

LICENSE_NOTE = (
    "Hunyuan3D-2 weights are under the Tencent Hunyuan 3D 2.0 Community License Agreement: not licensed "
    "in the European Union, the United Kingdom and South Korea, and a licensee above 1 million monthly "
    "active users (on 21 January 2025) must request a license from Tencent; see docs/families.md."
)
"""Said in the start-up log and the docs."""

# Hunyuan3D-2's input, timestep, condition and guidance embedders and the final layer stay in the compute dtype; the
# per-block modulation is quantized with per-row scales, as FLUX.1's.
HUNYUAN3D_QUANT_KEEP = ("latent_in", "time_in.*", "cond_in", "guidance_in.*", "final_layer.*")


def check_hunyuan3d(params: Any, rules: RequestRules, tokens: TokenCount | None = None) -> None:
    """A mesh request: exactly one image, and an octree resolution from 16 to the checkpoint's largest
    (`rules.facts`: `default_octree_resolution`, `max_octree_resolution`)."""
    if len(params.image_inputs) != 1:
        raise InvalidRequestError(
            f"a {rules.family} mesh request takes exactly one image; got {len(params.image_inputs)}.", param="image"
        )
    resolution = params.octree_resolution or rules.facts["default_octree_resolution"]
    largest = rules.facts["max_octree_resolution"]
    if not 16 <= resolution <= largest:
        raise InvalidRequestError(
            f"octree_resolution={resolution} must be between 16 and {largest}.", param="octree_resolution"
        )


SPEC = FamilySpec(
    quant_keep=HUNYUAN3D_QUANT_KEEP,
    name="hunyuan3d",
    request_check=check_hunyuan3d,
    # No diffusers pipeline class: the registry recognises the folder layout (family_spec/hunyuan3d_layout.py).
    pipeline_classes=(),
    model_id_patterns=(r"hunyuan3d",),
    output_kind="mesh",
    tasks=frozenset({"i2mesh"}),
    native_adapter="diffuserve.families.hunyuan3d.adapter:Hunyuan3DPipeline",
    # SGLang's (and the reference's flow-matching pipeline's) defaults.
    defaults=SamplingDefaults(width=64, height=64, num_inference_steps=50, guidance_scale=5.0),
    profile=ProfileFacts(default_uses_cfg=True),
    max_image_inputs=1,
    # Layer-wise offload streams the DiT's FLUX-style blocks, double then single (counted from the `model.` keys of
    # model.fp16.safetensors: this layout has no config.json); the DiT is the `model` component.
    layer_containers={"Hunyuan3DDiT": (("double_blocks", None), ("single_blocks", None))},
    tiny_builds={"hunyuan3d": "diffuserve.families.hunyuan3d.tiny:build_hunyuan3d"},
)
