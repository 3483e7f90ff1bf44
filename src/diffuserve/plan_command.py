"""`diffuserve plan`: print the deployment plan a `serve` with the same flags would run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def print_plan(values: dict[str, Any]) -> int:
    """Resolve and print the plan from JSON and safetensors headers only (no weights loaded)."""
    from diffuserve.config.argparse_dataclass import dataclass_from_namespace
    from diffuserve.config.deployment import DeploymentArgs, format_plan
    from diffuserve.config.quant_args import QuantArgs
    from diffuserve.hardware import describe_hardware, detect_hardware
    from diffuserve.launch.setup import resolve_deployment, resolve_dtype

    deployment = dataclass_from_namespace(DeploymentArgs, values)
    quant = dataclass_from_namespace(QuantArgs, values)
    if values.get("controlnet"):  # serve's check, message and exit code (2)
        from diffuserve.config.controlnet import check_controlnet_flag

        check_controlnet_flag(values["controlnet"])
    if values.get("model_path"):
        model_path = Path(values["model_path"])
    else:
        from diffuserve.models.tiny import ensure_default_model

        model_path = ensure_default_model()
    if values.get("gpu_memory_gib") is not None:
        hardware = describe_hardware(deployment.num_gpus or 1, values["gpu_memory_gib"])
    else:
        hardware = detect_hardware("auto")
    device_kind = "cuda" if hardware.gpus else "cpu"
    dtype = resolve_dtype(values.get("dtype", "auto"), device_kind)
    plan = resolve_deployment(
        deployment,
        model_path,
        model_id=values.get("model_id"),
        dtype=dtype,
        hardware=hardware,
        backend=values.get("backend", "auto"),
        batching_mode=values.get("batching_mode"),
        quant=quant,
        transformer_path=values.get("transformer_path"),
        activation_memory_gib=values.get("activation_memory_gib"),
        controlnet=values.get("controlnet"),
    )
    print(json.dumps(plan.to_dict(), indent=2) if values.get("json") else format_plan(plan))
    return 0
