"""Meta-device components: build a model with no storage, then read its weights (or this rank's shards).

`load_pipeline(..., placement="meta")` builds a component from its config alone: parameters on the meta
device (no memory, no file read), buffers that the constructor computes (rotary tables and the like) real,
because a checkpoint does not hold them. A parallel layer then decides where each weight lives — FSDP2's
`fully_shard` or DTensor's `parallelize_module` turn the meta parameters into DTensors whose placements say
which slice this rank holds — and `materialize_module` gives every meta tensor storage on the device and
reads exactly that slice from the safetensors files (`safe_open(...).get_slice`), so no rank ever holds, or
reads, the full model. A plain (unsharded) meta module is read whole the same way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from diffuserve.errors import CheckpointError

logger = logging.getLogger(__name__)


def meta_module(cls: type, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """`cls` (a diffusers or transformers model class) built from `folder`'s config with its parameters on
    the meta device, in `dtype`. Buffers stay real: the constructor computes them, the files lack them."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "load_config"):  # diffusers ModelMixin
            module = cls.from_config(cls.load_config(folder))
        else:  # transformers PreTrainedModel
            config = cls.config_class.from_pretrained(folder, local_files_only=True)
            module = cls._from_config(config, dtype=dtype)
    # As from_pretrained does: parameters in `dtype`, except those the class keeps in float32.
    keep_fp32 = getattr(module, "_keep_in_fp32_modules", None) or ()
    for name, param in module.named_parameters():
        target = torch.float32 if any(k in name.split(".") for k in keep_fp32) else dtype
        if param.is_floating_point() and param.dtype != target:
            param.data = param.data.to(target)  # free on meta: no storage behind it
    return module.eval().requires_grad_(False)


def is_meta(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of `module` still has no storage."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file in `folder` that holds it (sharded checkpoints via their index)."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    if not files:
        raise CheckpointError(
            f"{folder}: no *.safetensors weights to materialize a meta module from; "
            "meta placement reads safetensors only (convert *.bin checkpoints)."
        )
    return files


def local_slices(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The slice of the full tensor this rank holds when `tensor` is a DTensor (FSDP2 or TP), else None."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _tie_groups(module: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """Places that hold the same parameter object (tied weights), so ties survive `to_empty`."""
    by_id: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                by_id.setdefault(id(param), []).append((sub, name))
    return [refs for refs in by_id.values() if len(refs) > 1]


def materialize_module(module: torch.nn.Module, folder: str | Path, *, device: torch.device | str) -> int:
    """Give every tensor of `module` storage on `device` and read the meta ones from `folder`'s safetensors.

    A DTensor parameter (after `fully_shard` or `parallelize_module`) reads only this rank's slice; a plain
    one reads the whole tensor. Tensors that already had storage (constructor-computed buffers) keep their
    values. Returns the bytes read from the files. Raises CheckpointError naming tensors the files lack.
    """
    from safetensors import safe_open

    folder = Path(folder)
    kept = {name: t.detach().clone() for name, t in _state(module) if not t.is_meta}
    ties = _tie_groups(module)
    module.to_empty(device=device)
    for refs in ties:  # to_empty gives each holder its own tensor; make them one again
        first = getattr(*refs[0])
        for sub, name in refs[1:]:
            sub._parameters[name] = first
    if hasattr(module, "tie_weights"):
        # transformers ties declared weights (T5's shared embedding) at load, not at construction.
        module.tie_weights()
    files = weight_files(folder)
    missing = [name for name, _ in _state(module) if name not in kept and name not in files]
    if missing:
        raise CheckpointError(
            f"{folder}: the safetensors files lack {len(missing)} tensor(s) of "
            f"{type(module).__name__}: {', '.join(missing[:8])}; the checkpoint does not "
            "match its config."
        )
    read = 0
    handles: dict[Path, Any] = {}
    try:
        with torch.no_grad():
            for name, tensor in _state(module):
                if name in kept:
                    tensor.copy_(kept[name])
                    continue
                path = files[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt")
                read += _read_into(handles[path], name, tensor)
    finally:
        handles.clear()
    logger.info("materialized %s on %s from %s: %.2f MiB read", type(module).__name__, device, folder, read / (1 << 20))
    return read


def _state(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _read_into(handle: Any, name: str, tensor: torch.Tensor) -> int:
    """Copy tensor `name` (or this rank's slice of it) from an open safetensors file; returns bytes read."""
    index = local_slices(tensor)
    if index is None:
        values = handle.get_tensor(name)
        target = tensor
    else:
        values = handle.get_slice(name)[index]
        target = tensor.to_local()
    if tuple(values.shape) != tuple(target.shape):
        raise CheckpointError(
            f"tensor {name!r}: the file holds shape {tuple(values.shape)} where the model "
            f"expects {tuple(target.shape)}; the checkpoint does not match its config."
        )
    target.copy_(values)
    return values.numel() * values.element_size()
