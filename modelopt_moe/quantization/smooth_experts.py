"""Exact power-of-two SmoothQuant rescaling of the experts' fc2 (down-projection) inputs, before calibration.

An expert with a plain gated linear unit computes ``fc2(h)``, ``h = act(gate) * up`` (``[gate; up] = fc1(x)``).
Dividing row ``j`` of fc1's *up* half (and its bias) by ``s_j`` and multiplying column ``j`` of fc2 by ``s_j`` leaves
the expert's output unchanged, and moves range between fc2's input channels and fc2's weight columns (SmoothQuant /
AWQ style). With ``s_j = 2**e_j`` every scaled value is the old one with another exponent: bit-exact in bf16, fp16
and fp32 as long as every scaled weight stays finite and normal, which :func:`exact_exponents` guarantees by
clamping ``e_j`` (a channel whose weights leave no such exponent keeps ``s_j = 1``).

``s_j`` is SmoothQuant's ``amax_x_j**alpha / amax_w_j**(1 - alpha)`` rounded to the nearest power of two:
``amax_x_j`` the largest ``|h_j|`` of the expert's calibration tokens, taken where fc2's input quantizer takes it
(before the router probability), max-reduced over the ranks that hold the same expert; ``amax_w_j`` the largest
``|fc2[:, j]|``. A channel (or expert) that saw no token, or an Inf, keeps ``s_j = 1`` (NaN is left out).

The core knows no MoE framework: a plugin registers a *finder* (:func:`register_expert_mlp_finder`; the Megatron
plugin's covers ``SequentialMLP`` and ``TEGroupedMLP`` with our or Transformer Engine's grouped linears) that
describes each expert layer as an :class:`ExpertMLP` and says why a layer cannot be rescaled exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .calib.calibrator import Statistic, reduce_statistics
from .calib.max import AMAX_REDUCE_OP
from .calib.routing import widened_routing
from .conversion import named_quantizers
from .process_groups import collective_device, default_groups
from .tensor_quantizer import nan_ignoring_abs_max
from .utils import warn_once

__all__ = [
    "ExpertMLP",
    "register_expert_mlp_finder",
    "expert_mlps",
    "check_expert_mlps",
    "power_of_two_exponents",
    "exact_exponents",
    "scale_channels",
    "fc2_input_amax",
    "smooth_expert_inputs",
    "Rescale",
    "rescaled_expert_inputs",
]

SUPPORTED = ("a plain gated linear unit, act(gate) * up, with an elementwise activation (SwiGLU, GeGLU), unclamped, "
             "without offset or interleaving, and float32 / bfloat16 / float16 weights")
EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ExpertMLP:
    """One expert layer, as a framework plugin describes it.

    Attributes:
        name: the layer's module path (messages name it).
        fc1_weights: each local expert's fc1 weight ``[2F, H]``, gate rows then up rows.
        fc1_biases: each local expert's fc1 bias ``[2F]`` (None without one).
        fc2_weights: each local expert's fc2 weight ``[H, F]``.
        fc2_modules: the modules fc2's inputs enter: one per local expert (each gets its tokens as its first
            argument), or (``grouped``) one grouped linear called ``(x, m_splits)``.
        grouped: whether ``fc2_modules`` is one grouped linear.
        fc2_input_quantizer: the quantizer of fc2's inputs (None on an unconverted model): the pass enables it
            (quantization off) so that its layer applies the router probability after fc2, where engines do.
        refusal: why the layer cannot be rescaled exactly (naming the setting and its value), or None.
        groups: the group names over which ranks holding the same experts see other tokens (max-reduced).
    """

    name: str
    fc1_weights: list[torch.Tensor]
    fc1_biases: list[torch.Tensor | None]
    fc2_weights: list[torch.Tensor]
    fc2_modules: list[nn.Module]
    grouped: bool = False
    fc2_input_quantizer: nn.Module | None = None
    refusal: str | None = None
    groups: tuple[str, ...] = ("edp",)

    def channels(self) -> int:
        """fc2's input channels on this rank."""
        return self.fc2_weights[0].shape[1] if self.fc2_weights else 0


