"""The calibrator seam: what every calibration algorithm is, and how its statistics reduce across ranks.

A calibrator (one class per algorithm, registered by name in :mod:`.registry`) does three things, in the order
:func:`~modelopt_moe.quantization.calibrate` calls them:

* ``collect``: the local statistics. Every algorithm starts from max calibration (weights from themselves,
  activations from the forward loop), as Model Optimizer's do; an algorithm adds its own statistics on top;
* ``reduce``: its statistics as :class:`Statistic` s, each naming how it combines across ranks (``max`` of amaxes,
  ``sum`` of errors or histograms) and over which named groups (``"tp"``, ``"ep"``, ...: the module's
  :meth:`~modelopt_moe.quantization.quant_module.QuantModuleMixin.amax_reduction`); :func:`reduce_statistics` makes
  the collectives, the same ones on every rank whatever its data;
* ``compute``: the amax from the reduced statistics.

Calibrators hold no process groups: the groups are passed where they are used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from ..process_groups import collective_device

__all__ = ["REDUCE_OPS", "Statistic", "Calibrator", "reduce_statistics"]

# How a statistic combines across ranks: the elementwise max (amaxes) or the sum (errors, histograms, counts).
REDUCE_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


@dataclass
class Statistic:
    """One tensor of calibration statistics and how it reduces across ranks.

    Attributes:
        value: the local tensor (any shape; the same shape on every rank of its groups).
        op: ``"max"`` or ``"sum"``.
        groups: the group names it reduces over, in order (a name the caller's groups lack is skipped).
        store: called with the reduced tensor (the same shape as ``value``).
    """

    value: torch.Tensor
    op: str
    groups: tuple[str, ...]
    store: Callable[[torch.Tensor], None]


def reduce_statistics(statistics: list[Statistic], groups: dict) -> None:
    """Reduces every statistic over its groups and hands each its result (:attr:`Statistic.store`).

    One flattened ``all_reduce`` per (group name, op, dtype: fp32 or int64), in sorted order, statistics in list
    order: every rank makes the same collectives, since which statistics exist depends on the model and config, never
    on data.
    Without an initialized process group, or over groups of one rank, nothing is reduced (``store`` still runs).

    Raises:
        ValueError: an op other than ``max`` or ``sum``.
    """
    for s in statistics:
        if s.op not in REDUCE_OPS:
            raise ValueError(f"Statistic: reduce op {s.op!r}; expected one of {sorted(REDUCE_OPS)}")
    # Floating statistics reduce in fp32, integer ones (counts) as int64: exact at any size.
    values = [s.value.detach().float() if s.value.is_floating_point() else s.value.detach().long()
              for s in statistics]
    if dist.is_available() and dist.is_initialized():
        by_key: dict[tuple[str, str, str], list[int]] = {}
        for i, s in enumerate(statistics):
            for name in s.groups:
                if groups.get(name) is not None and dist.get_world_size(groups[name]) > 1:
                    by_key.setdefault((name, s.op, str(values[i].dtype)), []).append(i)
        for name, op, dtype in sorted(by_key):
            members = by_key[(name, op, dtype)]
            flat = torch.cat([values[i].reshape(-1).cpu() for i in members])
            flat = flat.to(collective_device(groups[name]))
            dist.all_reduce(flat, op=REDUCE_OPS[op], group=groups[name])
            offset = 0
            for i in members:
                n = values[i].numel()
                values[i] = flat[offset:offset + n].reshape(values[i].shape).to(values[i].device)
                offset += n
    for s, v in zip(statistics, values, strict=True):
        s.store(v)


class Calibrator:
    """Base of every calibration algorithm (one instance per :func:`~modelopt_moe.quantization.calibrate` call).

    Subclasses set :attr:`name` (the ``algorithm`` / ``{"method": ...}`` value that selects them) and
    :attr:`options` (their pydantic options model, Model Optimizer's algorithm dict), and override the steps that
    differ from max calibration.
    """

    name: ClassVar[str]
    options: ClassVar[type]

    def __init__(self, config):
        self.config = config

    def refine(self, model: torch.nn.Module, groups: dict, forward_loop: Callable | None = None,
               routing: Callable | None = None) -> None:
        """After max calibration and its reduction across ranks: the algorithm's own statistics, their reduction
        (:func:`reduce_statistics`) and the amaxes computed from them. Max calibration: nothing.

        Args:
            model: the calibrated model.
            groups: ``{name: ProcessGroup}`` for the reductions (empty without ``distributed_sync``).
            forward_loop: ``forward_loop(model)``, for an algorithm that needs a second pass over the data.
            routing: ``routing()``, the context manager the first pass ran the loop in (wider MoE routing).
        """
