"""`--transformer-path` on the command line: what `plan` counts and shows, and bad input refused with exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from diffuserve import cli
from diffuserve.models.loader import load_pipeline
from tests.quant_files import original_layout, write_gguf


@pytest.fixture(scope="module")
def flux36m(tmp_path_factory) -> Path:
    from diffuserve.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("flux", tmp_path_factory.mktemp("ckpt") / "flux-36m", preset="36m")


@pytest.fixture(scope="module")
def gguf_36m(flux36m: Path, tmp_path_factory) -> dict[str, Path]:
    import diffusers

    root = tmp_path_factory.mktemp("gguf-36m")
    sd = diffusers.FluxTransformer2DModel.from_pretrained(flux36m / "transformer").state_dict()
    files = {}
    for kind in ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0"):
        files[kind] = root / f"flux-36m-{kind}.gguf"
        write_gguf(files[kind], original_layout("flux", sd), kind, "flux")
    return files


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _plan(capsys, base: Path, *flags: str) -> dict:
    code, out, err = _run(capsys, "plan", "--model-path", str(base), "--dtype", "bfloat16", "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_plan_counts_the_file_bytes_that_load(capsys, flux36m: Path, gguf_36m: dict[str, Path]) -> None:
    """The plan's transformer bytes are the file's (header only) and equal what the loaded module holds; resident
    DiT bytes against bf16 meet the goals (Q4_K <= 0.32x, Q8_0 <= 0.55x)."""
    bf16 = _plan(capsys, flux36m)["components"]["transformer"]
    assert bf16["quantization"] is None
    for kind, goal in (("Q8_0", 0.55), ("Q4_K", 0.32)):
        planned = _plan(capsys, flux36m, "--transformer-path", str(gguf_36m[kind]))["components"]["transformer"]
        assert planned["quantization"] == f"gguf:{kind}"
        module = load_pipeline(flux36m, transformer_path=gguf_36m[kind], dtype="bfloat16").adapter.transformer
        held = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        assert planned["weight_bytes"] == held
        assert held <= goal * bf16["weight_bytes"], (kind, held / bf16["weight_bytes"])
    code, out, _ = _run(capsys, "plan", "--model-path", str(flux36m), "--transformer-path", str(gguf_36m["Q4_K"]))
    assert code == 0 and "gguf:Q4_K" in out  # the table names the method


def test_auto_decides_from_the_quantized_bytes(capsys, flux36m, gguf_36m) -> None:
    """On a GPU where the bf16 DiT (69 MiB) does not fit comfortably, the Q4_K one (20 MiB) does: `auto` moves it
    whole instead of streaming it layer by layer. (FLUX's rule keeps a DiT resident only from 45 GiB free.)"""
    budget = ("--num-gpus", "1", "--gpu-memory-gib", "0.06")
    bf16 = _plan(capsys, flux36m, *budget)["components"]["transformer"]
    q4 = _plan(capsys, flux36m, *budget, "--transformer-path", str(gguf_36m["Q4_K"]))["components"]["transformer"]
    assert (bf16["mode"], q4["mode"]) == ("layerwise-offload", "component-offload")


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K", "Q4_0"])
def test_other_gguf_types_equal_diffusers_loading(flux36m: Path, gguf_36m: dict[str, Path], kind: str) -> None:
    """The other common types on the 36M FLUX (rows of 512 / 2048: every Linear takes the K-quant blocks)."""
    import diffusers

    from diffuserve.sampling import SamplingParams
    from tests.integration.family_checks import max_pixel_diff, row_generators

    native = load_pipeline(flux36m, transformer_path=gguf_36m[kind])
    params = SamplingParams(prompt="a red cat", width=64, height=64, num_inference_steps=2, seed=3, guidance_scale=3.5)
    ours = native.run([params]).outputs[0].images
    transformer = diffusers.FluxTransformer2DModel.from_single_file(
        str(gguf_36m[kind]),
        config=str(flux36m),
        subfolder="transformer",
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32),
        local_files_only=True,
    )
    pipe = diffusers.FluxPipeline.from_pretrained(flux36m, transformer=transformer, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        params.prompt,
        width=64,
        height=64,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=pipe.tokenizer_2.model_max_length,
        generator=row_generators(3, 1),
    ).images
    assert max_pixel_diff(ours, theirs) <= 1


# -- bad input: exit 2, naming the flag or the file ------------------------------------------------------------


def test_a_missing_or_foreign_file_exits_2(capsys, tiny_flux_path: Path, tmp_path: Path) -> None:
    code, _, err = _run(capsys, "plan", "--model-path", str(tiny_flux_path), "--transformer-path", str(tmp_path / "no"))
    assert code == 2 and "--transformer-path" in err and "cannot be read" in err
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 64)
    code, _, err = _run(capsys, "plan", "--model-path", str(tiny_flux_path), "--transformer-path", str(junk))
    assert code == 2 and "neither a GGUF nor a safetensors" in err


