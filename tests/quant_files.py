"""Test-only writers of pre-quantized transformer files, as users download them (GGUF, BFL fp8r / NVFP4).

A tiny diffusers checkpoint's transformer is put back into the original (BFL / ComfyUI / Wan) key layout by
inverting diffusers' single-file conversion (`diffusers/loaders/single_file_utils.py`), then quantized with the
formats' own helpers: `gguf.quants` for Q8_0 / Q4_0 and `GGUFWriter`; diffusers' `quantize_fp8r` /
`quantize_nvfp4`. gguf 0.19 only dequantizes the K-quants, so `quantize_k` below packs Q4_K / Q5_K / Q6_K blocks
as llama.cpp lays them out (checked against `gguf.quants.dequantize`).

FLUX.1 stays in diffusers' layout: diffusers' FLUX.1 converter hard-codes the real model's widths (3072 / 12288
in `convert_flux_transformer_checkpoint_to_diffusers`), so a tiny FLUX.1 in the original layout cannot convert;
diffusers loads a file already in its own layout without conversion. Qwen-Image's converter is the identity.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

QK_K = 256


# -- original key layouts --------------------------------------------------------------------------------------


def _flux2_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renames = {
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin",
        "proj_out": "final_layer.linear",
    }
    double = {
        "attn.norm_q": "img_attn.norm.query_norm",
        "attn.norm_k": "img_attn.norm.key_norm",
        "attn.to_out.0": "img_attn.proj",
        "ff.linear_in": "img_mlp.0",
        "ff.linear_out": "img_mlp.2",
        "attn.norm_added_q": "txt_attn.norm.query_norm",
        "attn.norm_added_k": "txt_attn.norm.key_norm",
        "attn.to_add_out": "txt_attn.proj",
        "ff_context.linear_in": "txt_mlp.0",
        "ff_context.linear_out": "txt_mlp.2",
    }
    single = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm"}
    single["attn.norm_k"] = "norm.key_norm"
    out: dict[str, torch.Tensor] = {}
    qkv = {"attn.to_": "img_attn.qkv", "attn.add_": "txt_attn.qkv"}
    for key, value in sd.items():
        module, param = key.rsplit(".", 1)
        if key.startswith("norm_out.linear."):
            shift_scale = torch.cat(list(reversed(value.chunk(2, dim=0))), dim=0)
            out[f"final_layer.adaLN_modulation.1.{param}"] = shift_scale
            continue
        for prefix, table, new in (
            ("transformer_blocks.", double, "double_blocks."),
            ("single_transformer_blocks.", single, "single_blocks."),
        ):
            if not module.startswith(prefix):
                continue
            index, inner = module[len(prefix) :].split(".", 1)
            if inner in table:
                name = table[inner]
                out[f"{new}{index}.{name}.{'scale' if name.endswith('_norm') else param}"] = value
            elif inner.endswith(("to_q", "add_q_proj")):
                stem = "attn.to_" if inner == "attn.to_q" else "attn.add_"
                parts = [sd[f"{module[: -len(inner)]}{stem}{p}.{param}"] for p in _qkv_names(stem)]
                out[f"{new}{index}.{qkv[stem]}.{param}"] = torch.cat(parts, dim=0)
            break
        else:
            for diffusers_name, original in renames.items():
                if module == diffusers_name:
                    module = original
            out[f"{module}.{param}"] = value
    return out


def _qkv_names(stem: str) -> tuple[str, ...]:
    return ("q", "k", "v") if stem == "attn.to_" else ("q_proj", "k_proj", "v_proj")


def _z_image_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            continue
        if key.endswith(".attention.to_q.weight"):
            stem = key[: -len("to_q.weight")]
            out[stem + "qkv.weight"] = torch.cat([sd[stem + f"to_{p}.weight"] for p in "qkv"], dim=0)
            continue
        key = key.replace("all_final_layer.2-1.", "final_layer.").replace("all_x_embedder.2-1.", "x_embedder.")
        key = key.replace(".attention.to_out.0.", ".attention.out.")
        key = key.replace(".attention.norm_k.", ".attention.k_norm.").replace(
            ".attention.norm_q.", ".attention.q_norm."
        )
        out[key] = value
    return out


_WAN = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"),
    ("attn1", "self_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."),
    (".norm_added_k.", ".norm_k_img."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
)


def _wan_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        for new, old in _WAN:
            key = key.replace(new, old)
        key = key.replace("norm2", "norm__swap").replace("norm3", "norm2").replace("norm__swap", "norm3")
        if key == "scale_shift_table":
            key = "head.modulation"
        elif key.endswith(".scale_shift_table"):
            key = key[: -len("scale_shift_table")] + "modulation"
        out[key] = value
    return out


ORIGINAL_LAYOUT = {"flux2": _flux2_original, "z_image": _z_image_original, "wan": _wan_original}


def original_layout(family: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` (a diffusers transformer state dict) in the layout community single files use."""
    base = family.split("_klein")[0].split("_i2v")[0]
    return ORIGINAL_LAYOUT.get(base, dict)(sd)


