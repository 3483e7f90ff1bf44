"""The CLI's messages and help after the first hour (issue 22 item 7): one line and exit 2 for a bad make-tiny
--output, a missing --model-path, a TOML --config; generate's help only shows what generate uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diffuserve import cli


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def test_make_tiny_output_onto_a_file_or_unwritable_path(tmp_path: Path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = _run(["make-tiny", "--output", str(afile)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--output" in err and "is a file" in err, err
    under_file = afile / "ckpt"
    code, err = _run(["make-tiny", "--output", str(under_file)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cannot write" in err, err


def test_plan_and_serve_refuse_a_missing_folder_alike(tmp_path: Path, capsys):
    missing = str(tmp_path / "nope")
    code, plan_err = _run(["plan", "--model-path", missing], capsys)
    serve = subprocess.run(
        [sys.executable, "-m", "diffuserve.cli", "serve", "--model-path", missing, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert code == serve.returncode == 2, (plan_err, serve.stderr)
    assert plan_err.split(": ", 2)[2] == serve.stderr.split(": ", 2)[2], (plan_err, serve.stderr)


@pytest.mark.parametrize("name", ["serve.toml", "pyproject.toml"])
def test_toml_config_is_refused_naming_json_or_yaml(tmp_path: Path, capsys, name: str):
    (tmp_path / name).write_text("port = 8000\n")
    code, err = _run(["plan", "--config", str(tmp_path / name)], capsys)
    assert code == 2 and "use JSON or YAML" in err, err


def test_help_shows_what_each_command_uses(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert "images or videos" in top
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    gen = capsys.readouterr().out
    assert "--served-model-name" not in gen and '"port"' not in gen
    assert [
        line for line in gen.splitlines() if "batching" in line.lower() and line.endswith(":") and line[:1].isupper()
    ] == ["Batching:"]
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    serve = capsys.readouterr().out
    assert "Dynamic batching:" not in serve and "Batching:" in serve and "continuous" in serve


def test_default_results_folder_is_keyed_by_the_served_model(monkeypatch, tmp_path: Path):
    from diffuserve.config.server_args import ServerArgs

    monkeypatch.setenv("DIFFUSERVE_CACHE", str(tmp_path))
    image = ServerArgs(model_path="/ckpt/flux/").resolved_output_dir()
    video = ServerArgs(model_path="/ckpt/wan", served_model_name="wan video/v2").resolved_output_dir()
    assert image == tmp_path / "outputs" / "flux" and video == tmp_path / "outputs" / "wan_video_v2"
    assert ServerArgs(output_dir=str(tmp_path / "mine")).resolved_output_dir() == tmp_path / "mine"
