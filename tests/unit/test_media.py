"""Media encoding/decoding: outputs decode with Pillow/PyAV to the right size, count and rate."""

from __future__ import annotations

import io
import struct
import zlib

import av
import pytest
from PIL import Image

from diffuserve.errors import ConfigError, InvalidRequestError
from diffuserve.media import video
from diffuserve.media.images import decode_image, encode_image, mime_type
from diffuserve.media.video import encode_mp4, probe_mp4


def _gradient(width: int, height: int, mode: str = "RGB") -> Image.Image:
    pixels = bytes(
        v for y in range(height) for x in range(width) for v in ((x * 7) % 256, (y * 11) % 256, (x + y) % 256)
    )
    return Image.frombytes("RGB", (width, height), pixels).convert(mode)


# -- images -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "pil_format", "mime"),
    [("png", "PNG", "image/png"), ("jpeg", "JPEG", "image/jpeg"), ("webp", "WEBP", "image/webp")],
)
def test_encode_image_round_trips_with_pillow(fmt: str, pil_format: str, mime: str) -> None:
    data = encode_image(_gradient(48, 32), fmt, 90)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == pil_format
    assert decoded.size == (48, 32)
    assert mime_type(fmt) == mime


def test_png_is_lossless() -> None:
    source = _gradient(17, 9)
    decoded = Image.open(io.BytesIO(encode_image(source, "png", 1))).convert("RGB")
    assert decoded.tobytes() == source.tobytes()


def test_jpeg_flattens_rgba_over_white() -> None:
    image = Image.new("RGBA", (8, 8), (0, 0, 0, 0))  # fully transparent black
    decoded = Image.open(io.BytesIO(encode_image(image, "jpeg", 95)))
    assert decoded.mode == "RGB"
    r, g, b = decoded.getpixel((4, 4))
    assert min(r, g, b) > 240  # white background, not the hidden black


def test_webp_keeps_alpha() -> None:
    image = Image.new("RGBA", (8, 8), (10, 200, 30, 255))
    image.putpixel((0, 0), (0, 0, 0, 0))  # one transparent pixel: the alpha channel carries information
    decoded = Image.open(io.BytesIO(encode_image(image, "webp", 80)))
    assert decoded.mode == "RGBA"


def test_jpeg_quality_changes_size() -> None:
    source = _gradient(64, 64)
    assert len(encode_image(source, "jpeg", 10)) < len(encode_image(source, "jpeg", 95))


def test_jpg_alias_and_case() -> None:
    assert Image.open(io.BytesIO(encode_image(_gradient(4, 4), "JPG", 90))).format == "JPEG"
    assert mime_type("jpg") == "image/jpeg"


def test_unknown_format_names_output_format() -> None:
    with pytest.raises(InvalidRequestError) as info:
        encode_image(_gradient(4, 4), "gif", 90)
    assert info.value.param == "output_format"
    assert "png" in info.value.message


