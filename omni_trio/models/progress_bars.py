"""Quiet loading: the Hugging Face libraries' progress bars off while a model loads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_hf"]


@contextmanager
def quiet_hf() -> Iterator[None]:
    """Turn off diffusers', transformers' and huggingface_hub's progress bars inside the block.

    These switches are process-global; the previous state is restored on exit.
    """
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as transformers_logging

    restore = []
    if diffusers_logging.is_progress_bar_enabled():
        diffusers_logging.disable_progress_bar()
        restore.append(diffusers_logging.enable_progress_bar)
    if transformers_logging.is_progress_bar_enabled():
        transformers_logging.disable_progress_bar()
        restore.append(transformers_logging.enable_progress_bar)
    if not hub_utils.are_progress_bars_disabled():
        hub_utils.disable_progress_bars()
        restore.append(hub_utils.enable_progress_bars)
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()
