"""Scopes over the modules of a model for one training step, seen from every thread.

Weight reuse (:mod:`.weight_reuse`) and precision autoswitch (:mod:`.autoswitch`) each mark the forwards and backwards
of one training step (all its micro-batches) for the modules of a model; a module asks for the innermost open scope
that covers it. One :class:`StepScopes` per kind of scope.

Module-level state rather than a contextvar: activation recomputation and the backward run forwards inside the
autograd engine's own threads, where a contextvar set by the caller is not visible.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterator
from typing import Generic, Protocol, TypeVar

from torch import nn

__all__ = ["StepScope", "StepScopes"]


class StepScope(Protocol):
    """What a scope needs: the ids of the modules it covers."""

    module_ids: Collection[int]


S = TypeVar("S", bound=StepScope)


class StepScopes(Generic[S]):
    """The open scopes of one kind, innermost last, shared by all threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: list[S] = []

    def __len__(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def opened(self, scope: S) -> Iterator[S]:
        """``scope`` is open (and found by :meth:`covering`) for the block."""
        with self._lock:
            self._open.append(scope)
        try:
            yield scope
        finally:
            with self._lock:
                del self._open[next(i for i, s in enumerate(self._open) if s is scope)]  # this one, not an equal one

    def covering(self, module: nn.Module) -> S | None:
        """The innermost open scope that covers ``module``, or None (without a lock when none is open: the cost of
        every forward outside a scope)."""
        if not self._open:
            return None
        key = id(module)
        with self._lock:
            for scope in reversed(self._open):
                if key in scope.module_ids:
                    return scope
        return None
