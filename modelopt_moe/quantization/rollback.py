"""Put a model back exactly as it was when a call that changes it in place fails halfway.

Conversion swaps module classes, adds quantizer submodules and attributes, and rewires children (a ``SequentialMLP``
expert's linear takes views of the layer's quantizers). :class:`StructureSnapshot` records what those steps touch
(every module's class and attribute dictionary, and the contents of its child, parameter, buffer and hook
dictionaries) and :meth:`StructureSnapshot.restore` writes it back. The dictionaries are restored in place, so a hook
handle the user holds still removes its hook afterwards. Tensor data is not copied: conversion and calibration do
not write parameters or buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["StructureSnapshot", "unchanged_on_error"]


class StructureSnapshot:
    """The structure of ``model`` and of every module in it, as it is now."""

    def __init__(self, model: nn.Module):
        self._modules = []
        for module in model.modules():
            attributes = dict(module.__dict__)
            # The dicts nn.Module keeps its children, parameters, buffers and hooks in: their contents, so the
            # same dict objects can be refilled.
            contents = {name: dict(value) for name, value in attributes.items() if isinstance(value, dict)}
            self._modules.append((module, module.__class__, attributes, contents))

    def restore(self) -> None:
        """Every recorded module back to its recorded class, attributes and dict contents."""
        for module, cls, attributes, contents in self._modules:
            module.__class__ = cls
            for name in [n for n in module.__dict__ if n not in attributes]:
                del module.__dict__[name]
            module.__dict__.update(attributes)
            for name, items in contents.items():
                target = attributes[name]
                target.clear()
                target.update(items)


@contextlib.contextmanager
def unchanged_on_error(model: nn.Module, call: str) -> Iterator[None]:
    """Runs the block; if anything in it raises (an interrupt too), ``model``'s structure is restored and the
    exception, with a note naming ``call``, propagates."""
    snapshot = StructureSnapshot(model)
    try:
        yield
    except BaseException as e:
        snapshot.restore()
        if hasattr(e, "add_note"):
            e.add_note(f"{call}: the model is back as it was before this call")
        raise
