"""One flow-matching schedule for the native adapters (FLUX.2, Qwen-Image and its edit model, Z-Image, Sana): a
private scheduler with its timesteps set as the family's diffusers pipeline sets them, cached per step count, shape
and `flow_shift` (batch_rows.cached_schedule). The `flow_shift` request field is the recipe's (`request_fields`).

What differs between families is passed in: the pipeline module's own `retrieve_timesteps`, and how the sigmas and
`mu` follow from the scheduler config (each a function of the template's config, so a request's `flow_shift`, which
turns dynamic shifting off, is seen by them as diffusers would see it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from diffuserve.pipelines.batch_rows import cached_schedule, scheduler_template


def flow_schedule(
    cache: dict[Any, tuple[Any, torch.Tensor]],
    scheduler: Any,
    retrieve_timesteps: Callable[..., tuple[torch.Tensor, int]],
    device: torch.device | str,
    num_steps: int,
    flow_shift: float | None = None,
    *,
    shape_key: tuple[Any, ...] = (),
    sigmas: Callable[[Any], Any] | None = None,
    mu: Callable[[Any], float] | None = None,
) -> tuple[Any, torch.Tensor]:
    """A private scheduler and its timesteps for `num_steps` (and `shape_key`, e.g. the image's token count, and
    `flow_shift`): the checkpoint's `scheduler` rebuilt with the request's shift (`scheduler_template`), its
    timesteps set by `retrieve_timesteps` with `sigmas(config)` and `mu(config)` where given. Built once per key
    in `cache`; every call gets its own copy."""

    def build() -> tuple[Any, torch.Tensor]:
        template = scheduler_template(scheduler, flow_shift)
        kwargs: dict[str, Any] = {}
        if sigmas is not None:
            kwargs["sigmas"] = sigmas(template.config)
        if mu is not None:
            kwargs["mu"] = mu(template.config)
        return template, retrieve_timesteps(template, num_steps, device, **kwargs)[0]

    return cached_schedule(cache, (num_steps, *shape_key, flow_shift), build)
