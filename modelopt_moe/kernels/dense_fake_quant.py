"""One tensor, a dense layer's weight or its input, through the grouped fake-quant ops: the one-expert case of the
experts' kernels, bit-exact with :func:`modelopt_moe.numerics.fake_quant` and with its straight-through gradient
(pass-through, or clipped where ``|x| > amax``).

No kernel of its own: a weight with one amax per output channel (``[C, 1]``) or with 2-D blocks is the only expert
of :func:`~.weight_fake_quant.grouped_weight_fake_quant_ste` (the N = 1 case of the expert weights' launch); every
other tensor is a token matrix of one expert (its leading dims flattened) for
:func:`~.input_fake_quant.grouped_input_fake_quant_ste`, whose launch reads no pointer table (activations change
address at every call). The ops pick Triton or their torch fallback as they do for experts.

:func:`dense_layout` says which tensors the ops take; the caller runs the reference for the others (a per-token or
other per-channel amax, a scalar or non-contiguous tensor, a last dim that a format's fixed blocks do not tile, a
block size the kernels' checks refuse, a non-float dtype).
"""

from __future__ import annotations

import torch

from ..numerics import get_format
from .checks import FLOAT_DTYPES, check_format
from .input_fake_quant import grouped_input_fake_quant_ste
from .weight_fake_quant import grouped_weight_fake_quant_ste

__all__ = ["dense_layout", "dense_fake_quant_ste"]

TOKENS = "tokens"
WEIGHT = "weight"


def dense_layout(x: torch.Tensor, amax: torch.Tensor | None, fmt: str, block_size) -> str | None:
    """How the grouped ops take ``x`` with ``amax`` (``[]``, ``[C, 1]`` or None) in ``fmt`` / ``block_size``:
    ``"tokens"`` (a token matrix of one expert: a per-tensor amax, or none), ``"weight"`` (one expert weight: a 2-D
    ``x`` with one amax per row, or 2-D blocks), or None where they do not (the reference's layouts only)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() == 0 or x.numel() == 0:
        return None
    if not x.is_contiguous():  # the reference's output keeps a permuted layout, which the next op may read otherwise
        return None
    try:
        check_format(fmt, block_size)
    except ValueError:
        return None  # the reference takes it, or names the problem
    spec = get_format(fmt)
    if not spec.pads and spec.block_length is not None and x.shape[-1] % spec.block_length:
        return None
    if isinstance(block_size, tuple):
        return WEIGHT if amax is None and x.dim() == 2 else None
    if amax is None or amax.dim() == 0:
        return TOKENS
    if x.dim() == 2 and tuple(amax.shape) == (x.shape[0], 1):
        return WEIGHT
    return None


def dense_fake_quant_ste(x: torch.Tensor, amax: torch.Tensor | None, fmt: str, block_size=None,
                         ste: str = "pass_through", narrow_range: bool = True) -> torch.Tensor:
    """Differentiable fake quant of one tensor through the grouped ops: the bits of
    ``formats.fake_quant(x, fmt, amax, block_size, narrow_range=...)`` and the gradient of its straight-through
    estimator (``ste``: ``pass_through`` or ``clipped``; ``amax`` gets none).

    Args:
        x: a dense weight or an input, contiguous, bf16 / fp16 / fp32.
        amax: ``[]`` per tensor, ``[C, 1]`` per output channel of a 2-D ``x``, or None where the format takes every
            scale from the data (on ``x``'s device).
        fmt: a registered format name.
        block_size: as ``formats.fake_quant`` (an int, or ``(rows, cols)`` 2-D blocks of a weight).
        ste: the straight-through estimator.
        narrow_range: int formats only.

    Returns:
        ``x`` fake-quantized, shaped and typed like ``x``.

    Raises:
        ValueError: a layout the grouped ops do not take (:func:`dense_layout` is None), or one of their checks.
    """
    layout = dense_layout(x, amax, fmt, block_size)
    if layout is None:
        raise ValueError(f"dense_fake_quant_ste: tensor of shape {tuple(x.shape) if isinstance(x, torch.Tensor) else x}"
                         f" with amax of shape {None if amax is None else tuple(amax.shape)} in {fmt!r} "
                         f"(block_size={block_size!r}) is no layout of the grouped ops; use formats.fake_quant")
    if layout == WEIGHT:
        row_amax = None if amax is None else amax.reshape(1, -1)
        return grouped_weight_fake_quant_ste([x], row_amax, fmt, block_size, ste, narrow_range)[0]
    rows = x if x.dim() == 2 else x.view(-1, x.shape[-1])
    # One expert: every row takes its amax. A device tensor built there (a fill, no host copy or sync).
    splits = torch.full((1,), rows.shape[0], dtype=torch.int64, device=x.device)
    y = grouped_input_fake_quant_ste(rows, splits, amax, fmt, block_size, ste, narrow_range)
    return y if x.dim() == 2 else y.view(x.shape)
