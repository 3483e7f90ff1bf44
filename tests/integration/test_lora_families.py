"""Per-request LoRA on the tiny checkpoint of every native family besides FLUX.1 (test_lora.py): random adapters
written by `make-tiny-lora` for that family, read through its diffusers `*LoraLoaderMixin`, applied per row.

The bars (issue 20), per family: a request alone equals diffusers' own pipeline after `load_lora_weights` +
`set_adapters(names, adapter_weights=...)` on the same checkpoint and seed (<= 3/255 max, <= 0.5/255 mean), and
rows with different adapters (and none) in one batch, or in a continuous group that requests with other adapters
join mid-run, equal their singletons (<= 1/255). Wan2.2 A14B: one adapter
goes into `transformer` and one into `transformer_2`, as diffusers' `load_into_transformer_2=True` puts it.
Wan2.1's second adapter is a community file (original `diffusion_model.*` keys) that diffusers converts. HunyuanVideo
1.5's pipeline has no LoRA mixin in diffusers 0.42: its reference loads through the family's loader and the
transformer's own `load_lora_adapter` / `set_adapters`.
The calls and requests are the family conformance suite's (family_conformance.py / family_references.py), made
small: one output, two steps (Wan: three).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diffuserve.sampling import SamplingParams
from tests.integration.family_checks import simulate_steps
from tests.integration.family_conformance import BY_ID, FamilyCase
from tests.integration.family_references import (
    Subject,
    flux2_on_same_modules,
    flux2_reference,
    outputs_of,
    qwen_on_same_modules,
    qwen_reference,
)

FAMILIES = (
    "flux2-klein",
    "qwen-image",
    "qwen-image-edit",
    "z-image",
    "sd3",
    "sana",
    "wan",
    "wan2.2",
    "ltx2",
    "hunyuan-video-1.5",
)


def _adapters(case: FamilyCase, path: Path, root: Path) -> dict[str, tuple[str, Path]]:
    """name -> (denoiser, folder): a rank-4 adapter on the attention projections and a rank-2 one (alpha 4) on
    to_q / to_v; for Wan2.2 A14B the second goes into the low-noise expert `transformer_2`."""
    from diffuserve.lora.tiny import DEFAULT_LORA_TARGETS, write_random_lora

    second = "transformer_2" if case.id == "wan2.2" else "transformer"
    # The tiny ERNIE DiT's output layer (and its blocks' gates) start at zero: only an adapter there shows.
    extra = ("final_linear",) if case.id == "ernie" else ()
    ink = write_random_lora(
        path, root / "ink", rank=2, alpha=4, seed=2, targets=("to_q", "to_v", *extra), component=second
    )
    if case.id == "wan":  # a community file: the original Wan keys, which diffusers converts
        ink = _as_wan_original(ink, root / "ink-original.safetensors", alpha=4)
    style = write_random_lora(path, root / "style", rank=4, seed=1, targets=(*DEFAULT_LORA_TARGETS, *extra))
    return {"style": ("transformer", style), "ink": (second, ink)}


def _as_wan_original(folder: Path, out: Path, *, alpha: float) -> Path:
    """The adapter in `folder` rewritten in the original Wan community format (`diffusion_model.*` keys,
    lora_down / lora_up, an alpha per module), which diffusers' WanLoraLoaderMixin converts (folding alpha in)."""
    from safetensors.torch import load_file, save_file

    names = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
    pattern = r"transformer\.blocks\.(\d+)\.(attn\d)\.(.+)\.lora_(A|B)\.weight"
    state: dict[str, Any] = {}
    for key, tensor in load_file(folder / "pytorch_lora_weights.safetensors").items():
        match = re.fullmatch(pattern, key)
        assert match is not None, key
        block, attn, proj, kind = match.groups()
        base = f"diffusion_model.blocks.{block}.{names[attn]}.{names[proj]}"
        state[f"{base}.lora_{'down' if kind == 'A' else 'up'}.weight"] = tensor
        state[f"{base}.alpha"] = torch.tensor(alpha)
    save_file(state, out)
    return out


