"""Tensor parallel: every attention's heads and every MLP's hidden units of the DiT split over the TP ranks.

Each denoiser's Linears are sharded with DTensor (`parallelize_module`): q/k/v (and the MLP's up projection)
column-wise, so a rank computes only its own heads (its slice of the hidden units), and the attention output
(the MLP's down projection) row-wise, whose partial sums are all-reduced back to the full hidden state. So a
rank holds about 1/degree of the attention and MLP weights (the bulk of a DiT), which is what lets a DiT
larger than one device run; embeddings, AdaLN modulation and the final norm stay replicated.

The plans: FLUX.1 and Qwen-Image use diffusers' own `_tp_plan` (FLUX's single blocks feed `proj_out` the
concatenation of two column-sharded streams, so diffusers shards its input columns per stream with
`PackedRowwiseParallel`), and their attention processors already reshape by head width, so each rank runs
its own heads unchanged. Wan, HunyuanVideo 1.5 and LTX-2 have no plan in diffusers; ours (`tensor_plans.py`)
shard the same Linears, give each attention its local head count, and replace the q/k RMSNorms that normalise
across all heads (`rms_norm_across_heads`: Wan, LTX-2) by `ShardedRMSNorm`: the sum of squares is all-reduced over
the TP group, so the normalisation is that of the whole vector. LTX-2 also rotates the whole q / k vector before
its heads are split, so its RoPE tables are cut to the rank's features. Quantized layers (`--quantization`) are
cut the same way by hand, their plain int8 / float8 tensors and per-row scales sliced per rank
(`parallel/quantized.py`).

Every rank runs the same batch with the same inputs and ends with the same output: the arithmetic is the
unsharded model's up to the order of the all-reduced sums (≤ ~1e-6 in fp32, tested over gloo). The mesh comes
from the caller (its device type picks NCCL on GPUs, gloo on CPU), so this composes with a separate CFG
parallel group: the TP mesh holds only this rank's TP peers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from diffuserve.errors import ConfigError
from diffuserve.lora.sharding import shard_lora_slots
from diffuserve.parallel.tensor_plans import HEAD_COUNTS, localize_attention, tensor_parallel_plan

if TYPE_CHECKING:
    from diffuserve.pipelines.base import Pipeline

_FLAG = "--tp-size"


def _tp_families() -> str:
    """The families with a tensor-parallel plan, from their specs (for the refusals below)."""
    from diffuserve.family_spec import families_with, named_list

    return named_list(families_with("tensor_parallel"))


def _refuse(message: str) -> ConfigError:
    return ConfigError(f"{_FLAG}: {message}", param="tp_size")


def _check_denoiser(key: str, module: torch.nn.Module, plan: dict[str, Any] | None, degree: int) -> None:
    """Refuse, before any weight moves, what this denoiser cannot run under TP of `degree`."""
    from torch.distributed.tensor import DTensor

    name = type(module).__name__
    if plan is None:
        raise _refuse(
            f"{key} ({name}) has no tensor-parallel plan; TP runs the {_tp_families()} DiTs. "
            "Drop --tp-size (or shard with --use-fsdp-inference)."
        )
    for field in HEAD_COUNTS:  # LTX-2's audio stream has its own head count
        heads = module.config.get(field)
        if isinstance(heads, int) and heads % degree:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            what = "attention heads" if field == "num_attention_heads" else "audio attention heads"
            raise _refuse(
                f"{degree} does not divide the {heads} {what} of {key} ({name}); use a --tp-size in {divisors}."
            )
    sharded = any(getattr(m, "tp_shard", None) for m in module.modules())  # quantized layers cut by hand
    if sharded or any(isinstance(p, DTensor) for p in module.parameters()):
        raise _refuse(
            f"{key} is already sharded (FSDP or TP applied before); --tp-size does not combine with "
            "--use-fsdp-inference. Pick one of them."
        )
    if any(p.numel() == 0 for p in module.parameters()):
        raise _refuse(
            f"{key}'s weights are offloaded (a residency mode moved them off the module); a "
            "tensor-parallel DiT must stay resident. Keep the DiT resident with --tp-size."
        )
    if any(getattr(m, "fused_projections", False) for m in module.modules()):
        raise _refuse(f"{key} has fused q/k/v projections, which the plan does not shard; load it unfused.")
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    try:
        resolve_tp_shard_specs(module, plan, degree)  # every sharded block must divide by the degree
    except ValueError as exc:
        raise _refuse(f"{key} ({name}): {exc} Use a --tp-size that divides the DiT's hidden sizes.") from exc


def _parallelize(module: torch.nn.Module, plan: dict[str, Any], mesh: Any, specs: dict[str, Any]) -> None:
    # diffusers' helpers group the plan per block (one `parallelize_module` call each, so RowwiseParallel hooks
    # the block's input) and turn its styles into torch's, packed ones included. Its `apply_tensor_parallel`
    # itself refuses a CPU mesh, which the gloo tests need.
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from diffuserve.parallel.quantized import shard_quantized_layers

    quantized = shard_quantized_layers(module, specs, mesh)  # cut by hand: the kernels take plain tensors only
    for block, relative_plan in _resolve_tp_plan(module, plan):
        relative_plan = {k: v for k, v in relative_plan.items() if id(block.get_submodule(k)) not in quantized}
        styles = _styles(relative_plan)
        for style in styles.values():
            # Every rank loaded the same checkpoint, so each cuts its own shard: no scatter from rank 0.
            style.src_data_rank = None
        if styles:
            parallelize_module(block, mesh, styles)
    # The planned weights now live on the mesh's device; the rest (embeddings, modulation, norms, the quantized
    # layers' shards) follows them there, so a host-loaded DiT never needs to fit on one device whole.
    device = _mesh_device(mesh)
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if not isinstance(param, DTensor) and param.device != device:
                sub.register_parameter(name, torch.nn.Parameter(param.detach().to(device), requires_grad=False))
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and buffer.device != device:
                sub.register_buffer(name, buffer.to(device), persistent=name not in sub._non_persistent_buffers_set)


def _mesh_device(mesh: Any) -> torch.device:
    """The device DTensor places this rank's shards on: the mesh's device type, this process's current index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def check_tensor_parallel(pipeline: Pipeline, degree: int) -> dict[str, dict[str, Any]]:
    """The TP plan of each denoiser of `pipeline` under `degree` ranks, or ConfigError(param="tp_size") naming
    what cannot run: not a native pipeline, a family or DiT without a plan, heads or hidden sizes that
    `degree` does not divide, a DiT already sharded or offloaded. Touches no weight."""
    from diffuserve.family_spec import spec_for

    family = pipeline.family
    keys = [k for k in pipeline.denoisers if k in pipeline.components]
    if not keys:
        raise _refuse(
            f"the {family} model runs on the diffusers backend, whose DiT is not sharded here; serve a "
            f"native family with a tensor-parallel plan ({_tp_families()}) or drop --tp-size."
        )
    try:
        has_plan = spec_for(family).profile.tensor_parallel
    except KeyError:
        has_plan = False
    if not has_plan:
        raise _refuse(
            f"the {family} family has no tensor-parallel plan (TP runs {_tp_families()}); drop "
            "--tp-size, or shard the DiT with --use-fsdp-inference."
        )
    plans = {}
    for key in keys:  # every denoiser is checked before any is sharded
        plan = tensor_parallel_plan(pipeline.components[key])
        _check_denoiser(key, pipeline.components[key], plan, degree)
        assert plan is not None
        plans[key] = plan
    return plans