def test_a_gguf_file_of_another_architecture_exits_2_before_loading(capsys, tiny_checkpoint, tmp_path: Path) -> None:
    import diffusers

    wan = tiny_checkpoint("wan")
    sd = diffusers.WanTransformer3DModel.from_pretrained(wan / "transformer").state_dict()
    write_gguf(tmp_path / "wan.gguf", original_layout("wan", sd), "Q8_0", "wan")
    flags = ("--model-path", str(tiny_checkpoint("flux2-klein")), "--transformer-path", str(tmp_path / "wan.gguf"))
    code, _, err = _run(capsys, "plan", *flags)
    assert code == 2 and "architecture 'wan'" in err and "wan.gguf" in err


def test_a_file_that_does_not_fit_the_config_names_the_tensor(capsys, tiny_checkpoint, tmp_path: Path) -> None:
    import diffusers

    base = tiny_checkpoint("flux2-klein")
    sd = original_layout("flux2", diffusers.Flux2Transformer2DModel.from_pretrained(base / "transformer").state_dict())
    sd["double_blocks.0.img_attn.proj.weight"] = torch.zeros(32, 64)  # another width than the config's 32
    write_gguf(tmp_path / "wide.gguf", sd, "Q8_0", "flux2")
    argv = ["generate", "--model-path", str(base), "--transformer-path", str(tmp_path / "wide.gguf")]
    code, _, err = _run(capsys, *argv, "--prompt", "x", "--output-path", str(tmp_path / "out"))
    assert code == 2, err
    assert "transformer_blocks.0.attn.to_out.0.weight" in err and "[32, 64]" in err and "[32, 32]" in err


@pytest.mark.parametrize(
    ("method", "says"), [("modelopt", "compute only on CUDA"), ("no-such-method", "diffusers cannot load here")]
)
def test_a_quantized_folder_diffusers_cannot_load_exits_2(capsys, tiny_flux_path: Path, tmp_path: Path, method, says):
    folder = Path(shutil.copytree(tiny_flux_path, tmp_path / "quantized"))
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": method, "quant_type": "FP8"}
    config_path.write_text(json.dumps(config))
    argv = ["generate", "--model-path", str(folder), "--prompt", "x", "--output-path", str(tmp_path / "out")]
    code, _, err = _run(capsys, *argv)
    assert code == 2, err
    assert f"'{method}'" in err and says in err and str(config_path) in err


def test_a_server_over_a_gguf_file_says_its_method_and_serves(tiny_flux_path: Path, tmp_path: Path) -> None:
    """The start-up log and /server_info name the method; the official client gets an image."""
    import base64
    import io

    import diffusers
    import httpx
    import openai
    from PIL import Image

    from tests.serverproc import ServerProcess

    sd = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_path / "transformer").state_dict()
    write_gguf(tmp_path / "flux-q8.gguf", original_layout("flux", sd), "Q8_0", "flux")
    args = ["--model-path", str(tiny_flux_path), "--transformer-path", str(tmp_path / "flux-q8.gguf")]
    server = ServerProcess([*args, "--served-model-name", "tiny-gguf"], tmp_path / "server.log").start()
    try:
        info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
        transformer = info["deployment_plan"]["components"]["transformer"]
        assert transformer["quantization"] == "gguf:Q8_0" and transformer["weight_bytes"] > 0
        assert "transformer: gguf:Q8_0 from" in server.log() and "dequantized for its matmul" in server.log()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        result = client.images.generate(
            model="tiny-gguf", prompt="a red cat", size="64x64", response_format="b64_json", extra_body={"seed": 3}
        )
        image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
        assert image.size == (64, 64)
    finally:
        server.stop()


@pytest.mark.parametrize("flag", [("--tp-size", "2"), ("--use-fsdp-inference",)])
def test_sharding_a_quantized_file_is_refused_naming_the_flag(
    capsys, tiny_flux_path: Path, tmp_path: Path, flag
) -> None:
    import diffusers

    sd = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_path / "transformer").state_dict()
    write_gguf(tmp_path / "flux.gguf", original_layout("flux", sd), "Q8_0", "flux")
    argv = ["plan", "--model-path", str(tiny_flux_path), "--transformer-path", str(tmp_path / "flux.gguf")]
    code, _, err = _run(capsys, *argv, "--num-gpus", "2", "--gpu-memory-gib", "80", *flag)
    assert code == 2 and flag[0] in err and "cannot be sharded" in err


def test_the_base_folder_needs_no_transformer_weights(capsys, tiny_flux_path: Path, tmp_path: Path) -> None:
    """Users download the file and the base repo without its (large) transformer weights."""
    import diffusers

    sd = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_path / "transformer").state_dict()
    write_gguf(tmp_path / "flux.gguf", original_layout("flux", sd), "Q8_0", "flux")
    base = Path(shutil.copytree(tiny_flux_path, tmp_path / "base"))
    for weights in (base / "transformer").glob("*.safetensors"):
        weights.unlink()
    flags = ["--model-path", str(base), "--transformer-path", str(tmp_path / "flux.gguf")]
    assert _plan(capsys, base, *flags[2:])["components"]["transformer"]["weight_bytes"] > 0
    argv = ["generate", *flags, "--prompt", "a cat", "--num-inference-steps", "2", "--output-path", str(tmp_path / "o")]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert Path(out.strip().splitlines()[-1]).is_file()
