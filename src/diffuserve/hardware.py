"""What the deployment plan is resolved against: the accelerator kind and each device's free memory.

`detect_hardware` asks torch about the machine it runs on; `describe_hardware` builds the same
description from numbers (for `diffuserve plan --gpu-memory-gib X --num-gpus N` and tests), so the
resolver never has to know where the figures came from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from diffuserve.errors import ConfigError

GIB = 1024**3


@dataclass
class HardwareInfo:
    """Accelerators and memory of one host, detected or described."""

    device_kind: str = "cpu"
    """`cuda`, `cpu`, or another torch device type; `cpu` means no accelerator (host = device)."""
    gpus: list[tuple[int, int]] = field(default_factory=list)
    """One `(free_bytes, total_bytes)` per accelerator, in device-index order; empty on a CPU host."""
    host_memory_bytes: int = 0
    """Physical host memory (0 when unknown)."""
    described: bool = False
    """True when the figures came from the command line (`--gpu-memory-gib`), not from the machine."""

    @property
    def num_devices(self) -> int:
        return len(self.gpus)

    def min_free_bytes(self, num_gpus: int) -> int:
        """Smallest free memory among the first `num_gpus` devices: the bottleneck of a deployment."""
        selected = self.gpus[: max(1, num_gpus)]
        return min(free for free, _ in selected) if selected else 0

    def summary(self) -> str:
        source = "described" if self.described else "detected"
        if not self.gpus:
            return f"{self.device_kind} host ({source}), host memory {self.host_memory_bytes / GIB:.1f} GiB"
        free = ", ".join(f"{f / GIB:.1f}/{t / GIB:.1f}" for f, t in self.gpus)
        return f"{len(self.gpus)} x {self.device_kind} ({source}), free/total GiB: {free}"


def host_memory_bytes() -> int:
    """Physical memory of this host from sysconf; 0 where the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return 0


def describe_hardware(
    num_gpus: int,
    gpu_memory_gib: float | Sequence[float],
    *,
    device_kind: str = "cuda",
) -> HardwareInfo:
    """Hardware that need not be present: `num_gpus` devices with `gpu_memory_gib` free each.

    `gpu_memory_gib` may also be one figure per device (a busy card is described by its free memory).
    """
    if num_gpus < 1:
        raise ConfigError(f"--num-gpus must be at least 1, got {num_gpus}.", param="num_gpus")
    per_gpu = [float(gpu_memory_gib)] * num_gpus if isinstance(gpu_memory_gib, (int, float)) else list(gpu_memory_gib)
    if len(per_gpu) != num_gpus:
        raise ConfigError(
            f"--gpu-memory-gib lists {len(per_gpu)} values but --num-gpus is {num_gpus}; "
            "give one value for all GPUs or one per GPU.",
            param="gpu_memory_gib",
        )
    if any(g <= 0 for g in per_gpu):
        raise ConfigError(f"--gpu-memory-gib must be positive, got {per_gpu}.", param="gpu_memory_gib")
    gpus = [(int(g * GIB), int(g * GIB)) for g in per_gpu]
    return HardwareInfo(device_kind=device_kind, gpus=gpus, host_memory_bytes=host_memory_bytes(), described=True)


def detect_hardware(device: str = "auto") -> HardwareInfo:
    """The accelerators of this machine and their free memory now.

    `device` is the `--device` value: `auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`.
    torch is imported here, not at module level, so `diffuserve plan` with described hardware and the
    pure resolver tests never pay for it.
    """
    kind = device.split(":", 1)[0]
    host = host_memory_bytes()
    if kind == "cpu":
        return HardwareInfo(device_kind="cpu", host_memory_bytes=host)
    if kind not in ("auto", "cuda"):
        raise ConfigError(
            f"--device {device!r} is not supported for hardware detection; use auto, cpu, cuda or cuda:N.",
            param="device",
        )

    import torch

    if not torch.cuda.is_available():
        if kind == "cuda":
            raise ConfigError(
                f"--device {device} was asked for but torch sees no CUDA device "
                f"(torch {torch.__version__}); use --device cpu or auto.",
                param="device",
            )
        return HardwareInfo(device_kind="cpu", host_memory_bytes=host)
    gpus = [tuple(int(x) for x in torch.cuda.mem_get_info(i)) for i in range(torch.cuda.device_count())]
    if ":" in device:
        # `cuda:N` pins the deployment to one device; it becomes the first (and only) selected one.
        suffix = device.split(":", 1)[1]
        index = int(suffix) if suffix.isdigit() else -1
        if not 0 <= index < len(gpus):
            raise ConfigError(
                f"--device {device}: expected cuda:N with N below {len(gpus)} (CUDA devices present).", param="device"
            )
        gpus = [gpus[index]]
    return HardwareInfo(device_kind="cuda", gpus=gpus, host_memory_bytes=host)  # type: ignore[arg-type]
