"""`diffuserve generate` with input images (`--image-path`, `--strength`) and the API's validation of every value,
before the model loads (exit 2 naming the flag). Run in process through `cli.main`; "before the model loads" is
checked by making `build_generate_engine` (where the model would load) fail the test if it is reached."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffuserve import cli


def _png(path: Path, width: int = 48, height: int = 32) -> Path:
    Image.fromarray((np.random.RandomState(0).rand(height, width, 3) * 255).astype("uint8")).save(path, "PNG")
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if `generate` gets as far as loading the model."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("diffuserve.launch.root.build_generate_engine", refuse)


def _generate(capsys, model: Path, out: Path, *flags: str) -> tuple[int, str, str]:
    code = cli.main(["generate", "--model-path", str(model), "--output-path", str(out), *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("flags", "named", "says"),
    [
        (["--prompt", "   "], "--prompt", "must not be empty"),
        (["--prompt", "x", "--num-inference-steps", "0"], "--num-inference-steps", "greater than or equal to 1"),
        (["--prompt", "x", "--seed", "-1"], "--seed", "greater than or equal to 0"),
        (["--prompt", "x", "--guidance-scale", "1000"], "--guidance-scale", "less than or equal to 100"),
        (["--prompt", "x", "--width", "40"], "--width 40", "multiple of 16"),
        (["--prompt", "x", "--strength", "0.5"], "--strength", "applies to image edits"),
        (["--prompt", "x", "--image-path", "/nonexistent/in.png"], "--image-path /nonexistent/in.png", "cannot read"),
    ],
)
def test_generate_checks_values_as_the_api_before_loading(
    tiny_flux_path, tmp_path, capsys, no_load, flags, named, says
):
    code, _, err = _generate(capsys, tiny_flux_path, tmp_path / "out", *flags)
    assert code == 2 and named in err and says in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_generate_refuses_a_non_image_and_a_bad_strength_as_the_edit_api(tiny_flux_path, tmp_path, capsys, no_load):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    code, _, err = _generate(capsys, tiny_flux_path, tmp_path / "out", "--prompt", "x", "--image-path", str(text))
    assert code == 2 and f"--image-path {text}" in err and "image" in err, err
    code, _, err = _generate(
        capsys,
        tiny_flux_path,
        tmp_path / "out",
        "--prompt",
        "x",
        "--image-path",
        str(_png(tmp_path / "in.png")),
        "--strength",
        "1.5",
    )
    assert code == 2 and "--strength" in err and "less than or equal to 1" in err, err


def test_a_text_only_model_given_an_image_is_exit_2_naming_the_flag(tiny_wan_path, tmp_path, capsys, no_load):
    code, _, err = _generate(
        capsys, tiny_wan_path, tmp_path / "out", "--prompt", "x", "--image-path", str(_png(tmp_path / "in.png"))
    )
    assert code == 2 and "--image-path" in err and "takes no input image" in err, err


def test_an_image_to_video_model_needs_its_image(tiny_checkpoint, tmp_path, capsys, no_load):
    code, _, err = _generate(capsys, tiny_checkpoint("wan-i2v"), tmp_path / "out", "--prompt", "x")
    assert code == 2 and "--image-path" in err and "needs 1 input image" in err, err


def test_generate_edits_an_input_image_at_its_size(tiny_flux_path, tmp_path, capsys):
    source = _png(tmp_path / "in.png", 48, 32)
    code, out, err = _generate(
        capsys,
        tiny_flux_path,
        tmp_path / "out",
        "--prompt",
        "make it blue",
        "--image-path",
        str(source),
        "--strength",
        "0.5",
        "--num-inference-steps",
        "2",
        "--output-file-name",
        "edited",
    )
    assert code == 0, err
    written = Path(out.strip().splitlines()[-1])
    assert written.name == "edited.png" and Image.open(io.BytesIO(written.read_bytes())).size == (48, 32)


def test_generate_image_to_video_from_an_image(tiny_checkpoint, tmp_path, capsys):
    from diffuserve.media.video import probe_mp4

    code, out, err = _generate(
        capsys,
        tiny_checkpoint("wan-i2v"),
        tmp_path / "out",
        "--prompt",
        "a cat",
        "--image-path",
        str(_png(tmp_path / "in.png", 32, 32)),
        "--num-inference-steps",
        "2",
        "--width",
        "32",
        "--height",
        "32",
        "--num-frames",
        "5",
    )
    assert code == 0, err
    info = probe_mp4(Path(out.strip().splitlines()[-1]).read_bytes())
    assert (info["width"], info["height"], info["frames"]) == (32, 32, 5)
