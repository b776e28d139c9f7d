"""The device-fault check after a failed forward: what reads like a device fault, the probe,
and when the worker is declared broken (``DeviceFaultError``)."""

from __future__ import annotations

import pytest
import torch

from omni_trio.worker import device as device_module
from omni_trio.worker.device import check_device, looks_like_device_fault, probe_device
from omni_trio.worker.faults import (
    DeviceFaultError,
    DeviceFaultInjected,
    FaultInjector,
    WorkerFatalError,
)
from omni_trio.worker.stop_flags import StopFlags

CPU = torch.device("cpu")


def injector() -> FaultInjector:
    return FaultInjector(enabled=True, stop_flags=StopFlags(), worker_process=False)


@pytest.mark.parametrize(
    ("text", "device_like"),
    [
        ("CUDA error: an illegal memory access was encountered", True),
        ("CUDA error: device-side assert triggered", True),
        ("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm", True),
        ("unspecified launch failure", True),
        ("height must be a multiple of 8", False),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),  # the request's, not sticky
    ],
)
def test_what_reads_like_a_device_fault(text: str, device_like: bool) -> None:
    assert looks_like_device_fault(RuntimeError(text)) is device_like


def test_the_probe_passes_off_cuda() -> None:
    assert probe_device(CPU) is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_passes_on_a_healthy_cuda_device() -> None:
    assert probe_device(torch.device("cuda", 0)) is True


def test_a_request_error_is_not_a_device_fault() -> None:
    check_device(CPU, injector(), ValueError("bad prompt"))  # returns: the request failed


def test_a_device_like_error_with_a_healthy_device_is_the_requests() -> None:
    check_device(CPU, injector(), RuntimeError("CUDA error: misaligned address"))


def test_a_device_like_error_and_a_failed_probe_break_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_module, "probe_device", lambda device: False)
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(DeviceFaultError, match="failed its probe after RuntimeError") as info:
        check_device(CPU, injector(), error)
    assert isinstance(info.value, WorkerFatalError)
    assert info.value.__cause__ is error


def test_a_poisoned_device_fails_its_probe_from_then_on() -> None:
    faults = injector()
    faults.device_poisoned = True
    with pytest.raises(DeviceFaultError):
        check_device(CPU, faults, DeviceFaultInjected("r", 2))
    check_device(CPU, faults, ValueError("not device-like"))  # still the request's own
