"""MP4 encoding for generated videos (PyAV) and a small probe the tests use to check the result.

H.264 (`libx264`) is preferred because every browser plays it; PyAV wheels from PyPI bundle it.
Builds without it fall back to MPEG-4 Part 2 (`mpeg4`), which players outside browsers handle.
Both use yuv420p, whose 2x2 chroma subsampling needs even dimensions, so odd sizes are padded by
repeating the last row/column (a black bar would show as an edge artefact).

A video with sound (joint audio-video families: LTX-2) gets an AAC track beside the picture (FFmpeg's native `aac`
encoder, in every PyAV build), cut or padded with silence to the picture's duration, so both streams end together.
"""

from __future__ import annotations

import io
import os
import tempfile
from fractions import Fraction
from typing import Any

import numpy as np
from PIL import Image

from diffuserve.errors import ConfigError, InvalidRequestError

#: Encoders to try, best first, with the options each one needs.
_CODEC_PREFERENCE: tuple[tuple[str, dict[str, str]], ...] = (
    # crf 18 is visually lossless for our outputs; `fast` keeps the encode short next to generation.
    ("libx264", {"crf": "18", "preset": "fast"}),
    ("mpeg4", {"qscale": "3"}),
)


def _pick_codec() -> tuple[str, dict[str, str]]:
    """The first available encoder from `_CODEC_PREFERENCE`."""
    import av  # here, not at module level: PyAV loads with the first video, not with the server (cold start)

    for name, options in _CODEC_PREFERENCE:
        try:
            av.Codec(name, "w")
        except Exception:  # PyAV raises UnknownCodecError (a ValueError subclass) or FFmpegError.
            continue
        return name, options
    raise ConfigError(
        "no MP4 video encoder available: this PyAV/FFmpeg build has neither 'libx264' (H.264) nor "
        "'mpeg4'; install the PyAV wheel from PyPI (`pip install av`), which bundles libx264"
    )


def _even_rgb(frame: Image.Image, width: int, height: int) -> Image.Image:
    """`frame` as RGB padded to `width` x `height` (each at most one more) by edge replication."""
    rgb = frame if frame.mode == "RGB" else frame.convert("RGB")
    if rgb.size == (width, height):
        return rgb
    w, h = rgb.size
    canvas = Image.new("RGB", (width, height))
    canvas.paste(rgb, (0, 0))
    if width > w:
        canvas.paste(rgb.crop((w - 1, 0, w, h)), (w, 0))
    if height > h:
        canvas.paste(canvas.crop((0, h - 1, width, h)), (0, h))
    return canvas


AUDIO_CODEC = "aac"
"""The sound track's encoder: AAC, which every MP4 player and browser plays."""
AUDIO_BIT_RATE = 128_000
"""Bits per second of the AAC track (transparent for a stereo track at 24-48 kHz)."""


