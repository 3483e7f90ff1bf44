"""Qwen-Image-Edit and Qwen-Image-Edit 2509/2511 (EditPlus) facts beyond the conformance suite
(test_family_conformance.py: diffusers parity with n outputs and with two images, and /v1/images/edits through
a real server with the official openai client).

Tolerance everywhere: exact (0/255 per pixel). Residency modes move the same weights without changing a kernel.
Cost: the pipelines resize every input to ~1024x1024 for the VAE (fixed in diffusers), ~1-2 s per input image,
so the residency plans compare with the suite's one resident run (`resident_run`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffuserve.errors import InvalidRequestError
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff
from tests.integration.family_conformance import BY_ID, RED
from tests.integration.family_references import resident_run

EDIT = SamplingParams(**dict(BY_ID["qwen-image-edit"].reference_params)["edit-n2"])
"""The suite's edit request (n=2): its resident run is shared with the suite's diffusers and server checks."""


@pytest.fixture(scope="module")
def edit_path(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen-image-edit")


def test_edit_plus_refuses_more_images_than_its_limit(tiny_checkpoint, family_pipeline) -> None:
    pipe = family_pipeline(tiny_checkpoint("qwen-image-edit-plus"))
    assert pipe.max_image_inputs == 3
    with pytest.raises(InvalidRequestError) as info:
        pipe.validate(SamplingParams(prompt="x", width=64, height=64, image_inputs=(RED,) * 4))
    assert info.value.param == "image"
    with pytest.raises(InvalidRequestError) as info:
        pipe.validate(SamplingParams(prompt="x", width=64, height=64))
    assert info.value.param == "image"


def test_tiny_checkpoint_names_the_real_processor_class(edit_path: Path, diffusers_pipeline) -> None:
    # Saved through the torchvision-free substitute, named as the real class, with the video processor entry
    # the real class reads back. (Byte-identical rebuild and size: the suite.)
    index = json.loads((edit_path / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    config = json.loads((edit_path / "processor" / "processor_config.json").read_text())
    assert config["processor_class"] == "Qwen2VLProcessor"
    assert config["video_processor"]["video_processor_type"] == "Qwen2VLVideoProcessor"
    # The system prompt of the template is exactly the 64 tokens the pipelines drop, as with the real tokenizer.
    pipe = diffusers_pipeline("QwenImageEditPipeline", edit_path)
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    assert len(pipe.processor.tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 64


RESIDENCY_PLANS = {
    # The DiT and the text encoder (Qwen2.5-VL with its vision tower) stream layer by layer.
    "layerwise": {
        "transformer": ("layerwise-offload", "dit"),
        "text_encoder": ("layerwise-offload", "text_encoder"),
        "vae": ("component-offload", "vae"),
    },
    "offload": {
        "transformer": ("component-offload", "dit"),
        "text_encoder": ("snapshot-offload", "text_encoder"),
        "vae": ("layerwise-offload", "vae"),
    },
}


@pytest.mark.parametrize("plan_name", list(RESIDENCY_PLANS))
def test_edit_residency_modes_reproduce_the_resident_output(edit_path: Path, family_pipeline, plan_name: str) -> None:
    from diffuserve.config.plan import ComponentPlan, DeploymentPlan, ResidencyMode
    from diffuserve.pipelines.base import AllResident
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.residency import build_residency

    edit_native = family_pipeline(edit_path)
    (reference,) = resident_run(edit_native, [EDIT])
    plans = {
        name: ComponentPlan(name=name, group=group, mode=ResidencyMode(mode))
        for name, (mode, group) in RESIDENCY_PLANS[plan_name].items()
    }
    ledger = TransferLedger()
    edit_native.residency = build_residency(
        DeploymentPlan(components=plans), edit_native.components, device="cpu", ledger=ledger
    )
    try:
        ledger.begin_window()
        images = edit_native.run([EDIT]).outputs[0].images
        moved = {m.component for m in ledger.window_summary().moves}
    finally:
        edit_native.residency.close()
        edit_native.residency = AllResident()
    assert len(images) == len(reference) and [im.size for im in images] == [im.size for im in reference]
    assert max_pixel_diff(images, reference) == 0
    assert moved == set(plans)  # every component was really offloaded and brought back
