"""Which process groups an amax is max-reduced over, and where a collective's buffer lives.

Framework plugins register a provider (Megatron's: the tensor-, data- and expert-parallel groups of
``parallel_state``); calibration and the dynamic weight amax ask :func:`default_groups` when no groups are passed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["register_group_provider", "default_groups", "collective_device"]

_GROUP_PROVIDERS: list[Callable[[], dict | None]] = []


def register_group_provider(fn: Callable[[], dict | None]) -> None:
    """Registers ``fn() -> {name: ProcessGroup} | None`` consulted when no groups are passed (plugins do this)."""
    if fn not in _GROUP_PROVIDERS:
        _GROUP_PROVIDERS.append(fn)


def default_groups() -> dict:
    """The groups of the first provider that has some (e.g. Megatron's parallel_state), else ``{}``."""
    for fn in _GROUP_PROVIDERS:
        groups = fn()
        if groups:
            return groups
    return {}


def collective_device(group) -> torch.device:
    """The device a collective over ``group`` needs its tensors on: the current GPU for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
