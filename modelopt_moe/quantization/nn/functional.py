"""Backward modes of a quantized GEMM, applied around any layer's own GEMM (with its own communication).

``apply_quantized_gemm(module, x, weight, gemm)`` runs ``gemm(x_op, w_op)`` with the module's quantizers and
its :class:`BackwardConfig`:

* ``dequantized``: ``gemm(Q(x), Q(w))``; autograd sees the fake-quantized operands (STE through Q).
* ``high_precision``: the forward value is ``gemm(Q(x), Q(w))`` (bit for bit), but the backward runs through
  ``gemm(x, w)``: the backward GEMMs use the original operands. This costs a second forward GEMM.
* ``quantized``: like ``dequantized``, and the gradient arriving at the GEMM output is fake-quantized first
  (``grad_num_bits``, per-tensor scale from the gradient's own amax), emulating FP8 training.

Clipped STE zeroes the gradient of every operand element with ``|x| > amax`` in all three modes.

In a step that precision autoswitch samples (:mod:`..autoswitch`), the operands come with their quantization-error
sums, and each GEMM takes the original operand where its decision says so: the forward value is
``gemm(x_f, w_f)`` (fprop's operands) and the gradient flows through ``gemm(x_b, w_b)`` (wgrad's activation,
dgrad's weight), as in ``high_precision`` mode; ``quantized`` mode also keeps the original output gradient where its
own quantization crosses a threshold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kernels import grouped_weight_amax, grouped_weight_fake_quant
from ...numerics import fake_quant, quant_error_sums, scale_rows
from ..autoswitch import SampledGemm, gemm_sampler, select_tensor
from ..input_amax import quantize_input_operand
from ..tensor_quantizer import clip_mask, nan_ignoring_abs_max
from ..weight_amax import quantize_weight_operand
from .experts import use_kernels
from .row_scale import rows_of

__all__ = [
    "apply_quantized_gemm", "run_quantized_gemm", "clip_mask_of", "quantize_grad", "fake_quant_grad", "mask_grad",
    "forward_value_of",
]


class _ForwardValueOf(torch.autograd.Function):
    """Returns ``value`` in the forward; sends the whole gradient to ``grad_path``."""

    @staticmethod
    def forward(ctx, grad_path, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant_grad(grad: torch.Tensor, fmt: str, kernel: str = "auto",
                    amax: torch.Tensor | None = None) -> torch.Tensor:
    """``fake_quant(grad, fmt, max|grad|)`` with NaN ignored in the max (a per-tensor dynamic scale; ``amax``: that
    max, when the caller has it already). Where the one-launch kernels run (``kernel``: auto | triton | torch, as
    ``config.kernel``), one amax launch and one fake-quant launch, bit-exact with the torch reference, which otherwise
    runs (several passes and an fp32 copy)."""
    if grad.numel() and use_kernels(kernel, grad.device):
        g = grad.contiguous()
        g2d = g.view(-1, g.shape[-1]) if g.dim() > 1 else g.view(1, -1)
        amax = grouped_weight_amax([g2d]) if amax is None else amax.reshape(1)
        return grouped_weight_fake_quant([g2d], amax, fmt)[0].view_as(grad)
    return fake_quant(grad, fmt, nan_ignoring_abs_max(grad) if amax is None else amax.reshape(()))


class _QuantizeGrad(torch.autograd.Function):
    """Identity in the forward; fake-quantizes the incoming gradient (dynamic per-tensor amax)."""

    @staticmethod
    def forward(ctx, x, fmt, kernel):
        ctx.fmt, ctx.kernel = fmt, kernel
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return fake_quant_grad(grad, ctx.fmt, ctx.kernel), None, None


class _QuantizeGradSampled(torch.autograd.Function):
    """:class:`_QuantizeGrad` in a sampled step: measures the gradient's quantization and keeps the original gradient
    where the sampler's thresholds are crossed."""

    @staticmethod
    def forward(ctx, x, fmt, sampler, record):
        ctx.fmt, ctx.sampler, ctx.record = fmt, sampler, record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        q = fake_quant(grad, ctx.fmt, nan_ignoring_abs_max(grad))
        switch = ctx.sampler.grad_crossed(ctx.record, quant_error_sums(grad, q)[None])
        return (q if switch is None else torch.where(switch.reshape(()), grad, q)), None, None, None


