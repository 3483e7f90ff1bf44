"""The GPU check of `--quantization` (issue 28 item 7), run by `benchmarks/gpu_check.sh`; it measures, it asserts
nothing but that every side ran.

On one CUDA device, with random weights built ON the device from the published configs written below (no
download: FLUX.1-dev's `FluxTransformer2DModel`, 12B, and Wan2.1-T2V-1.3B's `WanTransformer3DModel`):

1. DiT step time (CUDA events, median) and memory (`torch.cuda.max_memory_allocated` over the timed steps, and the
   weights after load) for bf16 vs fp8 vs int8 vs int8-dynamic, quantized by the serving path
   (`quant.apply.quantize_module` with the family's never-quantize list): FLUX.1-dev at 1024 px (4096 image tokens,
   512 text tokens), Wan2.1-1.3B at 832x480, 81 frames.
2. Native vs diffusers pipeline call time (median of 2 calls after 1 warm-up) for FLUX.1-dev at 1024 px: the
   real-shape bf16 DiT inside a pipeline whose text encoders and VAE are TINY (random, the widths the DiT expects:
   CLIP 768, T5 4096, 16 latent channels), so the figure is the DiT's loop plus each pipeline's own overhead, not
   FLUX's real encoders.
3. With two CUDA devices: CFG parallel (one branch per GPU, NCCL) vs one GPU running both branches, on the same
   pipeline with true CFG.

`--device cpu --tiny` runs every path on tiny shapes on the CPU (CFG parallel over two gloo processes with
`--cfg-ranks 2`): what the suite runs (tests/integration/test_gpu_check.py) so this script cannot rot.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

FLUX_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
"""black-forest-labs/FLUX.1-dev transformer/config.json."""
WAN_1_3B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
"""Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json."""
TINY = {
    "flux": FLUX_DEV
    | {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2}
    | {"joint_attention_dim": 32, "pooled_projection_dim": 24, "axes_dims_rope": (4, 4, 8)},
    "wan": WAN_1_3B
    | {"num_attention_heads": 2, "attention_head_dim": 24, "text_dim": 32, "freq_dim": 32}
    | {"ffn_dim": 64, "num_layers": 1},
}
"""The same classes on tiny widths (`--tiny`: the CPU test)."""
METHODS = ("bf16", "fp8", "int8", "int8-dynamic")


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (with --tiny: the suite's run)")
    parser.add_argument("--tiny", action="store_true", help="tiny widths and sizes (the CPU test)")
    parser.add_argument("--steps", type=int, default=5, help="timed DiT steps per method (after 2 warm-up steps)")
    parser.add_argument("--pipeline-steps", type=int, default=8, help="denoising steps of each pipeline call")
    parser.add_argument("--cfg-ranks", type=int, default=None, help="CFG-parallel ranks (default: 2 if 2 GPUs)")
    parser.add_argument("--only", nargs="*", default=["dit", "pipeline", "cfg"], help="dit / pipeline / cfg")
    return parser.parse_args(argv)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_dit(family: str, device: torch.device, dtype: torch.dtype, tiny: bool, **overrides: Any) -> Any:
    """A random-weight DiT of the published config, built directly on `device` in `dtype` (seed 0)."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    config = (TINY if tiny else {"flux": FLUX_DEV, "wan": WAN_1_3B})[family] | overrides
    cls = FluxTransformer2DModel if family == "flux" else WanTransformer3DModel
    torch.manual_seed(0)
    with torch.device(device), _default_dtype(dtype):
        return cls(**config).eval().requires_grad_(False)


