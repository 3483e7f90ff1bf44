"""Video families through the diffusers backend, each on its tiny checkpoint: HunyuanVideo and Helios
(HunyuanVideo 1.5 and LTX-2 run natively by default, test_family_hunyuan_video15.py and test_family_ltx2.py;
`--backend diffusers` still serves LTX-2, below). The backend's frames equal the diffusers pipeline class called
directly with the same arguments and seed (1/255 per pixel), and a merged batch equals the solo runs where the
family batches.
(Byte-identical rebuilds, and HunyuanVideo's real server answering the official `openai` SDK's video methods:
the conformance suite, test_family_conformance.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest


@dataclass(frozen=True)
class Case:
    tiny: str
    """`make-tiny --family` name."""
    pipeline_class: str
    family: str
    frames: int
    """Requested frames (the checkpoint's suggested default)."""
    out_frames: int
    """Frames the pipeline returns: Helios denoises whole 33-frame chunks."""
    batches: bool
    extra: tuple[tuple[str, Any], ...] = ()
    """Arguments the backend passes that differ from the pipeline's call defaults (the declared T5 length)."""


CASES = (
    Case("hunyuan-video", "HunyuanVideoPipeline", "hunyuan_video", 5, 5, True),
    Case("helios", "HeliosPipeline", "helios", 33, 33, True, (("max_sequence_length", 64),)),
)
PROMPTS = (("a red fox", 3), ("a cat surfing", 9))


def _direct(pipe: Any, case: Case, prompt: str, seed: int, params: Any) -> tuple[np.ndarray, Any]:
    """The pipeline's frames (0-255) and its waveform (LTX-2; None for the others)."""
    import torch

    kwargs: dict[str, Any] = {
        "prompt": prompt,
        "height": params.height,
        "width": params.width,
        "num_frames": params.num_frames,
        "num_inference_steps": params.num_inference_steps,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "np",
        **dict(case.extra),
    }
    kwargs["guidance_scale"] = params.guidance_scale
    if case.family == "ltx2":  # the backend passes the request's fps (LTX-2's positions and sound length use it)
        kwargs["frame_rate"] = float(params.fps)
    with torch.inference_mode():
        result = pipe(**kwargs)
    audio = getattr(result, "audio", None)
    return (np.clip(np.asarray(result.frames[0], dtype=np.float64), 0, 1) * 255).round(), (
        None if audio is None else audio[0].float()
    )


@pytest.mark.parametrize("case", CASES, ids=[c.tiny for c in CASES])
def test_backend_frames_equal_the_diffusers_pipeline(case: Case, tiny_checkpoint, family_pipeline, diffusers_pipeline):
    from diffuserve.sampling import SamplingParams

    path = tiny_checkpoint(case.tiny)
    backend = family_pipeline(path)  # auto: the diffusers backend (no native adapter; the suite checks the class)
    assert (backend.family, backend.output_kind, backend.supports_batching) == (case.family, "video", case.batches)
    assert (backend.defaults.width, backend.defaults.num_frames, backend.defaults.num_inference_steps) == (
        32,
        case.frames,
        2,
    )
    common = {
        "width": 32,
        "height": 32,
        "num_frames": case.frames,
        "num_inference_steps": 2,
        "guidance_scale": backend.defaults.guidance_scale,
        "output_format": "mp4",
    }
    batch = [SamplingParams(prompt=prompt, seed=seed, **common) for prompt, seed in PROMPTS]
    # A batching family runs both prompts as one merged call; each row must equal its own solo direct run.
    outputs = backend.run(batch).outputs if case.batches else [backend.run([p]).outputs[0] for p in batch]
    direct = diffusers_pipeline(case.pipeline_class, path)
    for output, (prompt, seed), params in zip(outputs, PROMPTS, batch, strict=True):
        expected, sound = _direct(direct, case, prompt, seed, params)
        got = np.stack([np.asarray(f, dtype=np.float64) for f in output.videos[0]])
        assert got.shape == (case.out_frames, 32, 32, 3)
        assert np.abs(got - expected).max() <= 1.0
        if case.family == "ltx2":  # its waveform, per row of the merged call, equals the solo pipeline call's
            assert output.audio_sample_rate == direct.vocoder.config.output_sampling_rate
            assert float((output.audios[0] - sound.clamp(-1, 1)).abs().max()) <= 1e-4
        else:
            assert output.audios == [] and output.audio_sample_rate is None
    assert (
        np.abs(
            np.asarray(outputs[0].videos[0][0], dtype=np.int16) - np.asarray(outputs[1].videos[0][0], dtype=np.int16)
        ).max()
        > 0
    )  # the prompts matter


def test_hunyuan_video_15_cannot_decode_a_prompt_list_in_diffusers(
    tiny_checkpoint, family_pipeline, diffusers_pipeline
):
    """Why the native HunyuanVideo 1.5 decode runs the VAE one row at a time (families/hunyuan_video15/adapter.py):
    diffusers' HunyuanVideo 1.5 VAE attention mask breaks for a batch of two. When a diffusers release fixes it this
    fails, and the native decode can decode the batch at once."""
    import torch

    path = tiny_checkpoint("hunyuan-video-1.5")
    # So `--backend diffusers` never hands this pipeline a batch (the native family merges rows).
    assert family_pipeline(path, "diffusers").supports_batching is False
    pipe = diffusers_pipeline("HunyuanVideo15Pipeline", path)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="broadcast shape"):
        pipe(
            prompt=["a red fox", "a cat surfing"],
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=1,
            output_type="np",
        )