def _reference(case: FamilyCase, path: Path, adapters: dict[str, tuple[str, Path]]) -> tuple[Subject, Any]:
    """The family's diffusers pipeline (as the conformance suite builds it) with the adapters loaded by diffusers."""
    import diffusers

    from diffuserve.models.loader import load_pipeline
    from diffuserve.models.processor_substitutes import install_processor_substitutes

    other = None
    if case.reference in (flux2_reference, qwen_reference):  # diffusers' pipeline on a loaded copy's modules
        other = load_pipeline(path)
        pipe = (flux2_on_same_modules if case.reference is flux2_reference else qwen_on_same_modules)(other)
    else:
        install_processor_substitutes()
        class_name = json.loads((path / "model_index.json").read_text())["_class_name"]
        pipe = getattr(diffusers, class_name).from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if not hasattr(pipe, "load_lora_weights"):
        # HunyuanVideo 1.5's pipeline has no LoRA mixin in diffusers 0.42: its family's loader reads the file and
        # the transformer's own PEFT methods load and weight the adapters, as the mixin would.
        from diffusers import loaders

        from diffuserve.lora.files import lora_loader

        mixin = getattr(loaders, lora_loader(case.family))
        for name, (_, folder) in adapters.items():
            state, metadata = mixin.lora_state_dict(str(folder), return_lora_metadata=True)
            pipe.transformer.load_lora_adapter(state, adapter_name=name, prefix="transformer", metadata=metadata)
        pipe.set_adapters = lambda names, adapter_weights=None: pipe.transformer.set_adapters(names, adapter_weights)
        return Subject(native=other, path=path, diffusers=lambda _cls, _path: pipe), pipe
    for name, (denoiser, folder) in adapters.items():
        extra = {"load_into_transformer_2": True} if denoiser == "transformer_2" else {}
        pipe.load_lora_weights(str(folder), adapter_name=name, **extra)
    return Subject(native=other, path=path, diffusers=lambda _cls, _path: pipe), pipe


def _requests(case: FamilyCase) -> list[dict[str, Any]]:
    """Three small requests of one signature: the family's reference request (one output, few steps), and two
    with other prompts and seeds."""
    fields = {**case.reference_params[0][1], "n": 1}
    if case.output == "image":
        fields["num_inference_steps"] = 2
    return [fields, {**fields, "seed": 21, "prompt": "a dog"}, {**fields, "seed": 22, "prompt": "a red house at night"}]


def _px(output: Any) -> np.ndarray:
    return (
        np.stack([np.asarray(frame) for frame in output]).astype(np.int16)
        if isinstance(output, list)
        else (np.asarray(output).astype(np.int16))
    )


def _diff(a: Any, b: Any) -> tuple[int, float]:
    d = np.abs(_px(a) - _px(b))
    return int(d.max()), float(d.mean())


@pytest.mark.parametrize("case_id", FAMILIES)
def test_family_lora_matches_diffusers_and_batches(case_id: str, tiny_checkpoint, tmp_path: Path) -> None:

    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline

    case = BY_ID[case_id]
    path = tiny_checkpoint(case.tiny)
    adapters = _adapters(case, path, tmp_path)
    native = load_pipeline(path)
    specs = {n: (str(p) if d == "transformer" else f"{d}:{p}") for n, (d, p) in adapters.items()}
    install_lora(native, native.family, specs, max_loras=3, max_rank=4, device="cpu", dtype=torch.float32)
    assert native.lora is not None and native.lora.layers > 0
    first, second, third = _requests(case)

    def params(fields: dict[str, Any], lora: tuple[tuple[str, float], ...]) -> SamplingParams:
        return case.build_params(native, {**fields, "lora": lora})

    # A request alone equals diffusers after load_lora_weights + set_adapters (two adapters, summed).
    alone = params(first, (("style", 0.8), ("ink", 1.2)))
    ours = outputs_of(native, native.run([alone]).outputs[0])[0]
    subject, pipe = _reference(case, path, adapters)
    pipe.set_adapters(["style", "ink"], adapter_weights=[0.8, 1.2])
    worst, mean = _diff(ours, case.reference(subject, alone)[0])
    assert worst <= 3 and mean <= 0.5, (worst, mean)
    base = outputs_of(native, native.run([params(first, ())]).outputs[0])[0]
    assert _diff(ours, base)[0] > 3, "the adapters changed nothing: the test would not see a broken path"

    # Rows with different adapters (and none) in one call equal each request alone.
    batch = [params(first, (("style", 0.8), ("ink", 1.2))), params(second, ()), params(third, (("ink", -0.7),))]
    singles = [ours] + [outputs_of(native, native.run([request]).outputs[0])[0] for request in batch[1:]]
    merged = native.run(batch).outputs
    for request, out, single in zip(batch, merged, singles, strict=True):
        assert _diff(outputs_of(native, out)[0], single)[0] <= 1, request.lora
    if case.continuous:  # and in a continuous group that two requests with other adapters join after one step
        stepped = simulate_steps(native, {0: batch[:1], 1: batch[1:]})
        for index, single in enumerate(singles):
            assert _diff(stepped[index][0], single)[0] <= 1, ("continuous", batch[index].lora)


