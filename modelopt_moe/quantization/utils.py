"""Small helpers shared by the quantization modules: rank-0 warnings and rank queries."""

from __future__ import annotations

import warnings

import torch.distributed as dist

__all__ = ["rank", "is_rank0", "warn_once"]

_warned: set[str] = set()


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_rank0() -> bool:
    """Whether this process is global rank 0 (True without torch.distributed)."""
    return rank() == 0


def warn_once(message: str) -> None:
    """Warns on rank 0, once per distinct message per process."""
    if message in _warned:
        return
    _warned.add(message)
    if is_rank0():
        warnings.warn(message, stacklevel=3)