def fit_audio(audio: Any, sample_rate: int, num_frames: int, fps: int) -> np.ndarray:
    """`audio` (channels, samples) as float32 in [-1, 1], cut or padded with silence to the duration of
    `num_frames` at `fps` (the pipeline's waveform can be a few samples longer or shorter than the picture: its
    audio latents are rounded to whole latent frames)."""
    if hasattr(audio, "detach"):  # a torch tensor (RequestOutput.audios), possibly bf16 or on a device
        audio = audio.detach().float().cpu().numpy()
    array = np.asarray(audio, dtype=np.float32)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[0] not in (1, 2):
        raise ValueError(f"audio must be (channels, samples) with 1 or 2 channels, got shape {array.shape}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise ValueError(f"audio sample rate must be a positive integer, got {sample_rate!r}")
    length = round(num_frames * sample_rate / fps)
    fitted = np.zeros((array.shape[0], length), dtype=np.float32)
    kept = min(length, array.shape[1])
    fitted[:, :kept] = np.clip(np.nan_to_num(array[:, :kept]), -1.0, 1.0)
    return fitted


def encode_mp4(frames: list[Image.Image], fps: int, audio: Any = None, sample_rate: int | None = None) -> bytes:
    """Encode `frames` (all the same size) as an MP4 at `fps` frames per second and return the bytes; with
    `audio` (a (channels, samples) float waveform in [-1, 1] at `sample_rate`, mono or stereo), the MP4 also
    carries it as an AAC track of the video's duration (`fit_audio`).

    Raises InvalidRequestError(param="fps") for a non-positive fps, ValueError for an empty frame
    list, mixed frame sizes or a malformed waveform (a pipeline bug, not user input), and ConfigError when no
    encoder is available.
    """
    if isinstance(fps, bool) or not isinstance(fps, int) or fps <= 0:
        raise InvalidRequestError(f"fps must be a positive integer, got {fps!r}", param="fps")
    if not frames:
        raise ValueError("encode_mp4 needs at least one frame")
    width, height = frames[0].size
    for index, frame in enumerate(frames):
        if frame.size != (width, height):
            raise ValueError(f"frame {index} is {frame.size[0]}x{frame.size[1]}, frame 0 is {width}x{height}")
    codec_name, options = _pick_codec()
    even_w, even_h = width + width % 2, height + height % 2
    sound = None if audio is None else (fit_audio(audio, sample_rate or 0, len(frames), fps), sample_rate or 0)

    # faststart moves the index to the front so a browser can start playing before the download ends.
    # The muxer does that in a second pass that reopens the output by name, so it cannot target a
    # BytesIO: write to a private temporary file and read it back.
    with tempfile.TemporaryDirectory(prefix="diffuserve-mp4-") as tmp:
        path = os.path.join(tmp, "out.mp4")
        _write_mp4(path, frames, fps, codec_name, options, even_w, even_h, sound)
        with open(path, "rb") as handle:
            return handle.read()


def _write_mp4(
    path: str,
    frames: list[Image.Image],
    fps: int,
    codec_name: str,
    options: dict[str, str],
    width: int,
    height: int,
    sound: tuple[np.ndarray, int] | None = None,
) -> None:
    """Encode `frames` (and the fitted waveform `sound`, with its rate) into the MP4 file at `path` (the body of
    `encode_mp4`)."""
    import av

    with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream(codec_name, rate=fps, options=options)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        if sound is not None:
            # Both streams go in before the first packet (the MP4 header lists them); the muxer interleaves them.
            _mux_audio(container, *sound)
        time_base = Fraction(1, fps)
        for index, frame in enumerate(frames):
            video_frame = av.VideoFrame.from_image(_even_rgb(frame, width, height))
            video_frame.pts = index
            video_frame.time_base = time_base
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode(None):  # flush the encoder's delayed frames
            container.mux(packet)


def _aac_rate(sample_rate: int) -> int:
    """The AAC track's rate: the waveform's own where AAC has it (LTX-2: 24 kHz), else the next higher AAC rate
    (the encoder's resampler converts the waveform to it)."""
    import av

    rates = sorted(av.Codec(AUDIO_CODEC, "w").audio_rates or ())
    if not rates or sample_rate in rates:
        return sample_rate
    return next((rate for rate in rates if rate >= sample_rate), rates[-1])


def _mux_audio(container: Any, waveform: np.ndarray, sample_rate: int) -> None:
    """Encode `waveform` (channels, samples) at `sample_rate` as the container's AAC track."""
    import av

    layout = "mono" if waveform.shape[0] == 1 else "stereo"
    stream = container.add_stream(AUDIO_CODEC, rate=_aac_rate(sample_rate), layout=layout)
    stream.bit_rate = AUDIO_BIT_RATE
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(waveform), format="fltp", layout=layout)
    frame.sample_rate, frame.pts, frame.time_base = sample_rate, 0, Fraction(1, sample_rate)
    # PyAV cuts the one frame into the encoder's 1024-sample frames (and resamples to the track's rate).
    for packet in [*stream.encode(frame), *stream.encode(None)]:
        container.mux(packet)


