"""Is the device itself broken?  After a forward fails with an error that reads like a
device fault (a sticky CUDA error poisons the whole context: every later kernel fails too),
the worker probes its device; a failed probe makes the worker broken, so its group fails
closed and is replaced instead of failing every later request while looking healthy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .faults import DeviceFaultError, FaultInjector

if TYPE_CHECKING:
    import torch

__all__ = ["check_device", "looks_like_device_fault", "probe_device"]

# What an error says when the device itself may be broken (a sticky CUDA error poisons the
# context: every later kernel fails too).
_DEVICE_FAULT_MARKERS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
)


def looks_like_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` reads like a device fault rather than a request's own failure."""
    text = str(exc)
    return any(marker in text for marker in _DEVICE_FAULT_MARKERS)


def probe_device(device: torch.device) -> bool:
    """Whether ``device`` still runs a trivial kernel to completion (CUDA: a tiny add and a
    synchronize; anything else: True)."""
    if device.type != "cuda":
        return True
    import torch

    try:
        x = torch.ones(1, device=device)
        (x + 1).cpu()
        torch.cuda.synchronize(device)
    except Exception:
        return False
    return True


def check_device(device: torch.device, faults: FaultInjector, exc: BaseException) -> None:
    """After a forward failed with ``exc``: if it looks like a device fault and the device
    fails its probe (or was poisoned on purpose), raise :class:`DeviceFaultError` (the worker
    is broken: its group must fail closed), else return (the requests failed, not the
    device)."""
    if not looks_like_device_fault(exc):
        return
    if faults.device_poisoned or not probe_device(device):
        raise DeviceFaultError(
            f"device {device} failed its probe after {type(exc).__name__}: {exc}"
        ) from exc
