"""`--quantization` in the plan (pure, no weights): the selector grammar and its errors, what each family keeps in
high precision, the quantized bytes counted from safetensors headers, and `auto` residency deciding from them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from diffuserve.config.deployment_args import DeploymentArgs
from diffuserve.config.model_profiles import profile_from_checkpoint
from diffuserve.config.quant_args import QuantArgs
from diffuserve.config.quantization import keeps, plan_quantization, resolve_quantization
from diffuserve.errors import ConfigError

GIB = 2**30


def _header_only(path: Path, tensors: dict[str, tuple[list[int], str]]) -> None:
    """A safetensors file whose header declares `tensors` (shape, dtype) without their data: the plan reads headers
    only, so a 24 GiB DiT costs a few bytes here."""
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        size = {"BF16": 2, "F32": 4}[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


@pytest.fixture(scope="module")
def big_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FLUX.1-shaped checkpoint of headers: a ~22 GiB bf16 DiT (one huge Linear per block, an embedder the family
    keeps), a T5 with its embedding table, a VAE."""
    root = tmp_path_factory.mktemp("bigflux")
    index = {
        "_class_name": "FluxPipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "scheduler").mkdir()
    for name, cfg in {
        "transformer": {"_class_name": "FluxTransformer2DModel", "num_layers": 2, "num_single_layers": 0},
        "text_encoder_2": {"architectures": ["T5EncoderModel"], "num_layers": 1},
        "vae": {"_class_name": "AutoencoderKL", "block_out_channels": [4, 8]},
    }.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    dit = {f"transformer_blocks.{i}.ff.net.2.weight": ([60000, 100000], "BF16") for i in range(2)}
    dit |= {f"transformer_blocks.{i}.ff.net.2.bias": ([60000], "BF16") for i in range(2)}
    dit |= {
        "x_embedder.weight": ([3072, 64], "BF16"),
        "transformer_blocks.0.norm1.linear.weight": ([18432, 3072], "BF16"),
    }
    _header_only(root / "transformer" / "diffusion_pytorch_model.safetensors", dit)
    t5 = {
        "shared.weight": ([32128, 4096], "BF16"),
        "encoder.block.0.layer.0.SelfAttention.q.weight": ([4096, 4096], "BF16"),
    }
    _header_only(root / "text_encoder_2" / "model.safetensors", t5)
    _header_only(
        root / "vae" / "diffusion_pytorch_model.safetensors", {"decoder.conv_out.weight": ([3, 128, 3, 3], "F32")}
    )
    return root


def _resolve(root: Path, items: list[str], device_kind: str = "cuda", ignored: list[str] | None = None):
    profile = profile_from_checkpoint(root, load_dtype="bfloat16")
    return resolve_quantization(QuantArgs(items, ignored or []), profile, device_kind)


def test_selectors_share_the_residency_grammar(big_flux: Path) -> None:
    assert _resolve(big_flux, ["fp8"]).components.keys() == {"transformer"}  # a bare method is the denoiser
    plan = _resolve(big_flux, ["all=int8", "dit=int8-dynamic"])
    assert {n: q.method for n, q in plan.components.items()} == {
        "transformer": "int8-dynamic",
        "text_encoder_2": "int8",
    }
    assert any("vae: not quantized" in line for line in plan.trace)  # `all` passes over the VAE
    assert _resolve(big_flux, ["all=int8", "text_encoder=none"]).components.keys() == {"transformer"}
    # The family's never-quantized list, then the user's patterns, for the DiT; the user's only for an encoder.
    plan = _resolve(big_flux, ["all=fp8"], ignored=["*.q"])
    assert plan.components["transformer"].keep[-1] == "*.q" and "x_embedder" in plan.components["transformer"].keep
    assert plan.components["text_encoder_2"].keep == ("*.q",)


@pytest.mark.parametrize(
    ("items", "device_kind", "words"),
    [
        (["fp9"], "cuda", "--quantization: 'fp9' is not one of fp8, int8, int8-dynamic, none. Did you mean 'fp8'?"),
        (["transfomer=int8"], "cuda", "unknown component or group 'transfomer'. Did you mean 'transformer'?"),
        (["vae=int8"], "cuda", "vae (AutoencoderKL) cannot be quantized"),
        (["int8-dynamic"], "mps", "int8-dynamic needs kernels this mps device does not have"),
        (["transformer"], "cuda", "'transformer' is not one of"),
    ],
)
def test_bad_input_names_the_flag(big_flux: Path, items: list[str], device_kind: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _resolve(big_flux, items, device_kind)
    assert words in err.value.message and err.value.param == "quantization"
    if "unknown component" in words:  # the residency selectors' list of what exists, word for word
        assert "This model's components: text_encoder_2, transformer, vae." in err.value.message


def test_plan_counts_quantized_bytes_weights_plus_scales(big_flux: Path) -> None:
    profile = profile_from_checkpoint(big_flux, load_dtype="bfloat16")
    quant, quantized = plan_quantization(QuantArgs(["all=fp8"]), profile, "cuda", big_flux, "bfloat16")
    dit, before = quantized.components["transformer"], profile.components["transformer"]
    big = 2 * (60000 * 100000 + 60000 * 4)  # the two FFN weights: one byte each plus an fp32 scale per row
    big += 18432 * 3072 + 18432 * 4  # the block's AdaLN projection is quantized too
    kept = 2 * 3072 * 64 + 2 * 2 * 60000  # the embedder and the biases, in bf16
    assert dit.param_bytes == big + kept and dit.unquantized_bytes == before.param_bytes
    assert dit.param_bytes <= 0.55 * before.param_bytes
    assert dit.layers_bytes < before.layers_bytes and dit.num_layers == before.num_layers
    t5 = quantized.components["text_encoder_2"]
    assert t5.param_bytes == 2 * 32128 * 4096 + 4096 * 4096 + 4096 * 4  # the embedding table is no Linear
    assert quantized.components["vae"] == profile.components["vae"]


def test_auto_keeps_a_dit_resident_in_fp8_that_bf16_offloads(big_flux: Path, capsys: pytest.CaptureFixture) -> None:
    """`plan --gpu-memory-gib 40`: the bf16 DiT (~22 GiB, below FLUX's 45 GiB resident bar) is offloaded; in fp8 it
    saves ~11 GiB, the bar drops by as much and the DiT stays resident; the table and JSON show each method."""
    from diffuserve.plan_command import print_plan

    base = {"model_path": str(big_flux), "gpu_memory_gib": 40.0, "json": True}
    print_plan(base)
    bf16 = json.loads(capsys.readouterr().out)
    print_plan({**base, "quantization": ["fp8"]})
    fp8 = json.loads(capsys.readouterr().out)
    assert bf16["components"]["transformer"]["mode"] == "component-offload"
    assert fp8["components"]["transformer"]["mode"] == "resident"
    assert fp8["components"]["transformer"]["quantization"] == "fp8"
    assert bf16["components"]["transformer"]["quantization"] is None
    assert any("quantization saves -> resident" in line for line in fp8["trace"])
    print_plan({**base, "json": False, "quantization": ["transformer=int8", "text_encoder_2=int8"]})
    table = capsys.readouterr().out
    assert "quantization" in table.splitlines()[1]
    assert [line.split()[-1] for line in table.splitlines()[2:5]] == ["int8", "int8", "-"]


def test_plan_and_start_up_refuse_with_the_same_words(big_flux: Path) -> None:
    from diffuserve.config.server_args import ServerArgs
    from diffuserve.launch.setup import plan_deployment
    from diffuserve.plan_command import print_plan

    with pytest.raises(ConfigError) as planned:
        print_plan({"model_path": str(big_flux), "gpu_memory_gib": 80.0, "quantization": ["vae=fp8"]})
    args = ServerArgs(model_path=str(big_flux), quantization=["vae=fp8"], deployment=DeploymentArgs())
    with pytest.raises(ConfigError) as started:
        plan_deployment(args, big_flux, "cpu", log_plan=False)
    assert planned.value.message == started.value.message


def test_every_native_family_declares_what_it_keeps() -> None:
    from diffuserve import family_spec

    for name, spec in family_spec.all_specs().items():
        if spec.has_native:
            assert spec.quant_keep, name
    flux = family_spec.spec_for("flux").quant_keep
    assert keeps("time_text_embed.timestep_embedder.linear_1", flux) and keeps("proj_out", flux)
    assert not keeps("single_transformer_blocks.0.proj_out", flux) and not keeps("transformer_blocks.0.attn.to_q", flux)


def test_tensor_parallel_and_fsdp_plan_a_quantized_dit(big_flux: Path, capsys) -> None:
    """TP and FSDP take a quantized DiT (the sharded forward is tested over two ranks in
    tests/distributed/test_quant_parallel.py): the plan resolves and names the method."""
    from diffuserve.plan_command import print_plan

    base = {"model_path": str(big_flux), "gpu_memory_gib": 80.0, "num_gpus": 2, "quantization": ["fp8"]}
    for flag, value in (("tp_size", 2), ("use_fsdp_inference", True)):
        print_plan({**base, flag: value})
        assert "fp8" in capsys.readouterr().out