def enable_tensor_parallel(pipeline: Pipeline, *, mesh: Any) -> list[str]:
    """Shard every denoiser of a native `pipeline` over `mesh` (a 1-D DeviceMesh of this rank's TP peers).

    Returns the parallelized component keys. Refuses with ConfigError(param="tp_size"), before touching any
    weight, what `check_tensor_parallel` refuses for `mesh.size()` ranks.
    """
    if mesh.ndim != 1:
        raise ValueError(f"enable_tensor_parallel needs a 1-D mesh of the TP ranks; got {mesh.ndim} dimensions.")
    plans = check_tensor_parallel(pipeline, mesh.size())
    for key, plan in plans.items():
        module = pipeline.components[key]
        localize_attention(module, mesh)  # local heads, q/k norms across heads, LTX-2's RoPE tables
        from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

        specs = resolve_tp_shard_specs(module, plan, mesh.size())  # the whole layers' shapes, before any cut
        with torch.no_grad():
            _parallelize(module, plan, mesh, specs)
            shard_lora_slots(module, plan, mesh, specs)  # per-request LoRA: A / B cut like their base weight
        module.requires_grad_(False)
    from diffuserve.parallel.agreement import FromFirstRank

    pipeline.agree_over(FromFirstRank(mesh.get_group()))  # step caches: every TP rank decides alike
    return list(plans)


def sharded_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole) of `module`'s tensor-parallel (DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    from diffuserve.parallel.quantized import quantized_sharded_bytes

    held, full = quantized_sharded_bytes(module)
    for param in module.parameters():
        if isinstance(param, DTensor):
            held += param.to_local().numel() * param.element_size()
            full += param.numel() * param.element_size()
    return held, full