_FINDERS: list[Callable[[nn.Module], list[ExpertMLP]]] = []


def register_expert_mlp_finder(fn: Callable[[nn.Module], list[ExpertMLP]]) -> None:
    """Registers ``fn(model) -> [ExpertMLP]`` (a framework's expert layers; plugins do this)."""
    if fn not in _FINDERS:
        _FINDERS.append(fn)


def expert_mlps(model: nn.Module) -> list[ExpertMLP]:
    """Every expert layer of ``model`` that a registered framework describes, in module order."""
    return [mlp for fn in _FINDERS for mlp in fn(model)]


def check_expert_mlps(model: nn.Module, call: str, *, collective: bool = False) -> list[ExpertMLP]:
    """The expert layers of ``model``, after checking that each can be rescaled exactly. A model without any warns
    once on rank 0 (a pipeline stage may hold none; an error there would leave the other stages waiting).

    ``collective`` (every rank calls this, as ``mtq.quantize`` does): the ranks add up their refusals in one
    ``all_reduce`` over the world, whatever their data, so that all raise or none does (a pipeline stage without the
    refused layers would otherwise go on into calibration and wait for the stages that raised).

    Raises:
        ValueError: a layer that cannot (naming its module path, the setting and what is supported), here or (with
            ``collective``) on another rank; nothing is changed.
    """
    mlps = expert_mlps(model)
    refused = [f"{m.name}: {m.refusal}" for m in mlps if m.refusal is not None]
    for m in mlps:
        bad = sorted({str(w.dtype) for w in (*m.fc1_weights, *m.fc2_weights) if w.dtype not in EXACT_DTYPES})
        if bad and m.refusal is None:
            refused.append(f"{m.name}: weights in {', '.join(bad)}, where a power-of-two scale is not proven exact")
    elsewhere = False
    if collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        total = torch.tensor([len(refused)], dtype=torch.int64, device=collective_device(None))
        dist.all_reduce(total)
        elsewhere = int(total.item()) > len(refused)
    if refused:
        raise ValueError(f"{call}: smooth_expert_inputs cannot rescale these expert layers exactly:\n  "
                         + "\n  ".join(refused) + f"\nSupported: {SUPPORTED}. Drop smooth_expert_inputs from the "
                         "config for this model. Nothing was changed")
    if elsewhere:
        raise ValueError(f"{call}: smooth_expert_inputs cannot rescale expert layers of other ranks exactly (their "
                         "errors name each layer and setting); this rank's are fine. Drop smooth_expert_inputs from "
                         "the config for this model. Nothing was changed")
    if not mlps:
        warn_once(f"{call}: smooth_expert_inputs rescales the experts' fc2 inputs, but the model has no expert layer "
                  "a framework plugin knows (Megatron's SequentialMLP, TEGroupedMLP) on this rank; nothing is "
                  "rescaled here")
    return mlps


def power_of_two_exponents(amax_x: torch.Tensor, amax_w: torch.Tensor, alpha: float) -> torch.Tensor:
    """``round(log2(amax_x**alpha / amax_w**(1 - alpha)))`` per channel (float64; 0 where either is 0), ties to
    even, computed from each value's exponent and mantissa separately (``frexp``): the integer part is exact, so a tie
    (at alpha 0.5 two values with the same mantissa, common in bf16) is an exact tie and rounds the same way on
    statistics that were rescaled by powers of two. So the rule is idempotent: on the statistics of rescaled weights
    (``amax_x / s``, ``amax_w * s``) it finds ``s = 1``."""
    x, w = amax_x.double(), amax_w.double()
    ok = (x > 0) & (w > 0)
    mx, ex = torch.frexp(torch.where(ok, x, torch.ones_like(x)))
    mw, ew = torch.frexp(torch.where(ok, w, torch.ones_like(w)))
    t = (alpha * ex.double() - (1.0 - alpha) * ew.double()) + (alpha * torch.log2(mx) - (1.0 - alpha) * torch.log2(mw))
    return torch.where(ok, torch.round(t), torch.zeros_like(t))


