"""Registry: class name / model id -> family, and backend selection. No weights, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffuserve.errors import CheckpointError, ConfigError
from diffuserve.models import registry


def _folder(tmp_path: Path, class_name: str, **components) -> Path:
    index = {"_class_name": class_name, "_diffusers_version": "0.42.1", **components}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    return tmp_path


@pytest.mark.parametrize(
    ("class_name", "family"),
    [
        ("FluxPipeline", "flux"),
        ("QwenImagePipeline", "qwen_image"),
        ("WanPipeline", "wan"),
        ("StableDiffusion3Pipeline", "sd3"),
        ("SomeCustomPipeline", None),
    ],
)
def test_family_from_class(class_name: str, family: str | None) -> None:
    assert registry.family_from_class(class_name) == family


@pytest.mark.parametrize(
    ("model_id", "family"),
    [
        ("black-forest-labs/FLUX.1-dev", "flux"),
        ("FLUX.1-schnell", "flux"),
        ("black-forest-labs/FLUX.1-Kontext-dev", "flux_kontext"),
        ("black-forest-labs/FLUX.2-dev", "flux2"),
        ("Qwen/Qwen-Image-Edit", "qwen_image_edit"),
        ("Qwen/Qwen-Image", "qwen_image"),
        ("Wan-AI/Wan2.1-T2V-1.3B", "wan"),
        ("Wan-AI/Wan2.1-I2V-14B-480P", "wan_i2v"),
        ("stabilityai/stable-diffusion-3.5-medium", "sd3"),
        ("my-own-model", None),
    ],
)
def test_family_from_model_id(model_id: str, family: str | None) -> None:
    assert registry.family_from_model_id(model_id) == family


def test_resolve_reads_components_and_prefers_native(tmp_path: Path) -> None:
    folder = _folder(
        tmp_path,
        "FluxPipeline",
        vae=["diffusers", "AutoencoderKL"],
        tokenizer=["transformers", "CLIPTokenizer"],
        image_encoder=[None, None],
    )
    spec = registry.resolve_model(folder)
    assert (spec.family, spec.pipeline_class, spec.backend) == ("flux", "FluxPipeline", "native")
    assert spec.components == {
        "vae": ("diffusers", "AutoencoderKL"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
    }
    assert registry.resolve_model(folder, backend="diffusers").backend == "diffusers"
    assert registry.resolve_model(folder, backend="native").backend == "native"


def test_class_name_wins_over_model_id_hint(tmp_path: Path) -> None:
    spec = registry.resolve_model(_folder(tmp_path, "WanPipeline"), model_id="FLUX.1-dev")
    assert spec.family == "wan" and spec.output_kind == "video"


def test_model_id_hint_names_unknown_class(tmp_path: Path) -> None:
    spec = registry.resolve_model(_folder(tmp_path, "MyFluxVariantPipeline"), model_id="black-forest-labs/FLUX.1-dev")
    assert spec.family == "flux" and spec.backend == "native"
    assert registry.resolve_model(_folder(tmp_path, "MyFluxVariantPipeline")).family == "unknown"


def test_auto_falls_back_to_diffusers_without_native_adapter(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(registry, "native_families", lambda: {"flux": "x:y"})
    folder = _folder(tmp_path, "SomeCustomPipeline")
    assert registry.resolve_model(folder).backend == "diffusers"
    with pytest.raises(ConfigError, match="--backend native") as err:
        registry.resolve_model(folder, backend="native")
    assert err.value.param == "backend"
    assert "--backend auto or --backend diffusers" in err.value.message


def test_unknown_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--backend 'onnx'"):
        registry.resolve_model(_folder(tmp_path, "FluxPipeline"), backend="onnx")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "has no model_index.json"),
        ("[1, 2", "not valid JSON"),
        ('{"vae": ["diffusers", "AutoencoderKL"]}', "no string `_class_name`"),
    ],
)
def test_bad_model_index(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "model_index.json").write_text(content)
    with pytest.raises(CheckpointError, match=message) as err:
        registry.resolve_model(tmp_path)
    assert str(tmp_path) in err.value.message


def test_registry_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, diffuserve.models.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
