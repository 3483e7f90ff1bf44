"""Per-request LoRA on the tiny FLUX checkpoint: random adapters in diffusers' format (`make-tiny-lora`), read
through diffusers' own loader, applied per row.

The bars (issue 20): a request alone with adapters equals diffusers' `FluxPipeline` after `load_lora_weights` +
`set_adapters(names, adapter_weights=...)` (<= 3/255 max, <= 0.5/255 mean), and a row in a merged batch of
requests with different adapters (and none) equals the same request alone (<= 1/255).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.errors import ConfigError
from diffuserve.sampling import SamplingParams

STEPS = 3


@pytest.fixture(scope="module")
def adapters(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three random adapters: rank 4 on the attention projections, rank 8 with alpha 4, and one that also
    adapts the feed-forward layers."""
    from diffuserve.lora.tiny import write_random_lora

    root = tmp_path_factory.mktemp("loras")
    return {
        "style": write_random_lora(tiny_flux_path, root / "style", rank=4, seed=1),
        "ink": write_random_lora(tiny_flux_path, root / "ink", rank=8, alpha=4, seed=2),
        "mlp": write_random_lora(
            tiny_flux_path, root / "mlp", rank=2, seed=3, targets=("to_q", "to_v", "proj_mlp", "proj_out", "ff.net.2")
        ),
    }


@pytest.fixture(scope="module")
def native(tiny_flux_path: Path, adapters: dict[str, Path]):
    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline

    pipe = load_pipeline(tiny_flux_path)
    install_lora(
        pipe,
        "flux",
        {k: str(v) for k, v in adapters.items()},
        max_loras=4,
        max_rank=8,
        device="cpu",
        dtype=torch.float32,
    )
    return pipe


@pytest.fixture(scope="module")
def reference(tiny_flux_path: Path, adapters: dict[str, Path]):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for name, path in adapters.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    return pipe


def _px(image) -> np.ndarray:
    return np.asarray(image).astype(np.int16)


def _diff(a, b) -> tuple[int, float]:
    d = np.abs(_px(a) - _px(b))
    return int(d.max()), float(d.mean())


def _params(lora: tuple[tuple[str, float], ...], seed: int = 7, prompt: str = "a cat surfing", **kw) -> SamplingParams:
    return SamplingParams(prompt=prompt, seed=seed, num_inference_steps=STEPS, lora=lora, **kw)


def _reference(reference, params: SamplingParams):
    names = [name for name, _ in params.lora]
    if names:
        reference.enable_lora()
        reference.set_adapters(names, adapter_weights=[scale for _, scale in params.lora])
    else:
        reference.disable_lora()
    kwargs = {}
    if params.cfg_enabled:
        kwargs = {"negative_prompt": params.negative_prompt, "true_cfg_scale": params.true_cfg_scale}
    return reference(
        params.prompt,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        generator=torch.Generator().manual_seed(params.seed),
        max_sequence_length=reference.tokenizer_2.model_max_length,
        **kwargs,
    ).images[0]


@pytest.mark.parametrize(
    "lora",
    [
        (("style", 1.0),),
        (("ink", 0.7),),
        (("style", 0.5), ("mlp", 1.5)),
        (("ink", -1.0), ("style", 0.8), ("mlp", 1.0)),
    ],
    ids=["one", "alpha", "two", "three-negative"],
)
def test_alone_matches_diffusers_set_adapters(native, reference, lora) -> None:
    params = _params(lora)
    ours = native.run([params]).outputs[0].images[0]
    worst, mean = _diff(ours, _reference(reference, params))
    assert worst <= 3 and mean <= 0.5, (worst, mean)
    base = native.run([_params(())]).outputs[0].images[0]
    assert _diff(ours, base)[0] > 3, "the adapter changed nothing: the test would not see a broken path"


def test_true_cfg_with_adapter_matches_diffusers(native, reference) -> None:
    params = _params((("style", 1.0),), negative_prompt="blurry", true_cfg_scale=3.0)
    worst, mean = _diff(native.run([params]).outputs[0].images[0], _reference(reference, params))
    assert worst <= 3 and mean <= 0.5, (worst, mean)


def test_without_adapters_equals_the_base_model(native, tiny_flux_path: Path) -> None:
    from diffuserve.models.loader import load_pipeline

    plain = load_pipeline(tiny_flux_path)
    params = _params((), seed=3)
    assert _diff(native.run([params]).outputs[0].images[0], plain.run([params]).outputs[0].images[0])[0] == 0


