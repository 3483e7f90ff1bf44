"""A `--transformer-path` GGUF / BFL transformer composes with what is served: merged rows, per-row LoRA, component
and layer-wise offload (the ledger moving the quantized bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffuserve.config.plan import ResidencyMode
from diffuserve.models.loader import load_pipeline
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff, with_residency
from tests.quant_files import original_layout, write_bfl, write_gguf

STEPS = 3


@pytest.fixture(scope="module")
def files(tiny_flux_path: Path, tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """kind -> (base folder, file): FLUX.1 in GGUF Q8_0, FLUX.2 Klein in NVFP4."""
    import diffusers

    root = tmp_path_factory.mktemp("compose-files")
    flux = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_path / "transformer").state_dict()
    write_gguf(root / "flux-q8.gguf", original_layout("flux", flux), "Q8_0", "flux")
    klein = tiny_checkpoint("flux2-klein")
    sd = diffusers.Flux2Transformer2DModel.from_pretrained(klein / "transformer").state_dict()
    write_bfl(root / "klein-nvfp4.safetensors", original_layout("flux2", sd), "nvfp4")
    return {"gguf": (tiny_flux_path, root / "flux-q8.gguf"), "nvfp4": (klein, root / "klein-nvfp4.safetensors")}


@pytest.fixture(scope="module")
def pipelines(files):
    loaded: dict[str, object] = {}

    def get(kind: str):
        if kind not in loaded:
            base, file = files[kind]
            loaded[kind] = load_pipeline(base, transformer_path=file)
        return loaded[kind]

    return get


def _params(seed: int, prompt: str, **kw) -> SamplingParams:
    return SamplingParams(prompt=prompt, seed=seed, num_inference_steps=STEPS, width=64, height=64, **kw)


def _images(pipe, batch: list[SamplingParams]) -> list:
    return [img for out in pipe.run(batch).outputs for img in out.images]


@pytest.mark.parametrize("kind", ["gguf", "nvfp4"])
def test_merged_rows_equal_singletons(kind, pipelines) -> None:
    pipe = pipelines(kind)
    a, b = _params(3, "a red cat"), _params(4, "a blue house", n=2)
    merged = _images(pipe, [a, b])
    alone = _images(pipe, [a]) + _images(pipe, [b])
    assert max_pixel_diff(merged, alone) <= 1


def _quantized_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("kind", ["gguf", "nvfp4"])
@pytest.mark.parametrize("mode", [ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.LAYERWISE_OFFLOAD])
def test_offload_equals_resident_and_moves_the_quantized_bytes(kind, mode, pipelines) -> None:
    pipe = pipelines(kind)
    params = _params(5, "a green tree")
    resident = _images(pipe, [params])
    packed = _quantized_bytes(pipe.adapter.transformer)
    offloaded, ledger = with_residency(pipe, {"transformer": mode}, lambda: _images(pipe, [params]))
    assert max_pixel_diff(offloaded, resident) == 0
    # What moved is the packed weights (uint8 GGUF blocks / E2M1 + scales), never a dequantized copy: one
    # component onload moves exactly the module's stored bytes; the layers streamed one by one sum to less.
    moved = ledger.totals()["transformer"]["h2d"]
    if mode is ResidencyMode.COMPONENT_OFFLOAD:
        assert moved > 0 and moved % packed == 0
    else:
        streamed = [m for m in ledger.moves() if m.direction == "h2d" and m.layer is not None]
        assert streamed
        for move in streamed:
            assert move.nbytes == _quantized_bytes(pipe.adapter.transformer.get_submodule(move.layer))
    layer = next(m for m in pipe.adapter.transformer.modules() if type(m).__name__ in ("GGUFLinear", "BFLNVFP4Linear"))
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() > 0  # put back, still packed


def test_lora_rows_over_a_gguf_transformer_equal_diffusers(files, tiny_flux_path: Path, tmp_path: Path) -> None:
    """Per-row adapters over GGUF layers: each row equals diffusers' LoRA over diffusers' GGUF loading, and
    a row without adapters in the same batch equals the base model alone."""
    import diffusers

    from diffuserve.lora.slots import install_lora
    from diffuserve.lora.tiny import write_random_lora

    base, file = files["gguf"]
    style = write_random_lora(tiny_flux_path, tmp_path / "style", rank=4, seed=1)
    pipe = load_pipeline(base, transformer_path=file)
    plain = _images(pipe, [_params(7, "a cat surfing")])
    install_lora(pipe, "flux", {"style": str(style)}, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    with_style = _params(7, "a cat surfing", lora=(("style", 1.0),))
    without = _params(7, "a cat surfing")
    mixed = _images(pipe, [with_style, without])
    assert max_pixel_diff(mixed[1:], plain) <= 1
    transformer = diffusers.FluxTransformer2DModel.from_single_file(
        str(file),
        config=str(base),
        subfolder="transformer",
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32),
        local_files_only=True,
    )
    reference = diffusers.FluxPipeline.from_pretrained(base, transformer=transformer, local_files_only=True)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(style), adapter_name="style")
    theirs = reference(
        with_style.prompt,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        guidance_scale=with_style.guidance_scale,
        generator=torch.Generator().manual_seed(7),
        max_sequence_length=reference.tokenizer_2.model_max_length,
    ).images
    assert max_pixel_diff(mixed[:1], theirs) <= 1
    assert max_pixel_diff(mixed[:1], plain) > 8  # the adapter really changed the row


def test_an_offloaded_gguf_layer_cannot_compute_and_comes_back_packed(pipelines) -> None:
    """runtime/weights.py swaps `.data` for a placeholder: the GGUFParameter (its quant_type) survives, and a
    forward without onload fails instead of computing on nothing."""
    from diffuserve.runtime.ledger import TransferLedger
    from diffuserve.runtime.weights import Transfers, WeightUnit, collect_slots

    layer = next(m for m in pipelines("gguf").adapter.transformer.modules() if type(m).__name__ == "GGUFLinear")
    before = layer.weight.as_tensor().clone()
    unit = WeightUnit(
        "transformer", None, list(collect_slots([layer]).values()), Transfers("cpu", TransferLedger()), keep_host=False
    )
    unit.capture()
    try:
        with pytest.raises(RuntimeError):
            layer(torch.randn(2, layer.in_features))
    finally:
        unit.load()
    assert type(layer.weight).__name__ == "GGUFParameter" and layer.weight.quant_type is not None
    assert torch.equal(layer.weight.as_tensor(), before)
