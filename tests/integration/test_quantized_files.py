"""`--transformer-path`: pre-quantized transformer files (GGUF, Black Forest Labs' fp8r / NVFP4) over a base folder.

Each file is written here from a tiny checkpoint's transformer in the original key layout (tests/quant_files.py).
Three references per file: diffusers' own loading of the same file (`from_single_file` with its quantizer) in the
family's diffusers pipeline, which the native pipeline must equal (<= 1/255); the unquantized native run of the same
seed, which the quantized one must stay close to (PSNR); and, for composition, the same pipeline resident / alone.
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.models.loader import load_pipeline
from diffuserve.models.single_file import describe_file
from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import max_pixel_diff, row_generators
from tests.integration.family_conformance import BY_ID
from tests.integration.family_references import Subject, outputs_of
from tests.quant_files import original_layout, write_bfl, write_gguf

FAMILIES = {
    # case id / tiny name: (family, transformer class, diffusers pipeline class, GGUF architecture)
    "flux": ("flux", "FluxTransformer2DModel", "FluxPipeline", "flux"),
    "flux2": ("flux2", "Flux2Transformer2DModel", "Flux2Pipeline", "flux2"),
    "flux2-klein": ("flux2_klein", "Flux2Transformer2DModel", "Flux2KleinPipeline", "flux2"),
    "qwen-image": ("qwen_image", "QwenImageTransformer2DModel", "QwenImagePipeline", "qwen_image"),
    "z-image": ("z_image", "ZImageTransformer2DModel", "ZImagePipeline", "lumina2"),
    "wan": ("wan", "WanTransformer3DModel", "WanPipeline", "wan"),
}
FLUX_PARAMS = {
    "prompt": "a red cat",
    "width": 64,
    "height": 64,
    "num_inference_steps": 3,
    "seed": 5,
    "guidance_scale": 3.5,
}
MIN_PSNR = {"Q8_0": 30.0, "Q4_K": 22.0}


def psnr(a: list, b: list) -> float:
    """PSNR in dB over every image / frame of two outputs of the same shapes."""
    fa = [np.asarray(f, dtype=np.float64) for item in a for f in (item if isinstance(item, list) else [item])]
    fb = [np.asarray(f, dtype=np.float64) for item in b for f in (item if isinstance(item, list) else [item])]
    mse = float(np.mean([np.mean((x - y) ** 2) for x, y in zip(fa, fb, strict=True)]))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


@pytest.fixture(scope="module")
def base_of(tiny_checkpoint, tiny_flux_path):
    return lambda name: tiny_flux_path if name == "flux" else tiny_checkpoint(name)


@pytest.fixture(scope="module")
def quant_file(base_of, tmp_path_factory):
    """`quant_file(name, kind)` -> a file of the tiny checkpoint's transformer: GGUF `Q8_0` / `Q4_K` / ... or BFL
    `fp8r` / `nvfp4`, written once per module."""
    import diffusers

    folder = tmp_path_factory.mktemp("quant-files")
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, kind: str) -> Path:
        if (name, kind) not in made:
            family, cls, _, arch = FAMILIES[name]
            module = getattr(diffusers, cls).from_pretrained(base_of(name) / "transformer")
            sd = original_layout(family, module.state_dict())
            if kind in ("fp8r", "nvfp4"):
                path = folder / f"{name}-{kind}.safetensors"
                assert write_bfl(path, sd, kind) > 0
            else:
                path = folder / f"{name}-{kind}.gguf"
                write_gguf(path, sd, kind, arch)
            made[name, kind] = path
        return made[name, kind]

    return get


def params_for(name: str, native) -> SamplingParams:
    if name == "flux":
        return SamplingParams(**FLUX_PARAMS)
    case = BY_ID[name]
    return case.build_params(native, dict(case.reference_params)[case.reference_params[0][0]])


def diffusers_reference(name: str, base: Path, file: Path, kind: str, native, params: SamplingParams) -> list:
    """The family's diffusers pipeline around diffusers' own single-file loading of `file`."""
    import diffusers

    family, cls, pipe_cls, _ = FAMILIES[name]
    quantization = (
        diffusers.BFLQuantizationConfig(compute_dtype=torch.float32)
        if kind in ("fp8r", "nvfp4")
        else diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32)
    )
    transformer = getattr(diffusers, cls).from_single_file(
        str(file), config=str(base), subfolder="transformer", quantization_config=quantization, local_files_only=True
    )
    pipe = getattr(diffusers, pipe_cls).from_pretrained(base, transformer=transformer, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if name == "flux":
        return pipe(
            params.prompt,
            width=params.width,
            height=params.height,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            max_sequence_length=pipe.tokenizer_2.model_max_length,  # as the native FLUX adapter declares it
            generator=row_generators(params.seed, params.n),
        ).images
    # The conformance suite's reference call, on modules diffusers loaded (its "same modules" references read them
    # from `native`: hand them this pipeline's).
    parts = types.SimpleNamespace(**pipe.components, is_distilled=getattr(native.adapter, "is_distilled", None))
    shim = types.SimpleNamespace(adapter=parts, family=family)
    subject = Subject(shim, base, lambda _cls, _path: pipe)
    return BY_ID[name].reference(subject, params)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "flux2"])  # FLUX.2's transformer: Klein covers it
def test_gguf_native_equals_diffusers_and_stays_close(name, kind, base_of, quant_file) -> None:
    base, file = base_of(name), quant_file(name, kind)
    native = load_pipeline(base, transformer_path=file)
    layer = next(m for m in native.adapter.transformer.modules() if type(m).__name__ == "GGUFLinear")
    assert isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.uint8  # stays packed in memory
    params = params_for(name, native)
    ours = outputs_of(native, native.run([params]).outputs[0])
    theirs = diffusers_reference(name, base, file, kind, native, params)
    assert max_pixel_diff(ours, theirs) <= 1
    plain = load_pipeline(base)
    unquantized = outputs_of(plain, plain.run([params]).outputs[0])
    assert psnr(ours, unquantized) >= MIN_PSNR[kind]


@pytest.mark.parametrize("kind", ["fp8r", "nvfp4"])
@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_bfl_flux2_native_equals_diffusers(name, kind, base_of, quant_file) -> None:
    """The FLUX.2-dev-NVFP4 row on a CPU (tiny FLUX.2-dev and Klein): BFL's layout, each layer dequantized for its
    matmul."""
    base, file = base_of(name), quant_file(name, kind)
    native = load_pipeline(base, transformer_path=file)
    expected = "BFLNVFP4Linear" if kind == "nvfp4" else "BFLFP8RLinear"
    assert any(type(m).__name__ == expected for m in native.adapter.transformer.modules())
    held = sum(
        t.numel() * t.element_size()
        for t in [*native.adapter.transformer.parameters(), *native.adapter.transformer.buffers()]
    )
    assert describe_file(file).loaded_bytes("float32") == held  # what the plan counts is what loads
    params = params_for(name, native)
    ours = outputs_of(native, native.run([params]).outputs[0])
    assert max_pixel_diff(ours, diffusers_reference(name, base, file, kind, native, params)) <= 1


def test_the_diffusers_backend_takes_the_file_too(base_of, quant_file) -> None:
    base, file = base_of("flux"), quant_file("flux", "Q8_0")
    backend = load_pipeline(base, backend="diffusers", transformer_path=file)
    assert any(type(m).__name__ == "GGUFLinear" for m in backend.pipe.transformer.modules())
    native = load_pipeline(base, transformer_path=file)
    params = SamplingParams(**FLUX_PARAMS)
    ours = outputs_of(backend, backend.run([params]).outputs[0])
    assert max_pixel_diff(ours, outputs_of(native, native.run([params]).outputs[0])) <= 1


def test_a_torchao_quantized_folder_loads_with_model_path_alone(tiny_flux_path: Path, tmp_path: Path, capsys) -> None:
    """A diffusers folder whose transformer config carries a torchao quantization_config: loaded as diffusers
    loads it (equal images), named `torchao` in the plan, counted at its stored size."""
    import json
    import shutil

    import diffusers
    from torchao.quantization import Int8WeightOnlyConfig

    from diffuserve import cli

    folder = Path(shutil.copytree(tiny_flux_path, tmp_path / "flux-int8"))
    shutil.rmtree(folder / "transformer")
    quantized = diffusers.FluxTransformer2DModel.from_pretrained(
        tiny_flux_path / "transformer", quantization_config=diffusers.TorchAoConfig(Int8WeightOnlyConfig())
    )
    quantized.save_pretrained(folder / "transformer", safe_serialization=False)  # torchao's tensors pickle only
    native = load_pipeline(folder)
    assert type(native.adapter.transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
    params = SamplingParams(**FLUX_PARAMS)
    ours = outputs_of(native, native.run([params]).outputs[0])
    reference = diffusers.FluxPipeline.from_pretrained(folder, local_files_only=True)
    reference.set_progress_bar_config(disable=True)
    theirs = reference(
        params.prompt,
        width=params.width,
        height=params.height,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        max_sequence_length=reference.tokenizer_2.model_max_length,
        generator=row_generators(params.seed, params.n),
    ).images
    assert max_pixel_diff(ours, theirs) <= 1
    assert cli.main(["plan", "--model-path", str(folder), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["components"]["transformer"]
    assert planned["quantization"] == "torchao"
    assert planned["weight_bytes"] == (folder / "transformer" / "diffusion_pytorch_model.bin").stat().st_size