def _exponent_limits(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``values`` ``[C, K]`` (in ``dtype``): the least and greatest ``k`` such that every nonzero value
    times ``2**k`` is finite and normal in ``dtype`` (float64 ints; ``+-inf`` for an all-zero row)."""
    info = torch.finfo(dtype)
    a = values.detach().double().abs()
    nonzero = a > 0
    big = torch.where(nonzero, a, torch.zeros_like(a)).amax(-1)
    small = torch.where(nonzero, a, torch.full_like(a, float("inf"))).amin(-1)
    # largest <= max: k <= floor(log2(max / big)); smallest >= tiny: k >= ceil(log2(tiny / small))
    inf = torch.full_like(big, float("inf"))
    hi = torch.where(big > 0, torch.floor(torch.log2(info.max / big)), inf)
    lo = torch.where(torch.isfinite(small), torch.ceil(torch.log2(info.tiny / small)), -inf)
    return lo, hi


def exact_exponents(e: torch.Tensor, up: torch.Tensor, up_bias: torch.Tensor | None,
                    fc2: torch.Tensor) -> torch.Tensor:
    """The exponents ``e`` (``[F]``, of scales ``s = 2**e``) as int64, clamped so that the rescale is exact: every
    nonzero ``up[j] / 2**e_j`` (and ``up_bias[j]``) and ``fc2[:, j] * 2**e_j`` stays finite and normal in its dtype
    (then the product is the same significand with another exponent). A channel whose weights leave no such exponent
    (e.g. subnormal values on both sides) gets 0: ``s_j = 1``."""
    e = e.double()
    up_lo, up_hi = _exponent_limits(up, up.dtype)  # up / 2**e: -e within [up_lo, up_hi]
    if up_bias is not None:  # in its own dtype
        b_lo, b_hi = _exponent_limits(up_bias[:, None], up_bias.dtype)
        up_lo, up_hi = torch.maximum(up_lo, b_lo), torch.minimum(up_hi, b_hi)
    w_lo, w_hi = _exponent_limits(fc2.t(), fc2.dtype)  # fc2 * 2**e: e within [w_lo, w_hi]
    lo, hi = torch.maximum(w_lo, -up_hi), torch.minimum(w_hi, -up_lo)
    e = torch.where(lo <= hi, torch.minimum(torch.maximum(e, lo), hi), torch.zeros_like(e))
    return e.long()


@torch.no_grad()
def scale_channels(up: torch.Tensor, up_bias: torch.Tensor | None, fc2: torch.Tensor, e: torch.Tensor) -> None:
    """In place: ``up`` ``[F, H]`` row ``j`` (and ``up_bias[j]``) times ``2**-e_j``, ``fc2`` ``[H, F]`` column ``j``
    times ``2**e_j`` (exact for :func:`exact_exponents`; with ``-e`` it undoes itself bit for bit)."""
    p = torch.exp2(e.double())
    up.copy_((up.double() / p.to(up.device)[:, None]).to(up.dtype))
    if up_bias is not None:
        up_bias.copy_((up_bias.double() / p.to(up_bias.device)).to(up_bias.dtype))
    fc2.copy_((fc2.double() * p.to(fc2.device)[None, :]).to(fc2.dtype))


@contextlib.contextmanager
def _pass_switches(model: nn.Module, mlps: list[ExpertMLP]) -> Iterator[None]:
    """Inside: no quantizer quantizes or calibrates (the model's own numbers), and each fc2 input quantizer is on
    (pass-through), so its layer applies the router probability after fc2; every switch is put back after."""
    saved = [(q, q.switches()) for _, q, _ in named_quantizers(model)]
    try:
        for q, _ in saved:
            q.set_switches(if_quant=False, if_calib=False)
        for m in mlps:
            if m.fc2_input_quantizer is not None:
                m.fc2_input_quantizer.set_switches(enabled=True)
        yield
    finally:
        for q, switches in saved:
            q.set_switches(**switches)


def _observe(amax: torch.Tensor, index: int, x: torch.Tensor) -> None:
    if x.numel():  # NaN left out; an Inf kept, so that its channel keeps s = 1
        a = nan_ignoring_abs_max(x.reshape(-1, x.shape[-1]), keep_dims=(1,)).reshape(-1)
        torch.maximum(amax[index], a.to(amax.device), out=amax[index])


def _expert_hook(amax: torch.Tensor, index: int):
    def hook(module, args, kwargs) -> None:  # returns None: the input stays the module's
        x = args[0] if args else kwargs.get("input", kwargs.get("inp"))
        _observe(amax, index, x)

    return hook


def _grouped_hook(amax: torch.Tensor):
    def hook(module, args, kwargs) -> None:  # returns None: the input stays the module's
        x = args[0] if args else kwargs.get("inp", kwargs.get("input"))
        splits = args[1] if len(args) > 1 else kwargs["m_splits"]
        sizes = splits.tolist() if isinstance(splits, torch.Tensor) else [int(m) for m in splits]
        for i, part in enumerate(torch.split(x, sizes)):
            _observe(amax, i, part)

    return hook


@torch.no_grad()
def fc2_input_amax(model: nn.Module, mlps: list[ExpertMLP], forward_loop: Callable, groups: dict,
                   moe_calib_experts_ratio: float | None = None) -> list[torch.Tensor]:
    """Per expert layer: the fp32 ``[N_local, F]`` largest ``|fc2 input|`` per expert and channel over one
    ``forward_loop(model)`` pass (NaN left out, as max calibration leaves it), max-reduced over each layer's
    :attr:`ExpertMLP.groups` (one collective per group name, on every rank, whatever its data).

    The pass runs in eval mode with quantization and calibration off (``moe_calib_experts_ratio``: with the wider
    routing that calibration uses), then puts the training mode and every quantizer switch back.
    """
    amaxes = [torch.zeros(len(m.fc2_weights), m.channels(), dtype=torch.float32,
                          device=m.fc2_weights[0].device if m.fc2_weights else None) for m in mlps]
    handles = []
    training = [(mod, mod.training) for mod in model.modules()]
    try:
        for m, amax in zip(mlps, amaxes, strict=True):
            if m.grouped:
                handles.append(m.fc2_modules[0].register_forward_pre_hook(_grouped_hook(amax), with_kwargs=True))
            else:
                handles += [mod.register_forward_pre_hook(_expert_hook(amax, i), with_kwargs=True)
                            for i, mod in enumerate(m.fc2_modules)]
        model.eval()
        with _pass_switches(model, mlps), widened_routing(model, moe_calib_experts_ratio):
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
        for mod, was in training:
            mod.training = was
    statistics = [Statistic(amax, AMAX_REDUCE_OP, m.groups, partial(_store, amaxes, i))
                  for i, (m, amax) in enumerate(zip(mlps, amaxes, strict=True))]
    reduce_statistics(statistics, groups)
    return amaxes


def _store(amaxes: list, i: int, value: torch.Tensor) -> None:
    amaxes[i] = value


@dataclass
class Rescale:
    """What :func:`smooth_expert_inputs` did: per expert layer and local expert, the exponents ``e`` (``s = 2**e``).
    :meth:`undo` puts every weight back bit for bit."""

    mlps: list[ExpertMLP]
    exponents: list[list[torch.Tensor]] = field(default_factory=list)

    def undo(self) -> None:
        """Divides back what was multiplied (exact: the values were scaled by powers of two within range)."""
        for m, per_expert in zip(self.mlps, self.exponents, strict=True):
            for i, e in enumerate(per_expert):
                _apply(m, i, -e)

    def moved_channels(self) -> int:
        """How many (expert, channel) scales differ from 1."""
        return sum(int((e != 0).sum()) for per_expert in self.exponents for e in per_expert)


def _up(m: ExpertMLP, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    f = m.fc2_weights[i].shape[1]
    bias = m.fc1_biases[i]
    return m.fc1_weights[i][f:], (None if bias is None else bias[f:])


def _apply(m: ExpertMLP, i: int, e: torch.Tensor) -> None:
    up, up_bias = _up(m, i)
    scale_channels(up, up_bias, m.fc2_weights[i], e)


@torch.no_grad()
def smooth_expert_inputs(model: nn.Module, forward_loop: Callable, alpha: float = 0.5, *, groups: dict | None = None,
                         mlps: list[ExpertMLP] | None = None, moe_calib_experts_ratio: float | None = None,
                         call: str = "smooth_expert_inputs") -> Rescale:
    """Rescales every expert layer's fc2 input channels in place by exact powers of two (see the module docstring).

    All or nothing: every layer is checked before anything runs, every scale is computed before any weight changes,
    and the weights change together; the returned :class:`Rescale` undoes it bit for bit.

    Args:
        model: a converted model (``mtq.quantize`` calls this between conversion and calibration).
        forward_loop: ``forward_loop(model)``, one pass of calibration data.
        alpha: SmoothQuant's migration strength, in [0, 1].
        groups: ``{name: ProcessGroup}`` for the reduction of the statistics (the registered provider's if None).
        mlps: the layers (:func:`check_expert_mlps` of ``model`` if None).
        moe_calib_experts_ratio: the wider routing of calibration, if any.
        call: what messages name.

    Returns:
        The :class:`Rescale` (exponents per layer and expert).

    Raises:
        ValueError: an expert layer that cannot be rescaled exactly (nothing changed). A model without any warns.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{call}: alpha={alpha}; expected a value in [0, 1]")
    mlps = check_expert_mlps(model, call, collective=True) if mlps is None else mlps
    groups = default_groups() if groups is None else groups
    amaxes = fc2_input_amax(model, mlps, forward_loop, groups, moe_calib_experts_ratio)
    rescale = Rescale(mlps)
    for m, amax in zip(mlps, amaxes, strict=True):
        per_expert = []
        for i, w in enumerate(m.fc2_weights):
            x = amax[i].to(w.device)
            x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # an Inf: s = 1
            e = power_of_two_exponents(x, w.detach().float().abs().amax(0), alpha)
            up, up_bias = _up(m, i)
            per_expert.append(exact_exponents(e, up, up_bias, w))
        rescale.exponents.append(per_expert)
    for m, per_expert in zip(mlps, rescale.exponents, strict=True):
        for i, e in enumerate(per_expert):
            _apply(m, i, e)
    if not rescale.moved_channels():
        warn_once(f"{call}: smooth_expert_inputs(alpha={alpha}) left every expert channel's scale at 1 (no "
                  "calibration token reached the experts, or every scale rounded to 1)")
    return rescale


@contextlib.contextmanager
def rescaled_expert_inputs(model: nn.Module, forward_loop: Callable, alpha: float, *,
                           moe_calib_experts_ratio: float | None = None, call: str = "mtq.quantize",
                           mlps: list[ExpertMLP] | None = None) -> Iterator[Rescale]:
    """:func:`smooth_expert_inputs` for the block; if the block raises, the weights are put back bit for bit."""
    rescale = smooth_expert_inputs(model, forward_loop, alpha, mlps=mlps,
                                   moe_calib_experts_ratio=moe_calib_experts_ratio, call=call)
    try:
        yield rescale
    except BaseException:
        rescale.undo()
        raise