# -- K-quant block packing (llama.cpp's layout) -------------------------------------------------------------------


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> the 12 bytes `gguf.quants.Q4_K.get_scale_min` unpacks."""
    d_bytes = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    m_bytes = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    m_d = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d_bytes, m_bytes, m_d], axis=1).astype(np.uint8)


def _affine_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-element sub-block scale and min on 6 bits under fp16 super-scales; returns d, dmin, sc, mn, q."""
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    d = (scale.max(axis=-1, keepdims=True) / 63).astype(np.float16)
    dmin = ((-lo).max(axis=-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    eff_scale = (d.astype(np.float32) * sc)[..., None]
    eff_min = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.round((sub + eff_min) / np.where(eff_scale == 0, 1, eff_scale)), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(blocks, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_scales_k4(sc, mn), qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(blocks, 31)
    low, high = q & 0x0F, q >> 4
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for i in range(8):
        qh |= high[:, i, :] << i
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_scales_k4(sc, mn), qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (scale.max(axis=-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d.astype(np.float32))), -128, 127).astype(np.int8)
    eff = (d.astype(np.float32) * sc)[..., None]
    q = np.clip(np.round(sub / np.where(eff == 0, 1, eff)), -32, 31).astype(np.int16) + 32
    u = q.astype(np.uint8).reshape(-1, QK_K)
    low, high = (u & 0x0F).reshape(-1, 2, 2, 64), (u >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1)


_K_QUANTS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize(array: np.ndarray, qtype: str) -> np.ndarray:
    """A 2-D float array -> GGUF blocks of `qtype` (uint8, rows x bytes per row)."""
    import gguf

    if qtype not in _K_QUANTS:
        return gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType[qtype])
    rows = array.astype(np.float32).reshape(-1, QK_K)
    packed = _K_QUANTS[qtype](rows)
    return packed.reshape(array.shape[0], -1)


def write_gguf(
    path: Path, sd: dict[str, torch.Tensor], qtype: str, arch: str, *, quantize_filter=None
) -> dict[str, str]:
    """Write `sd` as a GGUF file, 2-D `.weight`s in `qtype` where their rows fit its block, else (as llama.cpp's
    quantizer falls back) Q8_0, else F16; the rest F32. Returns name -> type written."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    types: dict[str, str] = {}
    for name, tensor in sd.items():
        array = tensor.detach().float().cpu().numpy()
        chosen = "F32"
        # Linear weights only, as community converters do (pad tokens and tables are 2-D parameters too).
        if array.ndim == 2 and name.endswith(".weight") and (quantize_filter is None or quantize_filter(name)):
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
            chosen = qtype if array.shape[1] % block == 0 else ("Q8_0" if array.shape[1] % 32 == 0 else "F16")
        types[name] = chosen
        if chosen == "F32":
            writer.add_tensor(name, array)
        elif chosen == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            qt = gguf.GGMLQuantizationType[chosen]
            writer.add_tensor(name, quantize(array, chosen), raw_shape=quantize_shape(array.shape, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def quantize_shape(shape: tuple[int, ...], qtype) -> tuple[int, ...]:
    """The byte shape GGUFWriter expects as `raw_shape` for a quantized tensor of logical `shape`."""
    import gguf

    return gguf.quant_shape_to_byte_shape(shape, qtype)


def write_bfl(path: Path, sd: dict[str, torch.Tensor], kind: str, *, quantize_filter=None) -> int:
    """Write `sd` as Black Forest Labs' fp8r / nvfp4 safetensors: the blocks' Linear weights quantized with
    diffusers' `quantize_fp8r` / `quantize_nvfp4`, the rest (embedders, modulation, final layer) in bf16 as BFL's
    files keep them. Returns how many weights were quantized."""
    from diffusers.quantizers.bfl.utils import quantize_fp8r, quantize_nvfp4
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in sd.items():
        in_block = name.startswith(("double_blocks.", "single_blocks."))
        fits = in_block and tensor.ndim == 2 and name.endswith(".weight") and tensor.shape[1] % 16 == 0
        if fits and (quantize_filter is None or quantize_filter(name)):
            stem = name[: -len(".weight")]
            if kind == "nvfp4":
                weight, scale, scale_2 = quantize_nvfp4(tensor)
                out[f"{stem}.weight_scale_2"] = scale_2.reshape(())
                out[f"{stem}.input_scale"] = torch.tensor(1.0)
            else:
                weight, scale = quantize_fp8r(tensor)
            out[name], out[f"{stem}.weight_scale"] = weight.contiguous(), scale.contiguous()
            count += 1
        else:
            out[name] = tensor.detach().to(torch.bfloat16).contiguous()
    save_file(out, str(path))
    return count