def test_rows_with_different_adapters_share_one_call(native) -> None:
    batch = [
        _params((("style", 1.0),), seed=1, prompt="red house"),
        _params((), seed=2, prompt="a dog"),
        _params((("ink", 0.5), ("mlp", 1.0)), seed=3, prompt="sea at night", n=2),
        _params((("style", 0.3),), seed=4, prompt="red house"),
    ]
    merged = native.run(batch).outputs
    for params, out in zip(batch, merged, strict=True):
        alone = native.run([params]).outputs[0].images
        for a, b in zip(out.images, alone, strict=True):
            assert _diff(a, b)[0] <= 1, params.lora


def test_continuous_rows_follow_their_adapters_as_the_group_changes(native) -> None:
    """A continuous group: a request with adapters, then two with other adapters (and none) joining after one
    step, one of them with fewer steps, so the rows of each call (and their slots) change from step to step."""
    from tests.integration.family_checks import simulate_steps

    a = _params((("style", 1.0),), seed=1, prompt="red house")
    b = _params((("ink", 0.5), ("mlp", 1.0)), seed=3, prompt="sea at night", n=2)
    c = dataclasses.replace(_params((), seed=2, prompt="a dog"), num_inference_steps=2)
    stepped = simulate_steps(native, {0: [a], 1: [b, c]})
    for index, params in enumerate([a, b, c]):
        for x, y in zip(stepped[index], native.run([params]).outputs[0].images, strict=True):
            assert _diff(x, y)[0] <= 1, params.lora


def test_batched_cfg_rows_keep_their_adapters(native) -> None:
    batch = [
        _params((("style", 1.0),), seed=1, negative_prompt="blurry", true_cfg_scale=3.0),
        _params((), seed=2, negative_prompt="blurry", true_cfg_scale=3.0),
    ]
    alone = [native.run([p]).outputs[0].images[0] for p in batch]
    native.batched_cfg = True
    try:
        merged = native.run(batch).outputs
    finally:
        native.batched_cfg = False
    for out, single in zip(merged, alone, strict=True):
        assert _diff(out.images[0], single)[0] <= 1