@pytest.mark.parametrize("quality", [0, 101, True, 50.5])
def test_bad_quality_names_output_quality(quality: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        encode_image(_gradient(4, 4), "jpeg", quality)  # type: ignore[arg-type]
    assert info.value.param == "output_quality"


def test_decode_image_round_trip_and_mode() -> None:
    decoded = decode_image(encode_image(_gradient(20, 10), "png", 90), max_pixels=10_000)
    assert decoded.size == (20, 10)
    assert decoded.mode == "RGB"
    with_alpha = decode_image(encode_image(_gradient(4, 4, "RGBA"), "png", 90), max_pixels=100)
    assert with_alpha.mode == "RGBA"


def test_decode_image_rejects_garbage_naming_param() -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_image(b"definitely not an image", max_pixels=10_000, param="mask")
    assert info.value.param == "mask"
    with pytest.raises(InvalidRequestError):
        decode_image(b"", max_pixels=10_000)


def test_decode_image_rejects_oversized_at_the_limit_edge() -> None:
    data = encode_image(_gradient(10, 10), "png", 90)
    assert decode_image(data, max_pixels=100).size == (10, 10)
    with pytest.raises(InvalidRequestError) as info:
        decode_image(data, max_pixels=99)
    assert info.value.param == "image"
    assert "10x10" in info.value.message


def _png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring a huge image with (almost) no pixel data behind it."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def test_decode_image_refuses_bomb_before_decoding() -> None:
    # 6000 x 6000 RGB would need ~100 MiB decoded from a ~100-byte file; our header check refuses it.
    with pytest.raises(InvalidRequestError) as info:
        decode_image(_png_bomb(6_000, 6_000), max_pixels=4096 * 4096)
    assert "6000x6000" in info.value.message
    # 60000 x 60000 trips Pillow's own hard limit at open(); still a clear 400, not a crash.
    with pytest.raises(InvalidRequestError) as info:
        decode_image(_png_bomb(60_000, 60_000), max_pixels=4096 * 4096, param="mask")
    assert info.value.param == "mask"
    assert "limit" in info.value.message


def test_decode_image_truncated_pixels() -> None:
    data = encode_image(_gradient(64, 64), "png", 90)
    with pytest.raises(InvalidRequestError) as info:
        decode_image(data[: len(data) // 2], max_pixels=1 << 20, param="image[0]")
    assert info.value.param == "image[0]"


# -- video --------------------------------------------------------------------------------------


def _frames(count: int, width: int, height: int) -> list[Image.Image]:
    return [Image.new("RGB", (width, height), (i * 20 % 256, 128, 255 - i * 20 % 256)) for i in range(count)]


def test_encode_mp4_decodes_with_pyav() -> None:
    data = encode_mp4(_frames(9, 32, 24), fps=8)
    info = probe_mp4(data)
    assert info["frames"] == 9
    assert info["fps"] == pytest.approx(8.0)
    assert (info["width"], info["height"]) == (32, 24)
    assert info["codec"] in ("h264", "mpeg4")
    # Independent check straight through PyAV: every frame decodes to the requested size.
    with av.open(io.BytesIO(data)) as container:
        sizes = {(f.width, f.height) for f in container.decode(video=0)}
    assert sizes == {(32, 24)}


def test_encode_mp4_pads_odd_sizes_to_even() -> None:
    info = probe_mp4(encode_mp4(_frames(3, 33, 17), fps=16))
    assert (info["width"], info["height"]) == (34, 18)
    assert info["frames"] == 3
    assert info["fps"] == pytest.approx(16.0)


def test_encode_mp4_single_frame_and_rgba() -> None:
    frames = [f.convert("RGBA") for f in _frames(1, 16, 16)]
    assert probe_mp4(encode_mp4(frames, fps=24))["frames"] == 1


def test_encode_mp4_pixels_survive() -> None:
    red = [Image.new("RGB", (32, 32), (220, 20, 20)) for _ in range(2)]
    with av.open(io.BytesIO(encode_mp4(red, fps=4))) as container:
        first = next(container.decode(video=0)).to_image()
    r, g, b = first.getpixel((16, 16))
    assert r > 180 and g < 60 and b < 60


def test_encode_mp4_rejects_bad_input() -> None:
    with pytest.raises(InvalidRequestError) as info:
        encode_mp4(_frames(2, 8, 8), fps=0)
    assert info.value.param == "fps"
    with pytest.raises(ValueError):
        encode_mp4([], fps=8)
    with pytest.raises(ValueError, match="frame 1"):
        encode_mp4([Image.new("RGB", (8, 8)), Image.new("RGB", (10, 8))], fps=8)


def test_missing_encoders_give_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video, "_CODEC_PREFERENCE", (("no-such-codec-x", {}),))
    with pytest.raises(ConfigError, match="libx264"):
        encode_mp4(_frames(1, 8, 8), fps=8)


def test_mpeg4_fallback_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video, "_CODEC_PREFERENCE", (("no-such-codec-x", {}), ("mpeg4", {"qscale": "3"})))
    info = probe_mp4(encode_mp4(_frames(4, 16, 16), fps=12))
    assert info["codec"] == "mpeg4"
    assert info["frames"] == 4


def test_encode_mp4_index_comes_first_for_streaming() -> None:
    # faststart: the `moov` index precedes the `mdat` payload, so playback can start mid-download.
    data = encode_mp4(_frames(4, 16, 16), fps=8)
    assert 0 <= data.find(b"moov") < data.find(b"mdat")