def test_diffusers_backend_runs_one_adapter_set_per_call(tiny_checkpoint, tmp_path: Path) -> None:
    """ERNIE-Image runs on the diffusers backend only: the pipeline loads the adapters itself, and a batch whose
    requests name different adapter sets runs one diffusers call per set (`set_adapters`), each request as alone."""
    from diffuserve.lora.slots import install_lora
    from diffuserve.models.loader import load_pipeline

    case = BY_ID["ernie"]
    path = tiny_checkpoint(case.tiny)
    adapters = _adapters(case, path, tmp_path)
    served = load_pipeline(path)
    assert type(served).__name__ == "DiffusersBackendPipeline"
    specs = {name: str(folder) for name, (_, folder) in adapters.items()}
    assert (
        install_lora(served, served.family, specs, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32) is None
    )
    first, second, third = _requests(case)
    batch = [
        case.build_params(served, {**first, "lora": (("style", 0.8), ("ink", 1.2))}),
        case.build_params(served, {**second, "lora": ()}),
        case.build_params(served, {**third, "lora": (("ink", -0.7),)}),
    ]
    singles = [served.run([request]).outputs[0].images[0] for request in batch]
    subject, pipe = _reference(case, path, adapters)
    pipe.set_adapters(["style", "ink"], adapter_weights=[0.8, 1.2])
    worst, mean = _diff(singles[0], case.reference(subject, batch[0])[0])
    assert worst <= 3 and mean <= 0.5, (worst, mean)
    assert _diff(singles[0], served.run([dataclasses.replace(batch[0], lora=())]).outputs[0].images[0])[0] > 3
    for request, out, single in zip(batch, served.run(batch).outputs, singles, strict=True):
        assert _diff(out.images[0], single)[0] <= 1, request.lora


def test_families_without_a_lora_loader_are_refused_naming_the_family() -> None:
    from diffuserve.errors import ConfigError
    from diffuserve.lora.files import lora_loader
    from diffuserve.pipelines.diffusers_backend import DiffusersBackendPipeline

    with pytest.raises(ConfigError, match="hunyuan3d family"):
        lora_loader("hunyuan3d")
    backend = object.__new__(DiffusersBackendPipeline)  # a pipeline class with no load_lora_weights (GLM-Image's)
    backend.pipe, backend.family = object(), "glm_image"
    with pytest.raises(ConfigError, match="glm_image family's diffusers pipeline"):
        backend.load_lora_adapters({"style": "/adapters/style"})


def test_a_path_names_the_denoiser_it_adapts() -> None:
    from diffuserve.errors import ConfigError
    from diffuserve.lora.files import split_target

    experts = ("transformer", "transformer_2")
    assert split_target("/adapters/high", experts) == ("transformer", "/adapters/high")
    assert split_target("transformer_2:/adapters/low", experts) == ("transformer_2", "/adapters/low")
    assert split_target("transformer:/adapters/high", experts) == ("transformer", "/adapters/high")
    with pytest.raises(ConfigError, match="does not have"):
        split_target("transformer_2:/adapters/low", ("transformer",))