def probe_mp4(data: bytes) -> dict[str, Any]:
    """Decode an MP4 and describe its first video stream, and its sound track when it has one.

    Returns `{"frames": int, "fps": float, "width": int, "height": int, "codec": str, "video_streams": int,
    "audio": None | {"codec", "sample_rate", "channels", "samples", "seconds"}, "audio_streams": int}`; frames and
    audio samples are counted by decoding (the samples up to the end the track's edit list gives), so a file
    whose index disagrees with its content is caught.
    """
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise ValueError("no video stream in the MP4 data")
        stream = container.streams.video[0]
        num_frames = sum(1 for _ in container.decode(stream))
        rate = stream.average_rate or stream.base_rate or stream.guessed_rate
        info: dict[str, Any] = {
            "frames": num_frames,
            "fps": float(rate) if rate else 0.0,
            "width": stream.codec_context.width,
            "height": stream.codec_context.height,
            "codec": stream.codec_context.name,
            "video_streams": len(container.streams.video),
            "audio_streams": len(container.streams.audio),
            "audio": None,
        }
    if info["audio_streams"]:
        waveform, sample_rate, codec = _decode_audio(data)
        info["audio"] = {
            "codec": codec,
            "sample_rate": sample_rate,
            "channels": waveform.shape[0],
            "samples": waveform.shape[1],
            "seconds": waveform.shape[1] / sample_rate,
        }
    return info


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """The MP4's sound track as a float32 (channels, samples) waveform and its sample rate."""
    waveform, sample_rate, _ = _decode_audio(data)
    return waveform, sample_rate


def _decode_audio(data: bytes) -> tuple[np.ndarray, int, str]:
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream in the MP4 data")
        stream = container.streams.audio[0]
        chunks = [frame.to_ndarray() for frame in container.decode(stream)]
        channels = stream.codec_context.channels
        # Planar formats (AAC decodes to fltp) are (channels, n); packed ones (1, n * channels).
        parts = [c if c.shape[0] == channels else c.reshape(-1, channels).T for c in chunks]
        waveform = np.concatenate(parts, axis=1) if parts else np.zeros((channels, 0), np.float32)
        sample_rate = stream.codec_context.sample_rate
        if stream.duration is not None and stream.time_base is not None:
            # The decoder returns whole 1024-sample AAC frames; the track's edit list says where the sound ends
            # (what players honour), so the padding of the last frame is cut here too.
            waveform = waveform[:, : round(stream.duration * stream.time_base * sample_rate)]
        return waveform.astype(np.float32), sample_rate, stream.codec_context.name


def decode_frames(data: bytes) -> list[Image.Image]:
    """Every frame of an MP4 as RGB images, in order."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return [frame.to_image().convert("RGB") for frame in container.decode(video=0)]


SPRITESHEET_FRAMES = 16
"""At most this many evenly spaced frames go into a spritesheet."""
SPRITESHEET_COLUMNS = 4
"""Frames per row of a spritesheet."""


def thumbnail(data: bytes) -> bytes:
    """The video's first frame as WebP (the `thumbnail` variant, as OpenAI serves it)."""
    first = decode_frames(data)[0]
    buffer = io.BytesIO()
    first.save(buffer, format="WEBP", quality=90)
    return buffer.getvalue()


def spritesheet(data: bytes) -> bytes:
    """Up to SPRITESHEET_FRAMES evenly spaced frames in a grid of SPRITESHEET_COLUMNS, as JPEG (the
    `spritesheet` variant: a scrubbing preview in one image)."""
    frames = decode_frames(data)
    count = min(SPRITESHEET_FRAMES, len(frames))
    picked = [frames[round(i * (len(frames) - 1) / max(count - 1, 1))] for i in range(count)]
    columns = min(SPRITESHEET_COLUMNS, count)
    rows = -(-count // columns)
    width, height = picked[0].size
    sheet = Image.new("RGB", (columns * width, rows * height))
    for i, frame in enumerate(picked):
        sheet.paste(frame, ((i % columns) * width, (i // columns) * height))
    buffer = io.BytesIO()
    sheet.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()
