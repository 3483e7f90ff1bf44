"""HunyuanVideo 1.5's scale levers over two real gloo ranks, in one launch, each equal to the single-process run:
Ulysses and Ring sequence parallel over the video tokens (the text replicated), CFG parallel, tensor parallel and
FSDP of the DiT. The batch merges two requests with CFG (n=2, prompts of different lengths and one quoted glyph
text, so both text masks pad).

Tolerances (as for Wan, STACK.md): CFG parallel and FSDP bit-identical pixels; sequence parallel and TP reorder
attention / all-reduced sums: the final float32 latents within 1e-5 and the pixels within 1/255.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, run_two_ranks

LATENT_TOLERANCE = 1e-5
PIXEL_TOLERANCE = 1
LEVERS = ("ulysses", "ring", "cfg", "tp", "fsdp")


def _batch(pipe):
    from diffuserve.sampling import build_sampling_params

    common = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 4.0}
    model = pipe.describe_model()
    return [
        build_sampling_params(model, prompt="a red fox", negative_prompt="blurry", seed=1, n=2, **common),
        build_sampling_params(model, prompt='a cat holding a sign "HELLO" on a beach', seed=5, **common),
    ]


def _run(pipe) -> tuple[np.ndarray, np.ndarray]:
    """(final latents, pixels) of the batch."""
    captured = []
    decode = pipe.decode

    def capture(latents, state):
        captured.append(latents.float().cpu().numpy().copy())
        return decode(latents, state)

    pipe.decode = capture
    try:
        result = pipe.run(_batch(pipe))
    finally:
        del pipe.decode
    return captured[0], pixels(result)


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel
    from diffuserve.parallel.fsdp import shard_denoisers
    from diffuserve.parallel.sequence import enable_sequence_parallel
    from diffuserve.parallel.tensor import enable_tensor_parallel

    path = checkpoints["hunyuan-video-1.5"]
    with process_group(rank, world, init_file), torch.inference_mode():
        group = dist.group.WORLD
        for lever in LEVERS:
            pipe = load_pipeline(path)
            counts = [0, 0]
            if lever in ("ulysses", "ring"):
                sp = enable_sequence_parallel(
                    pipe,
                    ulysses_group=group if lever == "ulysses" else None,
                    ring_group=group if lever == "ring" else None,
                )
                result = _run(pipe)
                counts = [sp.calls, sp.attention_calls]
                sp.remove()
            else:
                if lever == "cfg":
                    enable_cfg_parallel(pipe)
                elif lever == "tp":
                    enable_tensor_parallel(pipe, mesh=init_device_mesh("cpu", (2,)))
                else:
                    shard_denoisers(pipe)
                result = _run(pipe)
            np.save(Path(out_dir) / f"{lever}-rank{rank}-latents.npy", result[0])
            np.save(Path(out_dir) / f"{lever}-rank{rank}-pixels.npy", result[1])
            np.save(Path(out_dir) / f"{lever}-rank{rank}-calls.npy", np.array(counts))


@pytest.fixture(scope="module")
def launched(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[np.ndarray, np.ndarray]]:
    from diffuserve.models.loader import load_pipeline

    path = str(tiny_checkpoint("hunyuan-video-1.5"))
    single = _run(load_pipeline(path))
    out = tmp_path_factory.mktemp("hv15-parallel")
    run_two_ranks(_rank_main, {"hunyuan-video-1.5": path}, out)
    return out, single


@pytest.mark.timeout(900)
@pytest.mark.parametrize("lever", LEVERS)
def test_each_lever_equals_one_process(launched, lever: str) -> None:
    out, (latents, frames) = launched
    exact = lever in ("cfg", "fsdp")
    for rank in (0, 1):
        got_latents = np.load(out / f"{lever}-rank{rank}-latents.npy")
        got_frames = np.load(out / f"{lever}-rank{rank}-pixels.npy")
        assert got_frames.shape == frames.shape
        if exact:
            assert np.array_equal(got_frames, frames), lever
            continue
        assert np.abs(got_latents - latents).max() <= LATENT_TOLERANCE, lever
        assert np.abs(got_frames.astype(np.int16) - frames.astype(np.int16)).max() <= PIXEL_TOLERANCE, lever
    if lever in ("ulysses", "ring"):  # the split really ran: every DiT call and each of its 2 blocks' attention
        calls, attention = np.load(out / f"{lever}-rank0-calls.npy")
        assert calls == 2 * 2 and attention == 2 * calls  # 2 steps x 2 CFG branches; 2 blocks per DiT call
