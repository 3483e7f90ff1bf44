"""Videos with sound, through a real server and the official `openai` SDK: the tiny LTX-2 (a joint audio-video model,
served by the diffusers backend) answers `/v1/videos` with an MP4 carrying an AAC track of the video's duration, whose
waveform is the one `LTX2Pipeline` makes for the same seed; `generate_audio: false` (or vLLM-Omni's
`generate_sound: false`) gives the same frames without a track, and a remix of it stays silent; bad sound fields are
400s naming them, nothing queued; `generate` writes the sound and takes `--generate-audio`. (Models without sound
refusing the fields: tests/integration/test_peer_clients.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from diffuserve.media.video import decode_audio, decode_frames, probe_mp4
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks its video methods deprecated

JOB = {"seed": 5, "num_inference_steps": 2}
"""The job every test here runs (the tiny checkpoint's defaults: 32x32, 9 frames at 8 fps = 1.125 s)."""
PROMPT = "a dog barking in the rain"


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _mp4(server: ServerProcess, job_id: str) -> bytes:
    client = _client(server)
    done = client.videos.poll(job_id)
    assert done.status == "completed", done
    return client.videos.download_content(done.id).read()


@pytest.fixture(scope="module")
def sound_mp4(ltx2_server: ServerProcess) -> bytes:
    """The MP4 of a job that leaves the sound on (the SDK's multipart create, extension fields in extra_body)."""
    return _mp4(ltx2_server, _client(ltx2_server).videos.create(prompt=PROMPT, size="32x32", extra_body=JOB).id)


def _reference(path: Any, diffusers_pipeline: Any) -> tuple[np.ndarray, int]:
    """`LTX2Pipeline`'s own waveform and vocoder rate for the job, called directly (frame_rate = the job's fps)."""
    import torch

    pipe = diffusers_pipeline("LTX2Pipeline", path)
    with torch.inference_mode():
        result = pipe(
            prompt=PROMPT,
            height=32,
            width=32,
            num_frames=9,
            frame_rate=8.0,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(JOB["seed"]),
            output_type="np",
        )
    return result.audio[0].float().numpy(), pipe.vocoder.config.output_sampling_rate


def test_the_mp4_carries_the_pipelines_sound_as_an_aac_track(sound_mp4, tiny_checkpoint, diffusers_pipeline):
    info = probe_mp4(sound_mp4)
    assert (info["video_streams"], info["audio_streams"], info["frames"], info["fps"]) == (1, 1, 9, 8.0)
    reference, rate = _reference(tiny_checkpoint("ltx2"), diffusers_pipeline)
    audio = info["audio"]
    assert (audio["codec"], audio["sample_rate"], audio["channels"]) == ("aac", rate, reference.shape[0])
    assert abs(audio["seconds"] - 9 / 8) <= 1 / 8  # the picture's duration, within one frame
    decoded, _ = decode_audio(sound_mp4)
    # The tiny vocoder's waveform spans the clip (num_frames / fps seconds); anything past it is the MP4's padding
    # (silence). AAC is lossy: the head's loudness within 10% of the pipeline's and its sample-by-sample error under
    # 20% of the signal (measured 5% and 7%).
    n = reference.shape[1]
    head = decoded[:, :n]
    rms = float(np.sqrt(np.mean(reference**2)))
    assert float(np.sqrt(np.mean(head**2))) == pytest.approx(rms, rel=0.1)
    assert float(np.sqrt(np.mean((head - reference) ** 2))) < 0.2 * rms
    tail = decoded[:, n + 2048 :]
    assert tail.size == 0 or float(np.abs(tail).max()) < 0.01


def test_generate_audio_false_gives_a_video_without_a_track(ltx2_server, sound_mp4):
    """Silent jobs (multipart `generate_audio`, JSON `generate_sound`) have no track and the same frames as each
    other; not the sounding job's frames: natively the audio branch is skipped and the joint model's video no longer
    attends to audio (equal to LTX2Pipeline with isolated modalities: tests/integration/test_family_ltx2.py)."""
    client = _client(ltx2_server)
    multipart = client.videos.create(prompt=PROMPT, size="32x32", extra_body={**JOB, "generate_audio": False})
    as_json = httpx.post(  # vLLM-Omni's name for the switch, in a JSON body
        f"{ltx2_server.base_url}/v1/videos",
        json={"prompt": PROMPT, "size": "32x32", **JOB, "generate_sound": False},
        timeout=30,
    )
    assert as_json.status_code == 200, as_json.text
    silent_frames = []
    for job_id in (multipart.id, as_json.json()["id"]):
        silent = _mp4(ltx2_server, job_id)
        info = probe_mp4(silent)
        assert (info["video_streams"], info["audio_streams"], info["audio"]) == (1, 0, None)
        silent_frames.append(np.stack([np.asarray(f, dtype=np.int16) for f in decode_frames(silent)]))
    assert np.abs(silent_frames[0] - silent_frames[1]).max() <= 1  # the two spellings of the switch agree
    # A remix keeps the source job's settings, sound off included.
    remix = _mp4(ltx2_server, client.videos.remix(multipart.id, prompt="a cat purring").id)
    assert probe_mp4(remix)["audio_streams"] == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"generate_audio": True, "generate_sound": False}, "generate_sound"),  # the same switch twice, disagreeing
        ({"sound_duration": 4.0}, "sound_duration"),  # the video lasts 1.125 s
        ({"generate_audio": False, "sound_duration": 1.125}, "sound_duration"),  # a silent video has no sound to time
        ({"generate_audio": "loud"}, "generate_audio"),
    ],
)
def test_bad_sound_fields_are_400s_naming_them_before_queueing(ltx2_server, extra, param):
    before = len(httpx.get(f"{ltx2_server.base_url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"])
    response = httpx.post(f"{ltx2_server.base_url}/v1/videos", json={"prompt": "x", **extra}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    after = len(httpx.get(f"{ltx2_server.base_url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"])
    assert after == before


def test_generate_writes_the_sound_and_takes_generate_audio_false(tiny_checkpoint, tmp_path, capsys):
    from diffuserve import cli
    from diffuserve.family_spec.base import SamplingDefaults
    from diffuserve.generate import _build_params
    from diffuserve.sampling import ModelDescription

    out = tmp_path / "out"
    code = cli.main(
        ["generate", "--model-path", str(tiny_checkpoint("ltx2")), "--output-path", str(out)]
        + ["--prompt", PROMPT, "--seed", "5", "--num-inference-steps", "2"]
    )
    printed, err = capsys.readouterr()
    assert code == 0, err
    info = probe_mp4(Path(printed.strip().splitlines()[-1]).read_bytes())
    assert (info["frames"], info["audio_streams"], info["audio"]["codec"]) == (9, 1, "aac")
    assert abs(info["audio"]["seconds"] - 9 / 8) <= 1 / 8
    # `--generate-audio false` reaches the request as the API's field does (the flag's parse: the snapshot test).
    model = ModelDescription(output_kind="video", produces_audio=True, defaults=SamplingDefaults(num_frames=9, fps=8))
    assert [p.generate_audio for p in _build_params({"generate_audio": False}, model, ["x"], 1, ())] == [False]
    assert [p.generate_audio for p in _build_params({}, model, ["x"], 1, ())] == [True]


def test_generate_refuses_generate_audio_on_a_model_without_sound_before_loading(
    tiny_wan_path, tmp_path, capsys, monkeypatch
):
    from diffuserve import cli

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("diffuserve.launch.root.build_generate_engine", refuse)
    argv = ["generate", "--model-path", str(tiny_wan_path), "--prompt", "x", "--generate-audio", "false"]
    code = cli.main([*argv, "--output-path", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "--generate-audio" in err and "makes no sound" in err, err


def test_a_continuous_server_writes_the_sound_too(tiny_checkpoint, tmp_path) -> None:
    """`--batching-mode continuous` (LTX-2 joins running groups at step boundaries): the job's audio comes out of
    the group's decode (`step_batch.finish_requests`) into the MP4 as an AAC track of the picture's duration."""
    server = ServerProcess(
        ["--model-path", str(tiny_checkpoint("ltx2")), "--batching-mode", "continuous"], tmp_path / "server.log"
    )
    server.start()
    try:
        job = _client(server).videos.create(prompt=PROMPT, size="32x32", extra_body=JOB)
        info = probe_mp4(_mp4(server, job.id))
    finally:
        server.stop()
    assert (info["video_streams"], info["audio_streams"], info["frames"]) == (1, 1, 9)
    assert abs(info["audio"]["seconds"] - 9 / 8) <= 1 / 8
