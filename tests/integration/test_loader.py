"""The loader on the tiny checkpoint: good loads, deterministic builds, and each way a copy can be broken."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from diffuserve.errors import CheckpointError, ConfigError
from diffuserve.models import tiny
from diffuserve.models.loader import load_pipeline


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture()
def broken(tiny_flux_path: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint for a test to break."""
    return Path(shutil.copytree(tiny_flux_path, tmp_path / "ckpt"))


def test_loads_native_by_default(tiny_flux_path: Path) -> None:
    from diffuserve.families.flux.adapter import FluxAdapter

    pipe = load_pipeline(tiny_flux_path)
    assert isinstance(pipe.adapter, FluxAdapter)
    assert pipe.describe()["components"] == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert not any(p.requires_grad for m in pipe.components.values() for p in m.parameters())


def test_tokenizers_reload_with_real_classes(tiny_flux_path: Path) -> None:
    from transformers import CLIPTokenizer, T5Tokenizer

    clip = CLIPTokenizer.from_pretrained(tiny_flux_path / "tokenizer", local_files_only=True)
    t5 = T5Tokenizer.from_pretrained(tiny_flux_path / "tokenizer_2", local_files_only=True)
    fresh_clip, fresh_t5 = tiny.build_tokenizers()
    for prompt in ("a cat surfing a wave", "Ünïcödé & 123!"):
        assert clip(prompt).input_ids == fresh_clip(prompt).input_ids
        assert t5(prompt).input_ids == fresh_t5(prompt).input_ids
    # Real enough that different prompts give different ids, with no unknown tokens for ASCII text.
    assert clip("a cat").input_ids != clip("a dog").input_ids
    assert t5("a cat").input_ids != t5("a dog").input_ids
    assert t5.unk_token_id not in t5("The quick brown fox, 42!").input_ids
    assert len(clip) > 500 and len(t5) > 300


def test_same_bytes_every_build(tiny_flux_path: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny_checkpoint("flux", tmp_path / "again", preset="tiny")
    assert _digest(again) == _digest(tiny_flux_path)


def test_default_model_cache_holds_the_shipped_demo_checkpoint(tmp_path: Path) -> None:
    path = tiny.ensure_default_model(tmp_path / "cache")
    assert path == tmp_path / "cache" / "models" / tiny.DEFAULT_MODEL_NAME
    assert _digest(path) == _digest(tiny.DEMO_CHECKPOINT)
    # A second call reuses it, and no temporary build folder is left beside it.
    stamp = (path / "model_index.json").stat().st_mtime_ns
    assert tiny.ensure_default_model(tmp_path / "cache") == path
    assert (path / "model_index.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in path.parent.iterdir()) == [tiny.DEFAULT_MODEL_NAME]


def test_default_model_race_keeps_the_winner(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "models" / tiny.DEFAULT_MODEL_NAME

    def install_while_another_process_wins(output_dir: Path) -> Path:
        shutil.copytree(tiny.DEMO_CHECKPOINT, target)  # the other process renames its copy into place first
        (Path(output_dir) / "model_index.json").write_text("{}")
        return Path(output_dir)

    monkeypatch.setattr(tiny, "install_demo_checkpoint", install_while_another_process_wins)
    monkeypatch.setenv("DIFFUSERVE_CACHE", str(tmp_path))
    assert tiny.ensure_default_model() == target
    assert _digest(target) == _digest(tiny.DEMO_CHECKPOINT)
    assert sorted(p.name for p in target.parent.iterdir()) == [tiny.DEFAULT_MODEL_NAME]


def test_bad_flags_name_the_flag(tiny_flux_path: Path) -> None:
    with pytest.raises(ConfigError, match="--dtype"):
        load_pipeline(tiny_flux_path, dtype="float8")
    with pytest.raises(ConfigError, match="--backend"):
        load_pipeline(tiny_flux_path, backend="tensorrt")
    with pytest.raises(ConfigError, match="--device"):
        load_pipeline(tiny_flux_path, device="nonsense")


def _break(folder: Path, how: str) -> str:
    """Break the copy `how`; returns a regex the error message must match."""
    if how == "no-index":
        (folder / "model_index.json").unlink()
        return "has no model_index.json"
    if how == "bad-index":
        (folder / "model_index.json").write_text("{not json")
        return "model_index.json is not valid JSON"
    if how == "missing-component":
        shutil.rmtree(folder / "vae")
        return r"component 'vae' .*folder .*vae is missing"
    if how == "missing-weights":
        (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
        return r"component 'transformer' has no weights in .*transformer"
    if how == "bad-config":
        (folder / "text_encoder" / "config.json").write_text('{"hidden_size": 32,')
        return r"text_encoder/config.json is not valid JSON"
    if how == "unknown-class":
        index = json.loads((folder / "model_index.json").read_text())
        index["vae"] = ["diffusers", "AutoencoderDoesNotExist"]
        (folder / "model_index.json").write_text(json.dumps(index))
        return r"component 'vae' names class diffusers.AutoencoderDoesNotExist"
    if how == "empty-tokenizer":
        for f in (folder / "tokenizer_2").iterdir():
            f.unlink()
        return r"tokenizer folder .*tokenizer_2 has none of the tokenizer files"
    if how == "near-empty-tokenizer":
        # Files present but the vocabulary is gone: what transformers builds from nothing.
        from transformers import CLIPTokenizer

        shutil.rmtree(folder / "tokenizer")
        CLIPTokenizer().save_pretrained(folder / "tokenizer")
        return r"tokenizer .*tokenizer has only \d+ entries but its text encoder expects a vocabulary of \d+"
    if how == "index-lacks-component":
        index = json.loads((folder / "model_index.json").read_text())
        del index["text_encoder_2"]
        (folder / "model_index.json").write_text(json.dumps(index))
        return r"(lacks \['text_encoder_2'\]|diffusers could not load it)"
    if how == "bad-weights":
        (folder / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"garbage")
        return r"(cannot load component 'vae' \(AutoencoderKL\)|diffusers could not load it).*vae"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "no-index",
        "bad-index",
        "missing-component",
        "missing-weights",
        "bad-config",
        "unknown-class",
        "empty-tokenizer",
        "near-empty-tokenizer",
        "bad-weights",
        "index-lacks-component",
    ],
)
@pytest.mark.parametrize("backend", ["native", "diffusers"])
def test_broken_checkpoint_names_folder_and_part(broken: Path, how: str, backend: str) -> None:
    pattern = _break(broken, how)
    with pytest.raises(CheckpointError, match=pattern) as err:
        load_pipeline(broken, backend=backend)
    assert str(broken) in err.value.message


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a folder"):
        load_pipeline(tmp_path / "nope")


def test_unknown_class_that_diffusers_cannot_load_names_class_and_native_families(tmp_path: Path) -> None:
    """A class with no native adapter that diffusers cannot load fails at start-up naming the class and
    listing the native families (with the --model-id way out)."""
    (tmp_path / "model_index.json").write_text('{"_class_name": "MyStudioPipeline", "_diffusers_version": "0.42.1"}')
    with pytest.raises(CheckpointError) as err:
        load_pipeline(tmp_path)
    message = err.value.message
    assert "'MyStudioPipeline'" in message and "Native families:" in message and "flux" in message
    assert "--model-id" in message
