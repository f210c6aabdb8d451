"""The global expert axis of expert amaxes in distributed checkpoints (framework-free rules).

Every expert quantizer's amax is saved as ONE global tensor ``[*outer, E, *pe]`` whatever its layout and whatever
the parallel layout that wrote it: ``outer`` are the axes the parents prepend (Megatron's layer axis), ``E`` the
global experts, ``pe`` one expert's shape (``()`` per tensor, ``(C,)`` per output channel). Local expert ``i`` of
EP rank ``r`` is global expert ``r * N_local + i`` (Megatron's convention for expert weights), so a checkpoint saved
at any TP / EP / expert-TP loads at any other, into any amax layout, bit-exact:

* ``vectorized`` / ``per_expert``: this rank's ``[N_local, *pe]`` rows at offset ``ep_rank * N_local`` (``per_expert``
  writes one row per view, under the view's own state-dict key); replica id ``(0, etp_replica, edp_rank)``;
* ``shared``: every rank holds the whole ``[E, *pe]`` chunk, its one value repeated (one writer:
  replica id ``(0, etp_replica, ep_rank * edp_size + edp_rank)``); loading takes the max over all ``E`` experts.
  Calibration max-reduces a shared amax over EP, so every rank holds the same value: no collective at save.

A per-channel weight amax along the expert-TP-sharded weight axis is also split over expert-TP (its ``etp_rank``
then leaves the replica id); every other amax is replicated over expert-TP.

This module computes *where* each amax goes (:class:`ExpertAmaxPlacement`); a framework plugin turns that into its
own sharded-tensor objects (``modelopt_moe.plugins.megatron``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quantization.expert_quantizer import ExpertGemm, ExpertGrid, ExpertQuantizer
from .errors import CheckpointMismatchError

__all__ = ["ExpertAmaxPlacement", "expert_amax_placement", "per_expert_shape", "loaded_expert_amax",
           "classify_checkpoint_amax", "channel_is_sharded"]


def channel_is_sharded(q, kind: str, sharded_axis: int) -> bool:
    """A per-channel WEIGHT amax along the tensor-parallel-sharded weight axis holds this rank's channels only."""
    return kind == "weight_quantizer" and q.axis is not None and q.axis % 2 == sharded_axis


