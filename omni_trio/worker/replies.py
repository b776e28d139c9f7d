"""The reply fields of a failed worker call, shared by the process backends' worker sides
(tractor and ray): the executor turns them into a :class:`~omni_trio.errors.WorkerError`
naming the rank (:func:`~omni_trio.executors.base.raise_rank_failures`)."""

from __future__ import annotations

import traceback
from typing import Any

__all__ = ["failure_fields"]


def failure_fields(exc: BaseException) -> dict[str, Any]:
    """``ok=False`` with the error's message, type name and formatted traceback."""
    return {
        "ok": False,
        "error": str(exc) or repr(exc),
        "error_type": type(exc).__name__,
        "traceback": "".join(traceback.format_exception(exc)),
    }