class _MaskGrad(torch.autograd.Function):
    """Identity in the forward; multiplies the gradient by a saved 0/1 mask."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def forward_value_of(grad_path: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in the forward, with the whole gradient sent to ``grad_path`` (which must have ``value``'s shape)."""
    return _ForwardValueOf.apply(grad_path, value)


def quantize_grad(x: torch.Tensor, fmt: str, kernel: str = "auto") -> torch.Tensor:
    """``x`` in the forward; its incoming gradient fake-quantized to ``fmt`` with its own per-tensor amax
    (:func:`fake_quant_grad`)."""
    return _QuantizeGrad.apply(x, fmt, kernel)


def mask_grad(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` in the forward; its gradient multiplied by the 0/1 ``mask`` (no mask: ``x`` itself)."""
    return x if mask is None else _MaskGrad.apply(x, mask)


def clip_mask_of(q, x: torch.Tensor) -> torch.Tensor | None:
    """The clipped-STE mask of quantizer ``q`` (a TensorQuantizer or an expert's view) for ``x``, or None."""
    if not q.clips:
        return None
    return clip_mask(x, q.amax.to(x.device))


def _map(fn, value):
    return [fn(v) for v in value] if isinstance(value, list | tuple) else fn(value)


def _identity(t):
    return t


def run_quantized_gemm(cfg, x, weight, gemm: Callable, quantize_input: Callable, quantize_weight: Callable,
                       input_mask: Callable, weight_mask: Callable, output_quantizer: Callable,
                       sample: SampledGemm | None = None, input_operand: Callable | None = None,
                       kernel: str = "auto"):
    """The backward-mode machinery for one GEMM or a group of expert GEMMs.

    Args:
        cfg: a :class:`BackwardConfig`.
        x: the input.
        weight: a weight tensor or a list of expert weights.
        gemm: ``gemm(x_operand, weight_operand)``; returns a tensor or a tuple whose first element is the output.
        quantize_input: fake-quantizes (and calibrates) the input operand; identity when disabled.
        quantize_weight: fake-quantizes (and calibrates) the weight operand; identity when disabled.
        input_mask: ``mask(x)`` -> the input's clipped-STE mask or None.
        weight_mask: ``mask(weight)`` -> the weight's clipped-STE mask or None (maps over lists).
        output_quantizer: applied to the GEMM output.
        sample: in a step precision autoswitch samples, how the operands are measured and selected.
        input_operand: the GEMM's unquantized input operand as a function of ``x`` (default ``x`` itself); an
            expert down projection's is ``scale_rows(x, prob)``, and ``quantize_input`` then returns
            ``scale_rows(Q(x), prob)`` (see :mod:`.row_scale`).
        kernel: ``config.kernel`` (auto | triton | torch) for the output gradient's fake quant (``quantized`` mode).
    """
    operand = input_operand or _identity
    if sample is not None:
        return _run_sampled_gemm(cfg, x, weight, gemm, sample, input_mask, weight_mask, output_quantizer, operand)
    xq = quantize_input(x)
    wq = quantize_weight(weight)
    changed = xq is not x or (any(a is not b for a, b in zip(wq, weight, strict=True))
                             if isinstance(weight, list | tuple) else wq is not weight)
    if cfg.mode == "high_precision" and changed:
        with torch.no_grad():
            quantized = gemm(xq.detach(), _map(torch.Tensor.detach, wq))
        x_hp = operand(mask_grad(x, input_mask(x)))
        w_hp = _map(lambda w: mask_grad(w, weight_mask(w)), weight)
        precise = gemm(x_hp, w_hp)
        result = _replace_first(precise, forward_value_of(_first(precise), _first(quantized)))
    else:
        result = gemm(xq, wq)
        if cfg.mode == "quantized" and changed:  # a layer whose quantizers are all off stays a float layer
            result = _replace_first(result, quantize_grad(_first(result), cfg.grad_format, kernel))
    return _replace_first(result, output_quantizer(_first(result)))


def _either(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return b if a is None else a
    return a | b


def _run_sampled_gemm(cfg, x, weight, gemm, sample: SampledGemm, input_mask, weight_mask, output_quantizer,
                      operand: Callable = _identity):
    s = sample.sampler
    xq, x_sums = sample.quantize_input_stats(x)
    wq, w_sums = sample.quantize_weight_stats(weight)
    cx, cw = s.crossed(x_sums), s.crossed(w_sums)
    fprop = _either(cx, cw) if s.monitors("fprop") else None
    dgrad = cw if s.monitors("dgrad") else None
    wgrad = cx if s.monitors("wgrad") else None
    record = s.record(x_sums, w_sums, {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad})
    x_op = operand(x)  # the unquantized operand the selections take rows from
    x_f, w_f = sample.select_input(fprop, x_op, xq), sample.select_weight(fprop, weight, wq)
    if not torch.is_grad_enabled():
        result = gemm(x_f, w_f)
    else:
        if cfg.mode == "high_precision":
            x_b = operand(mask_grad(x, input_mask(x)))
            w_b = _map(lambda w: mask_grad(w, weight_mask(w)), weight)
        else:
            x_b, w_b = sample.select_input(wgrad, x_op, xq), sample.select_weight(dgrad, weight, wq)
        with torch.no_grad():
            value = gemm(x_f.detach(), _map(torch.Tensor.detach, w_f))
        precise = gemm(x_b, w_b)
        result = _replace_first(precise, forward_value_of(_first(precise), _first(value)))
        if cfg.mode == "quantized":
            result = _replace_first(result, _QuantizeGradSampled.apply(_first(result), cfg.grad_format, s, record))
    return _replace_first(result, output_quantizer(_first(result)))


def _with_sums(q, fn: Callable, operand: Callable = _identity) -> Callable:
    """``t -> (operand(fn(t)), the [1, 4] quantization-error sums of fn(t) against t)`` (sums None when ``q`` does
    not quantize)."""
    def run(t):
        out = fn(t)
        return operand(out), (quant_error_sums(t, out)[None] if q.is_quantizing else None)
    return run


def apply_quantized_gemm(module, x: torch.Tensor, weight: torch.Tensor, gemm: Callable,
                         row_scale: torch.Tensor | None = None):
    """Runs ``gemm(x_operand, weight_operand)`` with the module's quantizers and backward mode.

    Args:
        module: has ``input_quantizer``, ``weight_quantizer``, ``output_quantizer`` and ``quant_backward``
            (a :class:`BackwardConfig`); the quantizers may be experts' views (``SequentialMLP``).
        x: the original input operand.
        weight: the original weight operand.
        gemm: the layer's own GEMM; returns a tensor or a tuple whose first element is the output.
        row_scale: an expert down projection's router probabilities, one per row of ``x``: the input operand is
            ``scale_rows(Q(x), row_scale)`` (:mod:`.row_scale`).

    Returns:
        What ``gemm`` returns, with the output passed through ``output_quantizer``.
    """
    iq, wq = module.input_quantizer, module.weight_quantizer
    operand = _identity if row_scale is None else _row_scaled(rows_of(row_scale, x, type(module).__name__))

    def quantize_weight(w):
        return quantize_weight_operand(module, wq, w)

    def quantize_input_only(t):
        return quantize_input_operand(module, iq, t)

    def quantize_input(t):
        return operand(quantize_input_operand(module, iq, t))

    sampler = gemm_sampler(module)
    sample = None
    if sampler is not None and (iq.is_quantizing or wq.is_quantizing):
        sample = SampledGemm(sampler, _with_sums(iq, quantize_input_only, operand), _with_sums(wq, quantize_weight),
                             select_tensor, select_tensor)
    return run_quantized_gemm(module.quant_backward, x, weight, gemm,
                              quantize_input_only if row_scale is None else quantize_input,
                              quantize_weight, lambda t: clip_mask_of(iq, t), lambda t: clip_mask_of(wq, t),
                              module.output_quantizer, sample, None if row_scale is None else operand)


def _row_scaled(scale: torch.Tensor) -> Callable:
    return lambda t: scale_rows(t, scale)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _replace_first(result, value):
    return (value, *result[1:]) if isinstance(result, tuple) else value
