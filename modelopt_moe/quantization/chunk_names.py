"""How the module names of one model chunk relate to the whole model's.

A pipeline stage holds some of the model's layers and numbers them from 0, so its ``decoder.layers.0`` may be the
model's layer 4. Whatever describes the whole model (a gathered summary, calibration token counts, a saved quantization
state) names modules as the whole model does; a framework plugin registers how its chunks map their names
(:func:`register_chunk_naming`; Megatron's: pipeline stages), and the core asks :func:`chunk_naming`. Without a
registered naming, or for a model that is the whole model, names are the same in both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn

__all__ = ["ChunkNaming", "register_chunk_naming", "chunk_naming", "global_name_of"]


class ChunkNaming(Protocol):
    """One chunk's naming (a framework plugin's)."""

    def global_name(self, name: str) -> str:
        """A module name of the chunk -> the whole model's name of that module."""

    def chunk_state(self, state: dict) -> dict:
        """The entries of a whole-model quantization state (:func:`modelopt_moe.checkpoint.state.modelopt_state`
        under whole-model names) that belong to this chunk, under the chunk's names."""


_NAMINGS: list[Callable[[nn.Module], ChunkNaming | None]] = []


def register_chunk_naming(fn: Callable[[nn.Module], ChunkNaming | None]) -> None:
    """Registers ``fn(model) -> ChunkNaming | None`` (None: ``model`` is not one of its framework's chunks, or is the
    whole model); registering the same function twice adds it once."""
    if fn not in _NAMINGS:
        _NAMINGS.append(fn)


def chunk_naming(model: nn.Module) -> ChunkNaming | None:
    """The naming of the first registered plugin that knows ``model`` as a chunk, else None (local state only: no
    collective)."""
    for fn in _NAMINGS:
        naming = fn(model)
        if naming is not None:
            return naming
    return None


def global_name_of(model: nn.Module) -> Callable[[str], str]:
    """``model``'s names -> the whole model's (the identity where the model is the whole model)."""
    naming = chunk_naming(model)
    return naming.global_name if naming is not None else (lambda name: name)
