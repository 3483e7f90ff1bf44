"""`--quantization` on real tiny checkpoints, in-process (issue 28): quality against the unquantized image of the same
seed, and composition with LoRA, batching, step caches and residency, each against the same configuration
unquantized or the singleton run.

Bars: PSNR >= 30 dB against the unquantized image (fp8, int8, int8-dynamic on tiny FLUX.1, FLUX.2 Klein, Qwen-Image,
Z-Image, Wan and the 36M checkpoint at 256 px); the demo model's colour-and-shape accuracy within 2 points of
unquantized; a row in a merged batch (with its own adapters, its own step cache) equals the same request alone
(<= 1/255); offloaded equals resident; layer-wise offload streams <= 0.55x the bytes of the bf16 DiT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve import family_spec
from diffuserve.sampling import SamplingParams

METHODS = ("fp8", "int8", "int8-dynamic")


def _pixels(result) -> np.ndarray:
    out = result.outputs[0]
    frames = out.images if out.images else [f for video in out.videos for f in video]
    return np.stack([np.asarray(f.convert("RGB")).astype(np.float64) for f in frames])


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255**2 / mse)


def _max_diff(a, b) -> int:
    return int(np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).max())


@contextlib.contextmanager
def quantized(pipeline, method: str, component: str = "transformer") -> Iterator[object]:
    """The loaded pipeline with `component` quantized by `method` (the family's never-quantized list), put back to
    the very same unquantized modules afterwards: one load serves the reference and every method."""
    from diffuserve.quant.apply import quantize_components

    module = pipeline.components[component]
    before = {(p, n): c for p in module.modules() for n, c in p.named_children() if type(c) is torch.nn.Linear}
    keep = family_spec.spec_for(pipeline.family).quant_keep
    (report,) = quantize_components(pipeline.components, {component: (method, keep)}, "cpu")
    assert report.quantized > 0 and report.bytes_after < report.bytes_before
    try:
        yield report
    finally:
        for (parent, name), child in before.items():
            setattr(parent, name, child)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from diffuserve.models.tiny import build_tiny_checkpoint

    return {
        "flux": (tiny_flux_path, {}),
        "flux2-klein": (tiny_checkpoint("flux2-klein"), {}),
        "qwen-image": (tiny_checkpoint("qwen-image"), {}),
        "z-image": (tiny_checkpoint("z-image"), {}),
        "wan": (tiny_checkpoint("wan"), {}),
        "36m": (
            build_tiny_checkpoint("flux", tmp_path_factory.mktemp("ckpt") / "flux-36m", preset="36m"),
            {"width": 256, "height": 256, "num_inference_steps": 2},
        ),
    }


@pytest.mark.parametrize("model", ["flux", "flux2-klein", "qwen-image", "z-image", "wan", "36m"])
def test_quantized_images_stay_within_30_db_of_unquantized(checkpoints, family_pipeline, model: str) -> None:
    path, sizes = checkpoints[model]
    pipe = family_pipeline(path)
    params = SamplingParams(prompt="a red circle on a blue square", seed=3, **{"num_inference_steps": 3, **sizes})
    with torch.inference_mode():
        reference = _pixels(pipe.run([params]))
        for method in METHODS:
            with quantized(pipe, method):
                image = _pixels(pipe.run([params]))
            assert _psnr(image, reference) >= 30, (model, method, _psnr(image, reference))
        assert np.array_equal(_pixels(pipe.run([params])), reference)  # the unquantized modules are back


def test_demo_model_accuracy_within_two_points(family_pipeline) -> None:
    from diffuserve.demo import semantics
    from diffuserve.models.tiny import ensure_default_model

    pipe = family_pipeline(ensure_default_model())
    with torch.inference_mode():
        base = semantics.evaluate(pipe, seeds=(0, 1, 2), steps=4).rate("agrees")
        for method in METHODS:
            with quantized(pipe, method):
                rate = semantics.evaluate(pipe, seeds=(0, 1, 2), steps=4).rate("agrees")
            assert abs(rate - base) <= 0.02, (method, rate, base)


# --- composition ---------------------------------------------------------------------------------------------
def _request(seed: int, prompt: str, **kw) -> SamplingParams:
    return SamplingParams(prompt=prompt, seed=seed, num_inference_steps=3, **kw)


@pytest.fixture(scope="module")
def lora_pipeline(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """Tiny FLUX.1 with its DiT quantized int8-dynamic at load (the serving path) and two adapters over it."""
    from diffuserve.lora.slots import install_lora
    from diffuserve.lora.tiny import write_random_lora
    from diffuserve.models.loader import load_pipeline

    root = tmp_path_factory.mktemp("loras-quant")
    adapters = {
        "style": str(write_random_lora(tiny_flux_path, root / "style", rank=4, seed=1)),
        "mlp": str(write_random_lora(tiny_flux_path, root / "mlp", rank=2, seed=3, targets=("to_q", "proj_mlp"))),
    }
    keep = family_spec.spec_for("flux").quant_keep
    pipe = load_pipeline(tiny_flux_path, quantization={"transformer": ("int8-dynamic", keep)})
    install_lora(pipe, "flux", adapters, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    return pipe


def test_lora_rows_over_a_quantized_base_equal_their_solo_runs(lora_pipeline) -> None:
    """The adapters stay an unmerged fp32 side branch over the quantized layers (the hook wraps the quantized
    forward); rows with different adapters and rows with none share one call, each equal to its solo run."""
    from diffuserve.lora.layers import LORA_DOWN
    from diffuserve.quant.linear import QuantizedLinear

    to_q = lora_pipeline.components["transformer"].transformer_blocks[0].attn.to_q
    assert isinstance(to_q, QuantizedLinear) and to_q.weight.dtype == torch.int8
    assert to_q._buffers[LORA_DOWN].dtype == torch.float32
    batch = [
        _request(1, "a red house", lora=(("style", 1.0),)),
        _request(2, "a dog"),
        _request(3, "sea at night", lora=(("style", 0.5), ("mlp", 1.5)), n=2),
    ]
    with torch.inference_mode():
        merged = lora_pipeline.run(batch).outputs
        for params, out in zip(batch, merged, strict=True):
            alone = lora_pipeline.run([params]).outputs[0].images
            for a, b in zip(out.images, alone, strict=True):
                assert _max_diff(a, b) <= 1, params.lora
        plain = lora_pipeline.run([dataclasses.replace(batch[0], lora=())]).outputs[0].images[0]
    assert _max_diff(merged[0].images[0], plain) > 3, "the adapter changed nothing over the quantized base"


@pytest.mark.parametrize("method", METHODS)
def test_merged_rows_and_step_cache_rows_equal_singletons(family_pipeline, tiny_flux_path: Path, method) -> None:
    """Dynamic activation scales are per token, so a row's numbers do not depend on its batch neighbours: merged
    rows (dynamic batching, continuous steps, rows deciding their own step-cache reuse) equal the requests alone."""
    from diffuserve.config.step_cache import parse_step_cache

    def cached(params: SamplingParams, **options) -> SamplingParams:
        cache = parse_step_cache({"method": "fbcache", **options})
        return dataclasses.replace(params, num_inference_steps=8, step_cache=cache)

    from .family_checks import simulate_steps

    pipe = family_pipeline(tiny_flux_path)
    plain = [_request(1, "red house"), _request(2, "a dog", n=2), _request(3, "sea at night")]
    caches = [cached(plain[0], threshold=0.3), cached(plain[2], threshold=0.02), cached(_request(4, "a cat"))]
    with torch.inference_mode(), quantized(pipe, method):
        alone = {p: pipe.run([p]).outputs[0] for p in (*plain, *caches)}
        for batch in (plain, caches):
            merged = pipe.run(batch).outputs
            for params, out in zip(batch, merged, strict=True):
                assert alone[params].step_cache == out.step_cache
                for a, b in zip(out.images, alone[params].images, strict=True):
                    assert _max_diff(a, b) <= 1, (method, params.prompt)
        # Continuous batching: requests join a running denoise group at step boundaries.
        stepped = simulate_steps(pipe, {0: [plain[0]], 1: [plain[1], plain[2]]})
        for index, params in enumerate(plain):
            for a, b in zip(stepped[index], alone[params].images, strict=True):
                assert _max_diff(a, b) <= 1, (method, "continuous", params.prompt)


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_offload_equals_resident_and_streams_the_quantized_bytes(checkpoints, method: str) -> None:
    """Component and layer-wise offload of a quantized DiT equal it resident; layer-wise offload streams its
    quantized bytes (ledger), <= 0.55x of what the same DiT streams in bf16."""
    from diffuserve.config.plan import ResidencyMode
    from diffuserve.models.loader import load_pipeline

    from .family_checks import with_residency

    path = checkpoints["36m"][0]
    keep = family_spec.spec_for("flux").quant_keep
    params = _request(5, "a blue square", width=64, height=64)
    streamed = {}
    for label, quant in (("bf16", None), (method, {"transformer": (method, keep)})):
        pipe = load_pipeline(path, dtype="bfloat16", quantization=quant)
        with torch.inference_mode():
            resident = _pixels(pipe.run([params]))
            for mode in (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.LAYERWISE_OFFLOAD):
                run = functools.partial(pipe.run, [params])
                out, ledger = with_residency(pipe, {"transformer": mode}, lambda run=run: _pixels(run()))
                assert np.array_equal(out, resident), (label, mode)
        moves = [m for m in ledger.moves() if m.component == "transformer" and m.direction == "h2d" and m.layer]
        streamed[label] = sum(m.nbytes for m in moves) / params.num_inference_steps
    assert streamed[method] <= 0.55 * streamed["bf16"], streamed


# --- the server, the CLI and the diffusers backend ------------------------------------------------------------
def test_a_server_serves_quantized_components_and_says_which(tiny_flux_path: Path, tmp_path: Path) -> None:
    """`serve --quantization int8-dynamic text_encoder_2=int8`: /server_info shows each component's method, the log
    says what runs, and an image through the official client stays within 30 dB of the unquantized pipeline's."""
    import httpx
    import openai

    from diffuserve.models.loader import load_pipeline
    from tests.serverproc import ServerProcess

    from .helpers import decode_b64_png

    server = ServerProcess(
        ["--model-path", str(tiny_flux_path), "--quantization", "int8-dynamic", "text_encoder_2=int8"],
        tmp_path / "server.log",
    ).start()
    try:
        info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
        components = info["deployment_plan"]["components"]
        assert {n: c["quantization"] for n, c in components.items()} == {
            "text_encoder": None,
            "text_encoder_2": "int8",
            "transformer": "int8-dynamic",
            "vae": None,
        }, info
        assert "transformer: int8-dynamic on " in server.log() and "W8A8 (int8 GEMM" in server.log()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        result = client.images.generate(
            prompt="a red circle",
            size="64x64",
            response_format="b64_json",
            extra_body={"seed": 4, "num_inference_steps": 3},
        )
        served = np.asarray(decode_b64_png(result.data[0].b64_json).convert("RGB")).astype(np.float64)
    finally:
        server.stop()
    params = SamplingParams(prompt="a red circle", seed=4, num_inference_steps=3, width=64, height=64)
    with torch.inference_mode():
        plain = load_pipeline(tiny_flux_path).run([params]).outputs[0].images[0]
    assert _psnr(served, np.asarray(plain.convert("RGB")).astype(np.float64)) >= 30


def test_bad_quantization_exits_2_before_the_model_loads(tiny_flux_path: Path, cli_main) -> None:
    """`generate` and `plan` stop on a bad method or component naming the flag, before any weight loads (the other
    refusals' words: tests/unit/test_quantization_plan.py). `generate` in a real process (its output would
    show a load); `plan`, which never loads weights, in this one."""
    import subprocess
    import sys

    generate = ["-m", "diffuserve.cli", "generate", "--prompt", "x", "--quantization", "fp9"]
    out = subprocess.run(
        [sys.executable, *generate, "--model-path", str(tiny_flux_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert "--quantization: 'fp9' is not one of fp8, int8" in out.stderr and "Loading" not in out.stderr, out.stderr
    planned = cli_main("plan", "--quantization", "dit=fp8", "vae=int8", "--model-path", str(tiny_flux_path))
    assert planned.returncode == 2 and "vae (AutoencoderKL) cannot be quantized" in planned.stderr, planned.stderr


def test_diffusers_backend_quantizes_through_pipeline_quantization_config(family_pipeline, tiny_flux_path: Path):
    """`--backend diffusers`: the same methods through diffusers' `PipelineQuantizationConfig` (torchao), the family's
    kept modules named to it, a transformers text encoder with transformers' config; within 30 dB of unquantized."""
    from diffuserve.models.loader import load_pipeline

    keep = family_spec.spec_for("flux").quant_keep
    params = SamplingParams(prompt="a red circle", seed=3, num_inference_steps=3)
    with torch.inference_mode():
        reference = _pixels(family_pipeline(tiny_flux_path, "diffusers").run([params]))
        for method in METHODS:
            wanted = {"transformer": (method, keep), "text_encoder_2": (method, ())}
            pipe = load_pipeline(tiny_flux_path, backend="diffusers", quantization=wanted)
            dit = pipe.pipe.transformer
            assert type(dit.transformer_blocks[0].attn.to_q.weight).__name__ in ("Int8Tensor", "Float8Tensor")
            assert type(dit.x_embedder.weight) is torch.nn.Parameter  # the family keeps its embedder
            assert _psnr(_pixels(pipe.run([params])), reference) >= 30, method


def test_diffusers_backend_refuses_a_component_it_cannot_quantize(tmp_path: Path) -> None:
    from diffuserve.errors import ConfigError
    from diffuserve.quant.diffusers_config import pipeline_quantization_config

    (tmp_path / "model_index.json").write_text('{"_class_name": "XPipeline", "prior": ["my_lib", "Prior"]}')
    with pytest.raises(ConfigError, match="the diffusers backend's x_family pipeline cannot quantize prior"):
        pipeline_quantization_config(tmp_path, {"prior": ("int8", ())}, "x_family", torch.device("cpu"))
