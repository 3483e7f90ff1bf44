"""MP4 encoding for generated videos (PyAV) and a small probe the tests use to check the result.

H.264 (`libx264`) is preferred because every browser plays it; PyAV wheels from PyPI bundle it.
Builds without it fall back to MPEG-4 Part 2 (`mpeg4`), which players outside browsers handle.
Both use yuv420p, whose 2x2 chroma subsampling needs even dimensions, so odd sizes are padded by
repeating the last row/column (a black bar would show as an edge artefact).
"""

from __future__ import annotations

import io
import os
import tempfile
from fractions import Fraction
from typing import Any

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


def encode_mp4(frames: list[Image.Image], fps: int) -> bytes:
    """Encode `frames` (all the same size) as an MP4 at `fps` frames per second and return the bytes.

    Raises InvalidRequestError(param="fps") for a non-positive fps, ValueError for an empty frame
    list or mixed frame sizes (a pipeline bug, not user input), and ConfigError when no encoder is
    available.
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

    # faststart moves the index to the front so a browser can start playing before the download ends.
    # The muxer does that in a second pass that reopens the output by name, so it cannot target a
    # BytesIO: write to a private temporary file and read it back.
    with tempfile.TemporaryDirectory(prefix="diffuserve-mp4-") as tmp:
        path = os.path.join(tmp, "out.mp4")
        _write_mp4(path, frames, fps, codec_name, options, even_w, even_h)
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
) -> None:
    """Encode `frames` into the MP4 file at `path` (the body of `encode_mp4`)."""
    import av

    with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream(codec_name, rate=fps, options=options)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        time_base = Fraction(1, fps)
        for index, frame in enumerate(frames):
            video_frame = av.VideoFrame.from_image(_even_rgb(frame, width, height))
            video_frame.pts = index
            video_frame.time_base = time_base
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode(None):  # flush the encoder's delayed frames
            container.mux(packet)


def probe_mp4(data: bytes) -> dict[str, Any]:
    """Decode an MP4 and describe its first video stream.

    Returns `{"frames": int, "fps": float, "width": int, "height": int, "codec": str}`; frames are
    counted by decoding, so a file whose index disagrees with its content is caught.
    """
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise ValueError("no video stream in the MP4 data")
        stream = container.streams.video[0]
        num_frames = sum(1 for _ in container.decode(stream))
        rate = stream.average_rate or stream.base_rate or stream.guessed_rate
        return {
            "frames": num_frames,
            "fps": float(rate) if rate else 0.0,
            "width": stream.codec_context.width,
            "height": stream.codec_context.height,
            "codec": stream.codec_context.name,
        }


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
