"""One description of a checkpoint: `describe_checkpoint` on the folder's JSON (what `diffuserve plan` reads, no
weights) equals the facts the loaded native adapter bound (its spec applied to its modules' configs)."""

from __future__ import annotations

import pytest

from diffuserve import family_spec
from diffuserve.family_spec.checkpoint import describe_checkpoint, read_checkpoint_configs

NATIVE_TINY = sorted(
    name
    for name, spec in ((n, family_spec.spec_for(family_spec.family_of_tiny(n))) for n in family_spec.tiny_builds())
    # Diffusers-format checkpoints: describe_checkpoint reads their JSON configs. Hunyuan3D-2 comes
    # in Tencent's layout (config.yaml), which its own reader describes (test_hunyuan3d_*.py).
    if spec.has_native and spec.output_kind != "mesh"
)


@pytest.mark.parametrize("name", NATIVE_TINY)
def test_the_plan_and_the_adapter_describe_a_checkpoint_alike(name: str, tiny_checkpoint) -> None:
    from diffuserve.models.loader import load_pipeline

    path = tiny_checkpoint(name)
    pipeline = load_pipeline(path)
    spec = family_spec.spec_for(pipeline.family)
    planned = describe_checkpoint(spec, read_checkpoint_configs(path))
    assert pipeline.facts == planned
    # The adapter copies nothing: its settings are the spec's facts.
    assert pipeline.size_multiple == planned.size_multiple
    assert pipeline.supports_continuous is spec.supports_continuous
    assert pipeline.batched_cfg is spec.cfg_batched
    assert tuple(pipeline.adapter.text_encoders) == planned.text_encoders
    assert (pipeline.output_kind, pipeline.supports_batching, pipeline.max_image_inputs) == (
        spec.output_kind,
        spec.supports_batching,
        spec.max_image_inputs,
    )


def test_flux_schnell_is_a_pure_function_of_the_transformer_config() -> None:
    spec = family_spec.spec_for("flux")
    configs = {"vae": {"block_out_channels": [1, 2, 3, 4], "sample_size": 1024}, "transformer": {}}
    schnell = describe_checkpoint(spec, configs)
    dev = describe_checkpoint(spec, {**configs, "transformer": {"guidance_embeds": True}})
    assert (schnell.defaults.num_inference_steps, schnell.defaults.guidance_scale) == (4, 0.0)
    assert (dev.defaults.num_inference_steps, dev.defaults.guidance_scale) == (28, 3.5)
    assert schnell.size_multiple == dev.size_multiple == 16 and dev.defaults.width == 1024


def test_wan_size_multiple_is_the_vae_factor_times_the_patch() -> None:
    spec = family_spec.spec_for("wan")
    ti2v = describe_checkpoint(spec, {"vae": {"scale_factor_spatial": 16}, "transformer": {"patch_size": [1, 2, 2]}})
    wan21 = describe_checkpoint(spec, {"vae": {"scale_factor_spatial": 8}, "transformer": {"patch_size": [1, 2, 2]}})
    assert (ti2v.size_multiple, wan21.size_multiple) == (32, 16)
    assert wan21.max_width == wan21.max_height == 1024 * 2 * 8  # rope_max_seq_len (1024) patches of 2 px, VAE 8x