def test_pipeline_local_components_load_beside_a_folder_of_the_same_name(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """LTX-2's model_index.json names ["ltx2", "LTX2TextConnectors"] (a diffusers pipeline-local module); a folder
    called `ltx2` on sys.path (a checkpoint in the working directory under `python -m`) must not shadow it."""
    from diffuserve.models.loader import load_pipeline

    (tmp_path / "ltx2").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(load_pipeline(tiny_checkpoint("ltx2"), backend="diffusers").pipe.connectors).__name__ == (
        "LTX2TextConnectors"
    )


def test_ltx2_sizes_and_frames_it_would_refuse_are_invalid_requests(tiny_checkpoint, family_pipeline):
    """LTX2Pipeline raises inside diffusers unless sizes divide by 32, and names its VAE factors
    `vae_*_compression_ratio`: both reach the backend's checks, so a bad request is a 400 before queueing."""
    from diffuserve.errors import InvalidRequestError
    from diffuserve.sampling import SamplingParams

    backend = family_pipeline(tiny_checkpoint("ltx2"), "diffusers")
    assert (backend.size_multiple, backend.frame_multiple) == (32, backend.pipe.vae_temporal_compression_ratio)
    with pytest.raises(InvalidRequestError) as size:
        backend.validate(SamplingParams(prompt="x", width=48, height=32, num_frames=9))
    assert size.value.param == "size"
    with pytest.raises(InvalidRequestError) as frames:
        backend.validate(SamplingParams(prompt="x", width=32, height=32, num_frames=8))
    assert frames.value.param == "num_frames"


def test_ltx2_rows_of_different_fps_run_as_separate_calls_each_equal_to_its_solo_run(tiny_checkpoint, family_pipeline):
    """LTX-2 takes the job's fps as `frame_rate` (its positions and the length of its sound depend on it), which is a
    per-row field: a merged batch with two rates runs one call per rate, and each row equals its run alone; a silent
    row (`generate_audio=False`, a signature field, so never merged with sounding rows) has the same frames (the
    backend computes the audio and drops it; the native family skips the branch: test_family_ltx2.py)."""
    from diffuserve.sampling import SamplingParams

    backend = family_pipeline(tiny_checkpoint("ltx2"), "diffusers")
    common = {"width": 32, "height": 32, "num_frames": 9, "num_inference_steps": 2, "output_format": "mp4"}
    batch = [
        SamplingParams(prompt="a red fox", seed=3, fps=8, **common),
        SamplingParams(prompt="a cat", seed=9, fps=12, **common),
    ]
    merged = backend.run(batch).outputs
    for output, params in zip(merged, batch, strict=True):
        (alone,) = backend.run([params]).outputs
        assert all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(output.videos[0], alone.videos[0], strict=True)
        )
        assert float((output.audios[0] - alone.audios[0]).abs().max()) <= 1e-6
    assert merged[0].audios[0].shape[1] > merged[1].audios[0].shape[1]  # 9/8 s of sound against 9/12 s
    # A checkpoint that suggests no fps (the tiny one suggests 8) plays at the rate LTX2Pipeline makes by default.
    assert type(backend)(backend.pipe, family="ltx2").defaults.fps == 24
    silent = backend.run([SamplingParams(prompt="a red fox", seed=3, fps=8, generate_audio=False, **common)]).outputs[0]
    assert silent.audios == [] and silent.audio_sample_rate is None
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(silent.videos[0], merged[0].videos[0], strict=True)
    )
