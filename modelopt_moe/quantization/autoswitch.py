"""Precision autoswitch: a quantized GEMM (per expert) falls back to high precision for one step when the operands
it actually uses quantize badly (after NVIDIA Transformer Engine's AutoswitchGemm debug feature).

A *step* is what the training code marks: ``with mtq.autoswitch_step(model, step): ...`` around the forward and
backward passes of one iteration (all its micro-batches), or
``modelopt_moe.plugins.megatron.get_forward_backward_func``, whose every call is one step. Steps ``0, every,
2 * every, ...`` are *sampled*: each quantized GEMM of the model measures, per expert, on the operands it uses,

* the underflow: the percentage of non-zero values that quantize to zero, and
* the MSE of the quantization relative to the operand's mean square,

(:mod:`modelopt_moe.numerics.quant_error`; grouped experts get both from the fake-quant launch itself, all N experts
at once) and a GEMM runs in high precision in that step where any of its monitored operands crosses a threshold
(OR over operands): ``fprop`` (input, weight), ``dgrad`` (weight, and the output gradient when the backward mode
quantizes it), ``wgrad`` (input, gradient). The weight and input decisions are made in the forward, on the device
(``torch.where``, no host synchronisation and no branch on data); the gradient's in the backward, where it is
quantized. An unsampled step runs exactly the code of a model without autoswitch: the only extra work is one check of
an empty list.

Decisions and metrics of a sampled step go, when the step's block closes, to one JSON-lines file per rank,
``<log_dir>/autoswitch_rank<global rank>.jsonl`` (one line per GEMM, expert and call); :func:`autoswitch_summary`
reads them all back.

Ranks may disagree: each decides from its own operands (its tensor-parallel shard of a weight, its own tokens, its
own experts). That is safe because a decision only chooses which values go into the GEMM; every rank runs the same
GEMMs and the same collectives (a sampled step runs the layer's GEMM twice on every rank, once for the forward value
and once for the gradient), and no collective is ever made or skipped because of a decision.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..numerics import relative_mse, underflow_pct
from .config import AUTOSWITCH_GEMMS, AutoswitchConfig
from .quant_module import is_quantized, unwrap_model
from .step_scope import StepScopes
from .utils import rank

__all__ = [
    "autoswitch_step",
    "autoswitch_summary",
    "active_autoswitch_scopes",
    "gemm_sampler",
    "GemmSampler",
    "SampledGemm",
    "select_tensor",
    "log_file",
]

# Operands each GEMM reads: the forward's input and weight, the backward's output gradient.
_GEMM_OPERANDS = {"fprop": ("input", "weight"), "dgrad": ("weight", "grad"), "wgrad": ("input", "grad")}


def log_file(log_dir: str | os.PathLike, global_rank: int) -> Path:
    """The JSON-lines file of rank ``global_rank`` under ``log_dir``."""
    return Path(log_dir) / f"autoswitch_rank{global_rank:05d}.jsonl"


@dataclass
class _Record:
    """One sampled call of one GEMM module: per-expert operand sums and decisions (device tensors until flushed)."""

    layer: str
    first_expert: int | None
    call: int
    sums: dict[str, torch.Tensor | None]
    decisions: dict[str, torch.Tensor | None]

    def lines(self, step: int, global_rank: int, gemms: list[str]) -> Iterator[dict]:
        sums = {k: None if v is None else v.detach().double().cpu() for k, v in self.sums.items()}
        metrics = {k: None if v is None else (underflow_pct(v).tolist(), relative_mse(v).tolist())
                   for k, v in sums.items()}
        decisions = {k: None if v is None else v.detach().cpu().reshape(-1).tolist()
                     for k, v in self.decisions.items()}
        n = max((len(m[0]) for m in metrics.values() if m is not None), default=1)
        for i in range(n):
            for gemm in gemms:
                operands = {}
                for name in _GEMM_OPERANDS[gemm]:
                    m = metrics.get(name)
                    if m is not None:
                        j = i if len(m[0]) > 1 else 0  # the gradient is one tensor for every expert
                        operands[name] = {"underflow_pct": m[0][j], "mse": m[1][j]}
                d = decisions.get(gemm)
                switched = bool(d[i if len(d) > 1 else 0]) if d is not None else False
                yield {"step": step, "rank": global_rank, "layer": self.layer,
                       "expert": None if self.first_expert is None else self.first_expert + i, "call": self.call,
                       "gemm": gemm, "switched": switched, "operands": operands}


@dataclass
class _Scope:
    """One sampled step: the GEMM modules it covers, their names, and what they recorded (``lock``: the GEMMs of
    the backward record from the autograd engine's threads)."""

    step: int
    cfg: AutoswitchConfig
    names: dict[int, tuple[str, int | None]]
    records: list[_Record] = field(default_factory=list)
    calls: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def module_ids(self) -> dict[int, tuple[str, int | None]]:
        return self.names

    def flush(self) -> None:
        if not self.records:
            return
        path = log_file(self.cfg.log_dir, rank())
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for record in self.records:
                for line in record.lines(self.step, rank(), list(self.cfg.gemms)):
                    f.write(json.dumps(line) + "\n")
        self.records.clear()


_SCOPES: StepScopes[_Scope] = StepScopes()


def active_autoswitch_scopes() -> int:
    """How many sampled steps are open (for tests and diagnostics)."""
    return len(_SCOPES)


def _config_of(models: list[nn.Module]) -> AutoswitchConfig | None:
    for model in models:
        for module in model.modules():
            if is_quantized(module):
                return getattr(module, "quant_autoswitch", None)
    return None


def _gemm_names(model: nn.Module) -> dict[int, tuple[str, int | None]]:
    """``id(module) -> (layer name, global index of its first expert or None)`` for every quantized GEMM module.

    Grouped experts are one module; experts that are separate modules (Megatron's ``SequentialMLP``) are named after
    their layer's GEMM, each with its own global expert index, so both kinds log the same names.
    """
    out: dict[int, tuple[str, int | None]] = {}
    for name, module in unwrap_model(model).named_modules():
        if not is_quantized(module):
            continue
        gemms = module.expert_gemms()
        if gemms:
            grid = module.expert_grid()
            owners = {id(p): m for m in module.modules() for p in m.parameters(recurse=False)}
            for gemm in gemms:
                first = grid.ep_rank * gemm.num_local
                if gemm.quantizers is module:
                    out[id(module)] = (name, first)
                    continue
                for i, w in enumerate(gemm.weights or []):
                    linear = owners.get(id(w))
                    if linear is not None:
                        out[id(linear)] = (f"{name}.{gemm.name}" if gemm.name else name, first + i)
        out.setdefault(id(module), (name, None))
    return out


@contextlib.contextmanager
def autoswitch_step(model: nn.Module | list[nn.Module] | tuple, step: int) -> Iterator[bool]:
    """Marks the forward and backward passes of one training step (all its micro-batches) as step ``step``.

    With an ``autoswitch`` config and ``step % every == 0`` the quantized GEMMs of ``model`` measure their operands and
    switch to high precision where the thresholds are crossed; on leaving the block the decisions and metrics are
    appended to this rank's log (one host synchronisation per sampled step). Any other step costs nothing::

        for step in range(steps):
            with mtq.autoswitch_step(model, step):
                loss_fn(model(batch)).backward()
            optimizer.step()

    Args:
        model: the quantized model or a list of model chunks (wrappers are fine).
        step: this step's index (continue counting after a resume).

    Yields:
        Whether this step is sampled.
    """
    models = list(model) if isinstance(model, list | tuple) else [model]
    cfg = _config_of(models)
    if cfg is None or step % cfg.every:
        yield False
        return
    names: dict[int, tuple[str, int | None]] = {}
    for m in models:
        names.update(_gemm_names(m))
    scope = _Scope(step, cfg, names)
    with _SCOPES.opened(scope):
        yield True
    scope.flush()  # only after a step that completed


class GemmSampler:
    """What one GEMM module does in a sampled step: apply the thresholds and record its operands and decisions."""

    def __init__(self, scope: _Scope, module: nn.Module):
        self.cfg = scope.cfg
        self.scope = scope
        self.layer, self.first_expert = scope.names[id(module)]
        key = id(module)
        with scope.lock:
            self.call = scope.calls.get(key, 0)
            scope.calls[key] = self.call + 1

    def monitors(self, gemm: str) -> bool:
        """Whether GEMM ``gemm`` (``fprop``, ``dgrad`` or ``wgrad``) may switch precision (``autoswitch.gemms``)."""
        return gemm in self.cfg.gemms

    def crossed(self, sums: torch.Tensor | None) -> torch.Tensor | None:
        """``[N]`` bool (device): which experts' operand crosses a threshold; None for an unquantized operand."""
        if sums is None:
            return None
        out = torch.zeros(sums.shape[0], dtype=torch.bool, device=sums.device)
        if self.cfg.underflow_pct is not None:
            out = out | (underflow_pct(sums) > self.cfg.underflow_pct)
        if self.cfg.mse is not None:
            out = out | (relative_mse(sums) > self.cfg.mse)
        return out

    def record(self, input_sums, weight_sums, decisions: dict[str, torch.Tensor | None]) -> _Record:
        """Records this call's operand sums and decisions in the step's scope (written when the step completes).

        Args:
            input_sums: the input operand's ``[N, 4]`` quantization-error sums, or None where it is not quantized.
            weight_sums: the weight operand's ``[N, 4]`` sums, or None.
            decisions: per GEMM (``fprop``, ``dgrad``, ``wgrad``), the ``[N]`` bool of the experts that switch to high
                precision, or None for a GEMM that is not monitored.

        Returns:
            The record, which :meth:`grad_crossed` completes with the backward's gradient.
        """
        rec = _Record(self.layer, self.first_expert, self.call, {"input": input_sums, "weight": weight_sums,
                                                                  "grad": None}, dict(decisions))
        with self.scope.lock:
            self.scope.records.append(rec)
        return rec

    def grad_crossed(self, rec: _Record, sums: torch.Tensor) -> torch.Tensor | None:
        """The backward's output gradient (one tensor for every expert): records its sums and ORs its decision into
        the monitored backward GEMMs; returns the ``[1]`` decision, or None when no backward GEMM is monitored."""
        rec.sums["grad"] = sums
        gemms = [g for g in ("dgrad", "wgrad") if self.monitors(g)]
        if not gemms:
            return None
        c = self.crossed(sums)
        for g in gemms:
            prev = rec.decisions.get(g)
            rec.decisions[g] = c if prev is None else prev | c
        return c


def gemm_sampler(module: nn.Module) -> GemmSampler | None:
    """The sampler of ``module`` when a sampled step covers it, else None (the whole cost of an unsampled step)."""
    scope = _SCOPES.covering(module)
    return None if scope is None else GemmSampler(scope, module)


@dataclass
class SampledGemm:
    """How a GEMM module quantizes its operands in a sampled step.

    Attributes:
        sampler: the module's :class:`GemmSampler`.
        quantize_input_stats / quantize_weight_stats: ``t -> (quantized operand, float64 [N, 4] sums or None)``.
        select_input / select_weight: ``(decision [N] or None, original, quantized) -> operand``: the original where
            the decision is True (per expert), the quantized elsewhere.
    """

    sampler: GemmSampler
    quantize_input_stats: Callable
    quantize_weight_stats: Callable
    select_input: Callable
    select_weight: Callable


def select_tensor(decision: torch.Tensor | None, original: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """One tensor (one expert or a dense layer): ``original`` where the ``[1]`` decision is True."""
    if decision is None:
        return quantized
    return torch.where(decision.reshape(()), original, quantized)


def autoswitch_summary(log_dir: str | os.PathLike) -> list[dict]:
    """How often each GEMM of each layer (and expert) switched to high precision, from every rank's log.

    Returns:
        One row per (layer, expert, GEMM), sorted: ``{"layer", "expert" (global index or None), "gemm", "samples"
        (records: sampled steps x calls x ranks that hold it), "switched", "rate", "steps" (sampled step indices),
        "ranks"}``.

    Raises:
        FileNotFoundError: ``log_dir`` holds no autoswitch log.
    """
    files = sorted(Path(log_dir).glob("autoswitch_rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"autoswitch_summary: no autoswitch_rank*.jsonl files in {log_dir}")
    agg: dict[tuple, dict] = {}
    for path in files:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    r = json.loads(line)
                    key = (r["layer"], r["expert"], r["gemm"])
                except (json.JSONDecodeError, KeyError) as e:
                    raise ValueError(f"{path}:{n}: not an autoswitch record ({e})") from None
                a = agg.setdefault(key, {"samples": 0, "switched": 0, "steps": set(), "ranks": set()})
                a["samples"] += 1
                a["switched"] += bool(r["switched"])
                a["steps"].add(r["step"])
                a["ranks"].add(r["rank"])
    order = {g: i for i, g in enumerate(AUTOSWITCH_GEMMS)}
    rows = []
    for (layer, expert, gemm), a in sorted(agg.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None
                                                                         else kv[0][1], order.get(kv[0][2], 9))):
        rows.append({"layer": layer, "expert": expert, "gemm": gemm, "samples": a["samples"],
                     "switched": a["switched"], "rate": a["switched"] / a["samples"], "steps": sorted(a["steps"]),
                     "ranks": sorted(a["ranks"])})
    return rows
