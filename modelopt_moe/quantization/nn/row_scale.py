"""The router probability of an expert's down projection, applied where serving engines apply it.

Megatron-Core's expert MLPs multiply each token's router probability into the activation before ``linear_fc2``;
serving engines (vLLM, SGLang, TensorRT-LLM, transformers) multiply it into ``down_proj``'s output, so the input they
quantize, with the exported static scale, is ``act`` itself. A quantized expert layer therefore calls the host's
forward with probabilities of one and hands the real ones to its down projection for the duration of the call
(:func:`down_proj_row_scale`). The down projection quantizes ``act`` (calibration sees ``act`` too) and feeds its
GEMM ``scale_rows(Q(act), prob)`` (the same launch on the kernel path), which is the engines' ``prob *
down_proj(Q(act))`` up to the GEMM's rounding: a per-row scale commutes with the GEMM. A bias the down projection
returns instead of adding is added as ``out + prob * bias`` (:func:`add_row_scaled_bias`), Megatron's own formula,
after the GEMM and before anything else touches the output.

Gradients: the tokens get ``prob * grad`` through the straight-through estimator of ``Q``; the probabilities get
``sum(grad * Q(act))`` per row (plus the bias term), so the router trains as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["DOWN_PROJ_INPUT", "down_proj_row_scale", "row_scale_of", "rows_of", "add_row_scaled_bias"]

DOWN_PROJ_INPUT = "act_before_router_prob"
"""The convention of this version, recorded in the quantization state: an expert down projection's input quantizer
sees (and is calibrated on) the activation before the router probability multiplies it. States without it were
calibrated on ``prob * act``."""

_ATTR = "_down_proj_row_scale"


@contextlib.contextmanager
def down_proj_row_scale(module: nn.Module, scale: torch.Tensor) -> Iterator[None]:
    """Inside the block, the quantized forward of ``module`` (an expert down projection) multiplies row ``t`` of its
    fake-quantized input by ``scale[t]`` and adds a returned bias times the same scale.

    The scale is an argument of this one call, held in ``module.__dict__`` only while the block runs (the host
    framework's forward sits between the expert layer that has the probabilities and the linear that needs them).

    Raises:
        RuntimeError: a row scale is already active on ``module`` (the blocks do not nest).
    """
    if module.__dict__.get(_ATTR) is not None:
        raise RuntimeError(f"{type(module).__name__}: a down-projection row scale is already active on this module")
    module.__dict__[_ATTR] = scale
    try:
        yield
    finally:
        module.__dict__.pop(_ATTR, None)


def row_scale_of(module: nn.Module) -> torch.Tensor | None:
    """The row scale :func:`down_proj_row_scale` gave ``module`` for the current call, or None."""
    return module.__dict__.get(_ATTR)


def rows_of(scale: torch.Tensor, x: torch.Tensor, what: str) -> torch.Tensor:
    """``scale`` shaped like the rows of ``x`` (``x.shape[:-1]``).

    Raises:
        ValueError: ``scale`` has not one value per row of ``x`` (naming ``what`` and both shapes).
    """
    rows = x.shape[:-1]
    if scale.numel() != rows.numel():
        raise ValueError(f"{what}: the router probabilities have {scale.numel()} entries "
                         f"(shape {tuple(scale.shape)}) but the down projection's input {tuple(x.shape)} has "
                         f"{rows.numel()} rows; padded or reordered tokens between the expert layer and its "
                         "linear_fc2 are not supported")
    return scale.reshape(rows)


def add_row_scaled_bias(out: torch.Tensor, bias: torch.Tensor | Sequence[torch.Tensor], scale: torch.Tensor,
                        m_splits=None) -> torch.Tensor:
    """``(out + bias * scale[..., None]).to(out.dtype)``: Megatron's ``t + b * p`` for the bias a down projection
    returns (``MLP.forward``; per expert, ``TEGroupedMLP._apply_bias``), bit for bit, gradients included.

    Args:
        out: the GEMM output ``[..., H]`` (rows of ``scale``).
        bias: one ``[H]`` bias, or one per expert (row blocks ``m_splits``, a list of ints or a tensor).
        scale: the rows' probabilities.
        m_splits: the experts' row counts when ``bias`` is a list.
    """
    scale = rows_of(scale, out, "add_row_scaled_bias").unsqueeze(-1)
    if isinstance(bias, torch.Tensor):
        return (out + bias * scale).to(out.dtype)
    # Expert by expert, as Megatron does: each bias gradient is then the same reduction over its rows.
    splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else [int(m) for m in m_splits]
    flat, flat_scale = out.reshape(-1, out.shape[-1]), scale.reshape(-1, 1)
    parts = [t + b * p for t, b, p in zip(flat.split(splits), bias, flat_scale.split(splits), strict=True)]
    return torch.cat(parts).view(out.shape).to(out.dtype)
