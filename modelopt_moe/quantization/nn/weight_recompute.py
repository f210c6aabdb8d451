"""Fake-quantized expert weights that the backward recomputes instead of keeping (``backward.weight_operands:
recompute``).

A grouped GEMM saves its weight operands for the backward (dgrad needs them), so by default the fake-quantized copy of
every expert weight would live from a layer's forward to its backward: one extra copy of all expert weights at the
peak of a step. Around the layer's GEMM, :meth:`RecomputedWeights.saving` installs saved-tensor hooks: a saved tensor
in the fake-quantized buffer is stored as its place in that buffer (offset, shape, strides), and the backward
fake-quantizes the unchanged weights again (one launch for all N experts, bit-identical) when it first asks for one.
The recomputed buffer lives until every saved operand was handed out.

Freshness: the weights, their version counters and the amax are recorded in the forward; a backward that finds them
changed raises instead of computing a gradient through different operands than its forward used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..weight_reuse import weight_key

__all__ = ["RecomputedWeights"]


class _Saved:
    """A saved tensor that lies in the fake-quantized buffer: where it lies (``offset`` in elements from the
    buffer's start)."""

    __slots__ = ("owner", "offset", "size", "stride")

    def __init__(self, owner: RecomputedWeights, t: torch.Tensor, offset: int):
        self.owner, self.offset, self.size, self.stride = owner, offset, t.size(), t.stride()


class RecomputedWeights:
    """The recipe of one grouped weight fake quant: ``values`` (views of one buffer) were computed by
    ``recompute()`` from ``weights`` and ``amax``; the backward runs it again instead of keeping ``values``."""

    def __init__(self, values: list[torch.Tensor], recompute: Callable[[], list[torch.Tensor]],
                 weights: list[torch.Tensor], amax: torch.Tensor | None, name: str):
        storage = values[0].untyped_storage()
        self._ptr, self._end, self._dtype = storage.data_ptr(), storage.data_ptr() + storage.nbytes(), values[0].dtype
        self._itemsize = values[0].element_size()
        self._recompute, self._weights, self._amax, self._name = recompute, weights, amax, name
        self._key = weight_key(weights, amax)  # what must be unchanged for the recompute to give the same values
        self._buffer: torch.Tensor | None = None
        self._pending = 0  # saved operands not yet handed to the backward

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Saved-tensor hooks for the GEMM that consumes ``values``."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor):
        # Called for every tensor the GEMM saves, so the test is cheap: an address inside the buffer's allocation
        # (no other live tensor's memory overlaps it; on another device it is another allocation) and its dtype.
        if t.layout is not torch.strided or t.dtype is not self._dtype:
            return t
        ptr = t.data_ptr()
        if not self._ptr <= ptr < self._end:
            return t
        self._pending += 1
        return _Saved(self, t, (ptr - self._ptr) // self._itemsize)

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, _Saved):
            return packed
        return packed.owner._materialize(packed)

    def _materialize(self, saved: _Saved) -> torch.Tensor:
        if self._buffer is None:
            if weight_key(self._weights, self._amax) != self._key:
                raise RuntimeError(
                    f"{self._name}: the expert weights or their amax changed between the forward and the backward, "
                    "so the backward cannot recompute the fake-quantized weights its forward used (set "
                    "backward.weight_operands: keep to hold them instead, or update weights only after the backward)"
                )
            self._buffer = self._recompute()[0]  # any view: as_strided addresses the whole storage
        out = self._buffer.as_strided(saved.size, saved.stride, saved.offset)
        self._pending -= 1
        if self._pending <= 0:
            self._buffer = None  # every saved operand was handed out: the buffer lives only as long as they do
        return out