def test_a_mismatching_adapter_is_refused_naming_the_module(tiny_flux_path: Path, adapters, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from diffuserve.lora.files import read_adapter
    from diffuserve.models.loader import load_pipeline

    transformer = load_pipeline(tiny_flux_path).components["transformer"]
    state = load_file(adapters["style"] / "pytorch_lora_weights.safetensors")
    key = sorted(k for k in state if k.endswith("lora_A.weight"))[0]
    state[key] = torch.zeros(4, state[key].shape[1] + 1)
    (tmp_path / "bad").mkdir()
    save_file(state, tmp_path / "bad" / "pytorch_lora_weights.safetensors")
    module = key[len("transformer.") : -len(".lora_A.weight")]
    with pytest.raises(ConfigError, match=module.replace(".", r"\.")):
        read_adapter("bad", tmp_path / "bad", "flux", transformer, max_rank=16)
    with pytest.raises(ConfigError, match="--max-lora-rank"):
        read_adapter("ink", adapters["ink"], "flux", transformer, max_rank=4)


def test_a_kohya_file_goes_through_diffusers_converter(tiny_flux_path: Path, tmp_path: Path) -> None:
    """A community (kohya / sd-scripts) FLUX file: fused qkv, lora_down/lora_up, alpha; converted by diffusers."""
    from diffusers import FluxPipeline
    from safetensors.torch import save_file

    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline

    reference = FluxPipeline.from_pretrained(tiny_flux_path, local_files_only=True)
    reference.set_progress_bar_config(disable=True)
    inner = reference.transformer.transformer_blocks[0].attn.to_q.out_features
    rank, gen = 4, torch.Generator().manual_seed(5)
    state = {}
    for key, out in (("img_attn_qkv", 3 * inner), ("img_attn_proj", inner)):
        state[f"lora_unet_double_blocks_0_{key}.lora_down.weight"] = torch.randn(rank, inner, generator=gen) * 0.3
        state[f"lora_unet_double_blocks_0_{key}.lora_up.weight"] = torch.randn(out, rank, generator=gen) * 0.3
        state[f"lora_unet_double_blocks_0_{key}.alpha"] = torch.tensor(2.0)
    save_file(state, tmp_path / "kohya.safetensors")
    reference.load_lora_weights(str(tmp_path / "kohya.safetensors"), adapter_name="kohya")
    native = load_pipeline(tiny_flux_path)
    install_lora(
        native,
        "flux",
        {"kohya": str(tmp_path / "kohya.safetensors")},
        max_loras=1,
        max_rank=4,
        device="cpu",
        dtype=torch.float32,
    )
    params = _params((("kohya", 0.8),))
    ours = native.run([params]).outputs[0].images[0]
    worst, mean = _diff(ours, _reference(reference, params))
    assert worst <= 3 and mean <= 0.5, (worst, mean)
    assert _diff(ours, native.run([_params(())]).outputs[0].images[0])[0] > 3


def _joins(server) -> float:
    """Requests that joined a running continuous group so far (/metrics)."""
    from tests.integration.helpers import metric_value

    return metric_value(server.base_url, "diffuserve_continuous_joins_total")


def _two_row_steps(server) -> float:
    """Continuous denoising steps of exactly 2 rows so far (the step-rows histogram's buckets)."""
    from tests.integration.helpers import metric_reading

    read, name = metric_reading(server.base_url), "diffuserve_continuous_step_batch_rows_bucket"
    return read(name, {"le": "2.0"}) - read(name, {"le": "1.0"})  # one scrape: the anchor steps on meanwhile


def test_a_continuous_server_steps_rows_with_different_adapters(tiny_flux_path: Path, adapters, tmp_path: Path) -> None:
    """A real `--batching-mode continuous` server with adapters: a request with `ink` joins, mid-run, a running
    group whose anchor uses `style` (gated on /metrics), and equals the same request stepped
    alone by the same server after the anchor has gone."""
    import socket
    import time

    import openai

    from tests.integration.helpers import decode_b64_png, metric_value, pixels, wait_until
    from tests.serverproc import ServerProcess

    server = ServerProcess(
        ["--model-path", str(tiny_flux_path), "--served-model-name", "tiny-lora-continuous"]
        + ["--batching-mode", "continuous", "--batching-max-size", "4", "--enable-batching-metrics"]
        + ["--max-inference-steps", "5000", "--max-loras", "3", "--max-lora-rank", "8"]
        + ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())],
        tmp_path / "server.log",
    ).start(timeout_s=180)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    def generate(lora: tuple = ({"name": "ink", "scale": 0.7},)) -> np.ndarray:
        extra = {"seed": 4, "num_inference_steps": 3, "lora": list(lora)}
        result = client.images.generate(prompt="a dog", size="64x64", response_format="b64_json", extra_body=extra)
        return pixels(decode_b64_png(result.data[0].b64_json))

    try:
        body = b'{"prompt": "anchor", "seed": 9, "size": "64x64", "num_inference_steps": 5000, "lora": "style"}'
        anchor = socket.create_connection(("127.0.0.1", server.port))
        anchor.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        # The anchor steps alone (1 active row), then the joined request's 3 steps share the anchor's steps.
        rows = "diffuserve_continuous_active_rows"
        wait_until(lambda: metric_value(server.base_url, rows) == 1, "the anchor steps", timeout_s=120)
        joins, two_row = _joins(server), _two_row_steps(server)
        joined = generate()
        assert (_joins(server), _two_row_steps(server)) == (joins + 1, two_row + 3), "it joined the anchor's group"
        anchor.close()  # its client goes away: its row leaves at a step boundary (seen on the counter)
        deadline = time.monotonic() + 60
        while metric_value(server.base_url, "diffuserve_continuous_leaves_total", {"reason": "cancelled"}) < 1:
            assert time.monotonic() < deadline, "the anchor never left the group"
        alone, base = generate(), generate(())
    finally:
        server.stop()
    assert int(np.abs(joined.astype(np.int16) - alone.astype(np.int16)).max()) <= 1
    assert int(np.abs(joined.astype(np.int16) - base.astype(np.int16)).max()) > 3, "the adapter changed nothing"


def test_rows_with_their_own_adapters_and_step_caches_share_one_call(native) -> None:
    """LoRA composes with the step caches (issue 19): each row applies its own adapters and decides its own cache
    reuse inside the same call; each equals the same request alone, counts included (<= 1/255)."""
    from diffuserve.config.step_cache import parse_step_cache

    def cached(params: SamplingParams, method: str, **options) -> SamplingParams:
        return dataclasses.replace(
            params, num_inference_steps=8, step_cache=parse_step_cache({"method": method, **options})
        )

    batch = [
        cached(_params((("style", 1.0),), seed=1, prompt="red house"), "fbcache", threshold=0.3),
        cached(_params((("ink", 0.5),), seed=2, prompt="a dog"), "fbcache", threshold=0.02),
        cached(_params((), seed=3, prompt="sea at night"), "fbcache", threshold=0.12, max_cached_steps=1),
    ]
    merged = native.run(batch).outputs
    counts = [out.step_cache for out in merged]
    assert any(c["reused_steps"] > 0 for c in counts) and len({c["computed_steps"] for c in counts}) > 1, counts
    for params, out in zip(batch, merged, strict=True):
        alone = native.run([params]).outputs[0]
        assert alone.step_cache == out.step_cache
        assert _diff(out.images[0], alone.images[0])[0] <= 1, params.lora
