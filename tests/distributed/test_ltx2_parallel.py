"""LTX-2's exact parallel strategies over two real gloo ranks, in one launch: each equals the single-process run,
frames and waveforms.

- CFG parallel: each rank runs one CFG branch of the joint audio-video call; the STG / modality-isolation passes
  (conditional text only) run on both ranks, so both hold the same guided prediction.
- FSDP2: the transformer sharded block by block over the two ranks (with CFG parallel on top).
- Ulysses and Ring sequence parallel: the video tokens split over the two ranks, the audio tokens replicated, the
  video-to-audio cross-attention reading the all-gathered video (text-to-video and an image-to-video row, whose
  per-token timestep is split too).

(Tensor parallel has no LTX-2 plan: the family spec says so and start-up refuses it.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, run_two_ranks
from tests.integration.family_references import png

STRATEGIES = ("cfg", "fsdp", "ulysses", "ring")


def _requests(model):
    from diffuserve.sampling import build_sampling_params

    return [
        build_sampling_params(model, prompt="a red fox", negative_prompt="blurry", seed=1, n=2),
        build_sampling_params(model, prompt="a cat on a long sandy beach", seed=5, fps=12),
        build_sampling_params(model, prompt="a cat", seed=6, image_inputs=(png(32, 32, seed=1),)),
    ]


def _audio(result) -> np.ndarray:
    return np.concatenate([a.numpy().ravel() for out in result.outputs for a in out.audios])


def _rank_main(rank: int, world: int, init_file: str, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel
    from diffuserve.parallel.fsdp import shard_denoisers
    from diffuserve.parallel.sequence import enable_sequence_parallel

    with process_group(rank, world, init_file), torch.inference_mode():
        for strategy in STRATEGIES:
            pipe = load_pipeline(checkpoints["ltx2"])
            if strategy in ("ulysses", "ring"):
                group = dist.group.WORLD
                sp = enable_sequence_parallel(
                    pipe,
                    ulysses_group=group if strategy == "ulysses" else None,
                    ring_group=group if strategy == "ring" else None,
                )
                result = pipe.run(_requests(pipe.describe_model()))
                assert sp.calls > 0 and sp.attention_calls > 0  # the split really ran
                np.save(Path(out_dir) / f"{strategy}-rank{rank}-frames.npy", pixels(result))
                np.save(Path(out_dir) / f"{strategy}-rank{rank}-audio.npy", _audio(result))
                continue
            if strategy == "fsdp":
                shard_denoisers(pipe)
            enable_cfg_parallel(pipe)
            result = pipe.run(_requests(pipe.describe_model()))
            np.save(Path(out_dir) / f"{strategy}-rank{rank}-frames.npy", pixels(result))
            np.save(Path(out_dir) / f"{strategy}-rank{rank}-audio.npy", _audio(result))


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint, tmp_path_factory):
    checkpoints = {"ltx2": str(tiny_checkpoint("ltx2"))}
    out_dir = tmp_path_factory.mktemp("ltx2-parallel")
    run_two_ranks(_rank_main, checkpoints, out_dir)
    from diffuserve.models.loader import load_pipeline

    pipe = load_pipeline(checkpoints["ltx2"])
    single = pipe.run(_requests(pipe.describe_model()))
    return out_dir, pixels(single), _audio(single)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_equals_the_single_process_run(outputs, strategy: str) -> None:
    out_dir, frames, audio = outputs
    for rank in (0, 1):
        got = np.load(out_dir / f"{strategy}-rank{rank}-frames.npy")
        assert got.shape == frames.shape
        assert np.abs(got.astype(np.int16) - frames.astype(np.int16)).max() <= 1
        wave = np.load(out_dir / f"{strategy}-rank{rank}-audio.npy")
        assert wave.shape == audio.shape and np.abs(wave - audio).max() <= 1e-4
