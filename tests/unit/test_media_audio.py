"""MP4s with sound (joint audio-video families, LTX-2): `encode_mp4` writes the waveform as an AAC track beside the
picture, at its sample rate and of the picture's duration; decoded with PyAV, the sound is the one written (AAC is
lossy: compared by spectrum peak, RMS and waveform error, each with a stated tolerance)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from diffuserve.media.video import decode_audio, encode_mp4, fit_audio, probe_mp4

FPS = 24
FRAMES = 25
RATE = 24_000
"""LTX-2's vocoder rate."""
TONES = (440.0, 1000.0)
"""Left and right channel frequencies (Hz)."""
AMPLITUDES = (0.5, 0.3)


def _frames(count: int = FRAMES) -> list[Image.Image]:
    return [Image.new("RGB", (32, 24), (i * 9 % 256, 128, 255 - i * 9 % 256)) for i in range(count)]


def _tones(samples: int, rate: int = RATE) -> np.ndarray:
    t = np.arange(samples) / rate
    return np.stack([a * np.sin(2 * np.pi * f * t) for f, a in zip(TONES, AMPLITUDES, strict=True)]).astype(np.float32)


def _stream_seconds(data: bytes) -> tuple[float, float]:
    """(video, audio) durations as the MP4 declares them, read straight through PyAV."""
    with av.open(io.BytesIO(data)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        return float(video.duration * video.time_base), float(audio.duration * audio.time_base)


def test_a_video_with_sound_has_one_aac_track_of_the_videos_duration() -> None:
    written = _tones(FRAMES * RATE // FPS)
    data = encode_mp4(_frames(), FPS, written, RATE)
    info = probe_mp4(data)
    assert (info["video_streams"], info["audio_streams"], info["frames"]) == (1, 1, FRAMES)
    audio = info["audio"]
    assert (audio["codec"], audio["sample_rate"], audio["channels"]) == ("aac", RATE, 2)
    video_seconds = FRAMES / FPS
    declared_video, declared_audio = _stream_seconds(data)
    for seconds in (declared_video, declared_audio, audio["seconds"]):
        assert abs(seconds - video_seconds) <= 1 / FPS, (seconds, video_seconds)

    decoded, rate = decode_audio(data)
    assert rate == RATE
    n = min(decoded.shape[1], written.shape[1])
    decoded, reference = decoded[:, :n], written[:, :n]
    freqs = np.fft.rfftfreq(n, 1 / RATE)
    for channel, (tone, amplitude) in enumerate(zip(TONES, AMPLITUDES, strict=True)):
        spectrum = np.abs(np.fft.rfft(decoded[channel]))
        assert abs(freqs[spectrum.argmax()] - tone) <= 2 * RATE / n  # the peak within two FFT bins
        rms = float(np.sqrt(np.mean(decoded[channel] ** 2)))
        assert rms == pytest.approx(amplitude / np.sqrt(2), rel=0.05)  # loudness within 5%
        # Sample by sample (no shift: the track's edit list drops the encoder's priming samples): the error's RMS
        # is under 10% of the signal's (measured ~3% at 128 kb/s).
        error = np.sqrt(np.mean((decoded[channel] - reference[channel]) ** 2)) / np.sqrt(
            np.mean(reference[channel] ** 2)
        )
        assert error < 0.1, error


def test_sound_longer_than_the_video_is_cut_and_shorter_is_padded_with_silence() -> None:
    video_seconds = FRAMES / FPS
    longer = encode_mp4(_frames(), FPS, _tones(3 * RATE), RATE)  # 3 s of sound for ~1 s of video
    assert abs(probe_mp4(longer)["audio"]["seconds"] - video_seconds) <= 1 / FPS
    half = FRAMES * RATE // FPS // 2
    shorter = encode_mp4(_frames(), FPS, _tones(half), RATE)
    decoded, _ = decode_audio(shorter)
    assert abs(decoded.shape[1] / RATE - video_seconds) <= 1 / FPS
    tail = decoded[:, half + 2048 :]  # past the AAC frame that straddles the end of the tone
    assert float(np.abs(tail).max()) < 0.01
    assert float(np.sqrt(np.mean(decoded[0, : half - 2048] ** 2))) == pytest.approx(0.5 / np.sqrt(2), rel=0.05)


def test_mono_at_a_rate_aac_lacks_is_resampled_to_the_next_aac_rate() -> None:
    rate = 22_000  # AAC's rates include 22050, not 22000
    mono = _tones(FRAMES * rate // FPS, rate)[:1]
    audio = probe_mp4(encode_mp4(_frames(), FPS, mono, rate))["audio"]
    assert (audio["sample_rate"], audio["channels"]) == (22_050, 1)
    assert abs(audio["seconds"] - FRAMES / FPS) <= 1 / FPS


def test_a_video_without_sound_has_no_audio_track() -> None:
    info = probe_mp4(encode_mp4(_frames(3), FPS))
    assert (info["video_streams"], info["audio_streams"], info["audio"]) == (1, 0, None)


def test_fit_audio_takes_tensors_and_refuses_malformed_waveforms() -> None:
    import torch

    fitted = fit_audio(torch.full((2, 10), 2.0, dtype=torch.bfloat16), 100, num_frames=3, fps=10)
    assert fitted.shape == (2, 30) and fitted.dtype == np.float32
    assert fitted[:, :10].max() == 1.0 and not fitted[:, 10:].any()  # clipped to [-1, 1], padded with silence
    with pytest.raises(ValueError, match="1 or 2 channels"):
        fit_audio(np.zeros((3, 10)), 100, 3, 10)
    with pytest.raises(ValueError, match="sample rate"):
        encode_mp4(_frames(2), FPS, np.zeros((1, 10)), None)