def per_expert_shape(q: ExpertQuantizer, weight_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """One expert's (local) amax shape: ``()`` per tensor, ``(C,)`` per channel.

    Raises:
        ValueError: a per-channel amax was never calibrated and no weight shape tells its channel count.
    """
    if q.axis is None:
        return ()
    if q.amax is not None:
        return tuple(q.amax.shape[1:])
    if weight_shape is None:
        raise ValueError(f"{q}: a per-channel amax (axis={q.axis}) was never calibrated and no weight shape was "
                         "given, so its shape is unknown")
    return (int(weight_shape[q.axis]),)


@dataclass(frozen=True)
class ExpertAmaxPlacement:
    """Where one expert quantizer's local amax sits in its global checkpoint tensor ``[*outer, E, *pe]``.

    Attributes:
        expert_axis: index of the ``E`` axis (the number of outer axes).
        num_local: ``N_local``; ``first_expert``: the global index of local expert 0.
        num_global: ``E``.
        pe: one expert's LOCAL shape; ``pe_global``: its global shape (the channel count times expert-TP where the
            channels are split).
        channel_split: ``(etp_rank, etp_size)`` when the channel axis is split over expert-TP, else None.
        whole: ``shared``: every rank holds all ``E`` entries.
        replica_id: Megatron-style ``(0, tp-like replica, dp-like replica)``: exactly one rank writes each entry.
        single_writer_id: the replica id that makes one rank of the whole expert grid the writer of a tensor
            every rank holds (``shared``'s, and a legacy one-per-layer amax).
    """

    expert_axis: int
    num_local: int
    first_expert: int
    num_global: int
    pe: tuple[int, ...]
    pe_global: tuple[int, ...]
    channel_split: tuple[int, int] | None
    whole: bool
    replica_id: tuple[int, int, int]
    single_writer_id: tuple[int, int, int]

    def global_shape(self, outer: tuple[int, ...]) -> tuple[int, ...]:
        """The global tensor's shape: the ``outer`` axes, then ``E``, then one expert's global shape."""
        return (*outer, self.num_global, *self.pe_global)

    def local_data(self, q: ExpertQuantizer, device: torch.device | str) -> torch.Tensor:
        """The local tensor to save: ``[N, *pe]`` (``shared``: ``[E, *pe]``); zeros where there is no amax yet
        (a fresh model about to load, possibly built on the meta device: ``device`` is where the values will live)."""
        amax = q.amax.detach() if q.amax is not None else torch.zeros((self.num_local, *self.pe), device=device)
        if self.whole:
            return amax[:1].expand(self.num_global, *self.pe).contiguous()
        return amax


def expert_amax_placement(q: ExpertQuantizer, kind: str, gemm: ExpertGemm, grid: ExpertGrid,
                          num_outer_axes: int) -> ExpertAmaxPlacement:
    """Where ``q`` (quantizer ``kind`` of ``gemm``) goes in its global tensor, at this rank's ``grid`` position."""
    pe = per_expert_shape(q, gemm.weight_shape if kind == "weight_quantizer" else None)
    split = channel_is_sharded(q, kind, gemm.sharded_axis) and bool(pe)
    etp_replica = 0 if split else grid.etp_rank
    whole = q.layout == "shared"
    single_writer = (0, etp_replica, grid.ep_rank * grid.edp_size + grid.edp_rank)
    pe_global = (pe[0] * grid.etp_size, *pe[1:]) if split else pe
    return ExpertAmaxPlacement(
        expert_axis=num_outer_axes, num_local=gemm.num_local, first_expert=grid.ep_rank * gemm.num_local,
        num_global=grid.ep_size * gemm.num_local, pe=pe, pe_global=pe_global,
        channel_split=(grid.etp_rank, grid.etp_size) if split else None, whole=whole,
        replica_id=single_writer if whole else (0, etp_replica, grid.edp_rank), single_writer_id=single_writer)


def loaded_expert_amax(q: ExpertQuantizer, placement: ExpertAmaxPlacement, loaded: torch.Tensor) -> torch.Tensor:
    """The ``[N, *pe]`` amax for ``q`` from what was loaded at ``placement``: this rank's rows, or for ``shared`` the
    max over all ``E`` experts given to every local expert."""
    loaded = loaded.float()
    if placement.whole:
        return loaded.amax(dim=0, keepdim=True).expand(placement.num_local, *loaded.shape[1:]).contiguous()
    return loaded


def classify_checkpoint_amax(key: str, expected: tuple[int, ...], found: tuple[int, ...] | None, expert_axis: int,
                             ckpt_dir: str) -> str:
    """Compares an expert amax's expected global shape with the checkpoint's.

    Returns:
        ``"match"``, or ``"legacy"`` when the checkpoint has the same shape without the expert axis (one amax per
        layer, as saved by versions before the global expert axis).

    Raises:
        CheckpointMismatchError: naming the key, the expected and the found shape (the expert count when only that
            differs), or saying the key is absent.
    """
    expected, found = tuple(expected), None if found is None else tuple(found)
    if found is None:
        raise CheckpointMismatchError(f"{key}: not in checkpoint {ckpt_dir} (expected an amax of global shape "
                                      f"{expected}); was it saved with this quantizer enabled?")
    if found == expected:
        return "match"
    if found == expected[:expert_axis] + expected[expert_axis + 1:]:
        return "legacy"
    if len(found) == len(expected) and all(f == e for i, (f, e) in enumerate(zip(found, expected, strict=True))
                                                if i != expert_axis):
        raise CheckpointMismatchError(f"{key}: expected {expected[expert_axis]} experts in checkpoint {ckpt_dir}, "
                                      f"found {found[expert_axis]} (global amax shape expected {expected}, found "
                                      f"{found})")
    raise CheckpointMismatchError(f"{key}: amax shape mismatch in checkpoint {ckpt_dir}: expected global shape "
                                  f"{expected}, found {found} (per-tensor vs per-channel amax, or another channel "
                                  f"count?)")
