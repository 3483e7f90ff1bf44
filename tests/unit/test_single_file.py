"""`--transformer-path` files read from their headers (models/single_file.py), and the test writers' K-quant packing
(tests/quant_files.py) checked against the `gguf` package's own dequantizers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffuserve.errors import ConfigError
from diffuserve.models.single_file import check_architecture, describe_file
from tests.quant_files import quantize, write_bfl, write_gguf


@pytest.mark.parametrize(("qtype", "max_error"), [("Q8_0", 0.01), ("Q6_K", 0.03), ("Q5_K", 0.06), ("Q4_K", 0.12)])
def test_k_quant_blocks_decode_with_gguf(qtype: str, max_error: float) -> None:
    import gguf

    weights = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    decoded = gguf.quants.dequantize(quantize(weights, qtype), gguf.GGMLQuantizationType[qtype])
    assert decoded.shape == weights.shape
    assert np.abs(decoded - weights).mean() / np.abs(weights).mean() < max_error


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "double_blocks.0.img_mlp.0.weight": torch.randn(64, 256, generator=g),
        "double_blocks.0.img_mlp.0.bias": torch.randn(64, generator=g),
        "img_in.weight": torch.randn(64, 16, generator=g),
    }


def test_a_gguf_header_gives_method_bytes_and_architecture(tmp_path: Path) -> None:
    types = write_gguf(tmp_path / "m.gguf", _weights(), "Q4_K", "flux")
    assert types == {
        "double_blocks.0.img_mlp.0.weight": "Q4_K",
        "double_blocks.0.img_mlp.0.bias": "F32",
        "img_in.weight": "F16",
    }
    info = describe_file(tmp_path / "m.gguf")
    assert (info.format, info.method, info.architecture) == ("gguf", "gguf:Q4_K", "flux")
    assert info.tensors["double_blocks.0.img_mlp.0.weight"].shape == (64, 256)
    # Q4_K: 144 bytes per 256 weights, kept; F32 / F16 tensors counted at the load dtype.
    assert info.loaded_bytes("bfloat16") == 64 * 144 + 64 * 2 + 64 * 16 * 2
    assert info.layers_bytes("bfloat16") == 64 * 144 + 64 * 2
    with pytest.raises(ConfigError, match="architecture 'flux'"):
        check_architecture(info, "wan")
    check_architecture(info, "flux2")  # FLUX.2 files may say flux: the tensor check decides


@pytest.mark.parametrize("kind", ["fp8r", "nvfp4"])
def test_a_bfl_file_is_recognised_by_its_scales(tmp_path: Path, kind: str) -> None:
    write_bfl(tmp_path / "m.safetensors", _weights(), kind)
    info = describe_file(tmp_path / "m.safetensors")
    assert (info.format, info.method) == ("bfl", f"bfl:{kind}")
    assert info.tensors["double_blocks.0.img_mlp.0.weight"].shape == (64, 256)  # NVFP4's [N, K/2] bytes are [N, K]
    packed = 64 * 256 // (2 if kind == "nvfp4" else 1)
    scales = 64 * 256 // 16 if kind == "nvfp4" else 64 * 4
    assert info.loaded_bytes("bfloat16") == packed + scales + (8 if kind == "nvfp4" else 0) + 64 * 2 + 64 * 16 * 2


def test_files_that_are_not_transformers_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with pytest.raises(ConfigError, match="--transformer-path.*not a file"):
        describe_file(tmp_path / "missing.gguf")
    (tmp_path / "junk").write_bytes(b"\x01" * 100)
    with pytest.raises(ConfigError, match="neither a GGUF nor a safetensors"):
        describe_file(tmp_path / "junk")
    save_file({"a.weight": torch.zeros(4, 4), "a.scale_weight": torch.ones(1)}, str(tmp_path / "comfy.safetensors"))
    with pytest.raises(ConfigError, match="scaled fp8"):
        describe_file(tmp_path / "comfy.safetensors")
    save_file({"a.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}, str(tmp_path / "plain.safetensors"))
    assert describe_file(tmp_path / "plain.safetensors").method == "bf16"
