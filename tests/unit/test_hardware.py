"""Hardware description (for `diffuserve plan` and tests) and detection on this machine."""

from __future__ import annotations

import pytest

from diffuserve.errors import ConfigError
from diffuserve.hardware import GIB, HardwareInfo, describe_hardware, detect_hardware, host_memory_bytes


def test_describe_one_figure_for_all_gpus() -> None:
    hw = describe_hardware(2, 80)
    assert hw.device_kind == "cuda" and hw.described
    assert hw.gpus == [(80 * GIB, 80 * GIB)] * 2
    assert hw.min_free_bytes(2) == 80 * GIB


def test_describe_per_gpu_figures_and_min_over_selected() -> None:
    hw = describe_hardware(3, [80.0, 40.5, 24.0])
    assert hw.num_devices == 3
    assert hw.min_free_bytes(1) == 80 * GIB
    assert hw.min_free_bytes(2) == int(40.5 * GIB)
    assert hw.min_free_bytes(3) == 24 * GIB
    assert "described" in hw.summary() and "40.5/40.5" in hw.summary()


@pytest.mark.parametrize(
    "num_gpus,memory,param",
    [
        (0, 80.0, "num_gpus"),
        (2, [80.0], "gpu_memory_gib"),
        (1, 0.0, "gpu_memory_gib"),
        (2, [80.0, -1.0], "gpu_memory_gib"),
    ],
)
def test_describe_rejects_bad_figures(num_gpus: int, memory, param: str) -> None:
    with pytest.raises(ConfigError) as err:
        describe_hardware(num_gpus, memory)
    assert err.value.param == param


def test_cpu_host_has_no_gpu_memory() -> None:
    hw = HardwareInfo()
    assert hw.device_kind == "cpu" and hw.min_free_bytes(1) == 0
    assert "cpu host" in hw.summary()


def test_detect_cpu() -> None:
    hw = detect_hardware("cpu")
    assert hw == HardwareInfo(device_kind="cpu", gpus=[], host_memory_bytes=host_memory_bytes(), described=False)
    assert hw.host_memory_bytes > 0


def test_detect_on_this_machine() -> None:
    import torch

    hw = detect_hardware("auto")
    assert not hw.described
    if torch.cuda.is_available():
        assert hw.device_kind == "cuda" and hw.num_devices == torch.cuda.device_count()
        assert all(0 < free <= total for free, total in hw.gpus)
    else:
        assert hw.device_kind == "cpu" and hw.gpus == []
        with pytest.raises(ConfigError, match="--device cuda") as err:
            detect_hardware("cuda")
        assert err.value.param == "device"


def test_detect_rejects_unknown_device() -> None:
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        detect_hardware("tpu")
