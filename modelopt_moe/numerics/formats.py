"""The reference fake quantization of every registered format, by name: the numeric contract.

Every fast path in this package (the Triton kernels, CPU or GPU, one expert or N) must reproduce the bits computed
here. All arithmetic is fp32 with IEEE rounding (true division, not a reciprocal multiply). Each format's rule is
written in its home module (:mod:`.fp8`, :mod:`.nvfp4`, :mod:`.integer`, on the base :mod:`.format`); the formats
are listed in :mod:`.registry`. These functions look the format up and call it.

Edge-value rules, the same for every format (tested in ``tests/unit/numerics/test_formats.py``):

* An amax that is ``<= 2**-24``, zero, negative, NaN or Inf is *invalid* and is replaced by the format's bound,
  i.e. the scale becomes exactly 1 (NVFP4: ``sg = 1``). No NaN or Inf ever comes from the amax.
* A NaN input stays NaN in its own element and nowhere else (block maxima ignore NaN).
* An Inf input saturates to the format's largest value times the scale (block maxima see it as Inf, so that
  block's scale saturates too).
* Inputs may be bf16, fp16 or fp32; the output has the input's dtype (rounded to nearest even from fp32).
"""

from __future__ import annotations

import torch

from .format import TINY_AMAX, Quantized, clip_limit, safe_amax
from .format import Format as FormatSpec
from .fp8 import E4M3_MAX
from .integer import int_range
from .nvfp4 import E2M1_MAX, FOUR_OVER_SIX_SCALE_MAX, NVFP4_BLOCK_SIZE, round_to_e2m1
from .registry import FORMATS, format_from_num_bits, get_format

__all__ = [
    "FORMATS",
    "TINY_AMAX",
    "NVFP4_BLOCK_SIZE",
    "E4M3_MAX",
    "E2M1_MAX",
    "FOUR_OVER_SIX_SCALE_MAX",
    "FormatSpec",
    "get_format",
    "format_from_num_bits",
    "safe_amax",
    "clip_limit",
    "round_to_e2m1",
    "int_range",
    "fake_quant",
    "Quantized",
    "quantize",
    "dequantize",
]


def quantize(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None, block_size: int | None = None, *,
             narrow_range: bool = True, unsigned: bool = False) -> Quantized:
    """The values and scales :func:`fake_quant` computes (same arguments, same checks); see :class:`Quantized`."""
    return get_format(fmt).quantize(x, amax, block_size, narrow_range=narrow_range, unsigned=unsigned)


def dequantize(qx: Quantized) -> torch.Tensor:
    """``values`` times their scales in fp32, in :func:`fake_quant`'s order of operations (its output before the
    cast to the input dtype)."""
    return get_format(qx.fmt).dequantize(qx)


def fake_quant(
    x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None, block_size: int | None = None, *,
    narrow_range: bool = True, unsigned: bool = False,
) -> torch.Tensor:
    """Quantizes and dequantizes ``x`` in format ``fmt`` (the reference every fast path must match bit for bit).

    Args:
        x: bf16, fp16 or fp32 tensor.
        fmt: one of :data:`FORMATS`.
        amax: fp32 amax that broadcasts to ``x`` (scalar, per-channel ``[C, 1]``, per-expert ``[N, 1, 1]``, ...).
            For two-level formats (NVFP4) it is the global (per-tensor or per-expert) amax. Unused where the format
            takes every scale from the data (int formats with ``block_size``).
        block_size: int formats only: quantize blocks of this many elements of the last dim, each with its own
            scale from the block's data (a last dim that is not a multiple is zero-padded). Formats with a fixed
            block (NVFP4's 16) take only that one.
        narrow_range: int formats only: the symmetric range ``[-B, B]`` (True) or two's complement ``[-B-1, B]``.
        unsigned: int formats only: levels ``[0, 2**b - 1]`` (negative inputs clamp to 0).

    Returns:
        The fake-quantized tensor, same shape and dtype as ``x``.

    Raises:
        ValueError: on an unknown format, an unsupported dtype, a missing or non-broadcastable amax, a last dim that
            is not a multiple of a fixed block, or ``narrow_range=False`` / ``unsigned`` on a float format.
    """
    return get_format(fmt).fake_quant(x, amax, block_size, narrow_range=narrow_range, unsigned=unsigned)
