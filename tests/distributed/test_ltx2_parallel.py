"""LTX-2's exact parallel strategies over two real gloo ranks, in one launch: each equals the single-process run,
frames and waveforms.

- CFG parallel: each rank runs one CFG branch of the joint audio-video call; the STG / modality-isolation passes
  (conditional text only) run on both ranks, so both hold the same guided prediction.
- FSDP2: the transformer sharded block by block over the two ranks (with CFG parallel on top).
- Ulysses and Ring sequence parallel: the video tokens split over the two ranks, the audio tokens replicated, the
  video-to-audio cross-attention reading the all-gathered video (text-to-video and an image-to-video row, whose
  per-token timestep is split too).
- Tensor parallel: the heads of every attention of each joint block (video / audio self- and prompt
  cross-attention, audio-to-video, video-to-audio) and both MLPs split over the two ranks, the q/k RMSNorms across
  heads from an all-reduced sum of squares, the RoPE tables cut to each rank's heads; on LTX-2.0 and on the
  LTX-2.3 configuration (per-head gated attention, the perturbable self-attention, cross-attention modulation).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.distributed.ranks import pixels, process_group, run_two_ranks
from tests.integration.family_references import png

# One 2-rank launch runs every strategy on both tiny builds (about 4 min on a loaded 2-core host): past the suite's
# 300 s default for one fixture.
pytestmark = pytest.mark.timeout(600)

STRATEGIES = ("cfg", "fsdp", "ulysses", "ring", "tp", "tp-ltx2.3")
BUILDS = ("ltx2", "ltx2.3")


def _requests(model, build: str = "ltx2"):
    from diffuserve.sampling import build_sampling_params

    if build == "ltx2.3":  # TP on LTX-2.3's configuration: one guided row is enough (the batch is LTX-2.0's case)
        return [build_sampling_params(model, prompt="a red fox", negative_prompt="blurry", seed=1)]
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
    from torch.distributed.device_mesh import init_device_mesh

    from diffuserve.models.loader import load_pipeline
    from diffuserve.parallel.cfg_parallel import enable_cfg_parallel
    from diffuserve.parallel.fsdp import shard_denoisers
    from diffuserve.parallel.sequence import enable_sequence_parallel
    from diffuserve.parallel.tensor import enable_tensor_parallel, sharded_bytes

    with process_group(rank, world, init_file), torch.inference_mode():
        for strategy in STRATEGIES:
            build = "ltx2.3" if strategy == "tp-ltx2.3" else "ltx2"
            pipe = load_pipeline(checkpoints[build])
            if strategy.startswith("tp"):
                assert enable_tensor_parallel(pipe, mesh=init_device_mesh("cpu", (world,))) == ["transformer"]
                result = pipe.run(_requests(pipe.describe_model(), build))
                np.save(
                    Path(out_dir) / f"{strategy}-rank{rank}-bytes.npy",
                    np.array(sharded_bytes(pipe.adapter.transformer)),
                )
                np.save(Path(out_dir) / f"{strategy}-rank{rank}-frames.npy", pixels(result))
                np.save(Path(out_dir) / f"{strategy}-rank{rank}-audio.npy", _audio(result))
                continue
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
    checkpoints = {build: str(tiny_checkpoint(build)) for build in BUILDS}
    out_dir = tmp_path_factory.mktemp("ltx2-parallel")
    run_two_ranks(_rank_main, checkpoints, out_dir)
    from diffuserve.models.loader import load_pipeline

    singles = {}
    for build in BUILDS:
        pipe = load_pipeline(checkpoints[build])
        single = pipe.run(_requests(pipe.describe_model(), build))
        singles[build] = pixels(single), _audio(single)
    return out_dir, singles


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_equals_the_single_process_run(outputs, strategy: str) -> None:
    out_dir, singles = outputs
    frames, audio = singles["ltx2.3" if strategy == "tp-ltx2.3" else "ltx2"]
    for rank in (0, 1):
        got = np.load(out_dir / f"{strategy}-rank{rank}-frames.npy")
        assert got.shape == frames.shape
        assert np.abs(got.astype(np.int16) - frames.astype(np.int16)).max() <= 1
        wave = np.load(out_dir / f"{strategy}-rank{rank}-audio.npy")
        assert wave.shape == audio.shape and np.abs(wave - audio).max() <= 1e-4
        if strategy.startswith("tp"):  # each rank holds about half of the planned weights (biases rowwise stay whole)
            held, full = np.load(out_dir / f"{strategy}-rank{rank}-bytes.npy")
            assert 0.45 * full <= held <= 0.55 * full, (held, full)