def dit_inputs(family: str, dit: Any, device: torch.device, dtype: torch.dtype, tiny: bool) -> dict[str, Any]:
    """One step's inputs: FLUX at 1024 px (128x128 latents, 2x2 packed: 4096 tokens) with 512 text tokens; Wan at
    832x480, 81 frames (21 x 60 x 104 latents); tiny sizes with `tiny`."""
    cfg, g = dit.config, torch.Generator(device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    text = 8 if tiny else 512
    if family == "flux":
        side = 4 if tiny else 64  # 1024 px / 8 (VAE) / 2 (packing)
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(device, dtype)
        return {
            "hidden_states": randn(1, side * side, cfg.in_channels),
            "encoder_hidden_states": randn(1, text, cfg.joint_attention_dim),
            "pooled_projections": randn(1, cfg.pooled_projection_dim),
            "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
            "img_ids": img_ids,
            "txt_ids": torch.zeros(text, 3, device=device, dtype=dtype),
            "guidance": torch.full((1,), 3.5, device=device, dtype=dtype),
            "return_dict": False,
        }
    frames, height, width = (2, 4, 4) if tiny else (21, 60, 104)
    return {
        "hidden_states": randn(1, cfg.in_channels, frames, height, width),
        "encoder_hidden_states": randn(1, text, cfg.text_dim),
        "timestep": torch.full((1,), 500, device=device, dtype=torch.long),
        "return_dict": False,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, runs: int, warmup: int = 2) -> float:
    """Median milliseconds of `fn` over `runs` calls after `warmup` (CUDA events on a GPU, the clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _weights_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def dit_rows(family: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> list[dict]:
    """Step time and memory of the DiT per method (each built afresh, quantized as serving quantizes it)."""
    from diffuserve.family_spec import spec_for
    from diffuserve.quant.apply import quantize_module

    rows = []
    for method in METHODS:
        _free(device)
        dit = build_dit(family, device, dtype, args.tiny)
        kernels = "-"
        if method != "bf16":
            report = quantize_module(dit, method, spec_for(family).quant_keep, device, "transformer")
            kernels = ",".join(sorted(report.kernels))
        inputs = dit_inputs(family, dit, device, dtype, args.tiny)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            ms = time_ms(lambda dit=dit, inputs=inputs: dit(**inputs), device, args.steps)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows.append(
            {
                "dit": family,
                "method": method if method != "bf16" else str(dtype).removeprefix("torch."),
                "kernels": kernels,
                "weights_mib": _weights_bytes(dit) / 2**20,
                "peak_mib": peak / 2**20,
                "step_ms": ms,
            }
        )
        del dit, inputs
    return rows


def _pipeline_components(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict[str, Any]:
    """Tiny random FLUX encoders, VAE, tokenizers and scheduler at the widths the real DiT reads, around the
    real-shape DiT (`tiny`: the tiny DiT)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffuserve.families.flux.tiny import _build_flux_components
    from diffuserve.models.tiny import TinyFluxPreset, build_tokenizers
    from diffuserve.models.tiny_parts import tiny_clip_config

    dit = build_dit("flux", device, dtype, tiny)
    joint, pooled = dit.config.joint_attention_dim, dit.config.pooled_projection_dim
    components = _build_flux_components(TinyFluxPreset(latent_channels=16, text_hidden=joint))
    clip_tokenizer, t5_tokenizer = build_tokenizers(8 if tiny else 512)
    torch.manual_seed(1)
    components["text_encoder"] = CLIPTextModel(CLIPTextConfig(**tiny_clip_config(clip_tokenizer, pooled))).eval()
    components |= {"tokenizer": clip_tokenizer, "tokenizer_2": t5_tokenizer}
    for key in ("text_encoder", "text_encoder_2", "vae"):
        components[key] = components[key].to(device=device, dtype=dtype).requires_grad_(False)
    components["transformer"] = dit
    return components


def pipeline_rows(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> list[dict]:
    """Native vs diffusers FLUX.1-dev pipeline call time at 1024 px (tiny encoders and VAE, the real DiT)."""
    from diffusers import FluxPipeline

    from diffuserve.families.flux.adapter import FluxAdapter
    from diffuserve.pipelines.recipe import RecipePipeline
    from diffuserve.sampling import SamplingParams

    size = 64 if args.tiny else 1024
    _free(device)
    components = _pipeline_components(device, dtype, args.tiny)
    native = RecipePipeline(FluxAdapter.from_components(dict(components), device=device, dtype=dtype))
    theirs = FluxPipeline(**components)
    theirs.set_progress_bar_config(disable=True)
    prompt = "a lighthouse on a cliff at dusk"
    params = [SamplingParams(prompt=prompt, seed=0, width=size, height=size, num_inference_steps=args.pipeline_steps)]

    def run_native() -> None:
        with torch.inference_mode():
            (image,) = native.run(params).outputs[0].images
        assert image.size == (size, size)

    def run_diffusers() -> None:
        generator = torch.Generator(device).manual_seed(0)
        with torch.inference_mode():
            (image,) = theirs(
                prompt,
                width=size,
                height=size,
                num_inference_steps=args.pipeline_steps,
                guidance_scale=3.5,
                generator=generator,
                max_sequence_length=8 if args.tiny else 512,
            ).images
        assert image.size == (size, size)

    rows = []
    for name, fn in (("native", run_native), ("diffusers", run_diffusers)):
        _sync(device)
        rows.append({"pipeline": name, "call_ms": time_ms(lambda fn=fn: (fn(), _sync(device)), device, 2, warmup=1)})
    return rows


def _cfg_rank(rank: int, world: int, init_file: str, device_type: str, tiny: bool, steps: int, out: str) -> None:
    """One CFG-parallel rank: the pipeline with true CFG on one device, then CFG parallel over the group."""
    import torch.distributed as dist

    from diffuserve.families.flux.adapter import FluxAdapter
    from diffuserve.parallel.cfg_parallel import CfgParallel
    from diffuserve.pipelines.recipe import RecipePipeline
    from diffuserve.sampling import SamplingParams

    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
        adapter = FluxAdapter.from_components(_pipeline_components(device, dtype, tiny), device=device, dtype=dtype)
        pipe = RecipePipeline(adapter)
        size = 64 if tiny else 1024
        params = [
            SamplingParams(
                prompt="a red fox",
                negative_prompt="blurry",
                true_cfg_scale=4.0,
                seed=0,
                width=size,
                height=size,
                num_inference_steps=steps,
            )
        ]

        def call() -> Any:
            with torch.inference_mode():
                return pipe.run(params).outputs[0].images[0]

        one = time_ms(lambda: (call(), _sync(device)), device, 2, warmup=1)
        dist.barrier()
        pipe.cfg_parallel = CfgParallel(dist.group.WORLD)
        two = time_ms(lambda: (call(), _sync(device)), device, 2, warmup=1)
        if rank == 0:
            Path(out).write_text(f"{one} {two}")
    finally:
        dist.destroy_process_group()


def cfg_rows(device: torch.device, args: argparse.Namespace) -> list[dict]:
    """CFG parallel over `--cfg-ranks` devices (processes) vs one device running both branches."""
    import torch.multiprocessing as mp

    folder = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out = folder / "cfg.txt"
    mp.start_processes(
        _cfg_rank,
        args=(2, str(folder / "rendezvous"), device.type, args.tiny, args.pipeline_steps, str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    one, two = (float(x) for x in out.read_text().split())
    return [{"cfg": "1 device, both branches", "call_ms": one}, {"cfg": "CFG parallel, 2 ranks", "call_ms": two}]


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing measured (run it on a CUDA machine).")
        return 0
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = "TINY shapes" if args.tiny else "FLUX.1-dev 12B at 1024 px, Wan2.1-1.3B at 832x480x81"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check on {name} ({shapes}), torch {torch.__version__}, random weights built on the device")
    began = time.perf_counter()
    if "dit" in args.only:
        _print(
            "DiT step (1 step, batch 1)", dit_rows("flux", device, dtype, args) + dit_rows("wan", device, dtype, args)
        )
    if "pipeline" in args.only:
        _print(
            f"FLUX.1-dev pipeline call ({args.pipeline_steps} steps; tiny encoders and VAE)",
            pipeline_rows(device, dtype, args),
        )
    ranks = (
        args.cfg_ranks
        if args.cfg_ranks is not None
        else (2 if device.type == "cuda" and torch.cuda.device_count() >= 2 else 1)
    )
    if "cfg" in args.only:
        if ranks >= 2:
            _print(
                f"CFG parallel, FLUX.1-dev pipeline with true CFG ({args.pipeline_steps} steps)", cfg_rows(device, args)
            )
        else:
            print("\n## CFG parallel: skipped (one CUDA device)")
    print(f"\ngpu_check done in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
