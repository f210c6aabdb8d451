"""Number formats and their pure-torch reference fake quantization: the numeric contract.

Every fast path in this package (the Triton kernels, CPU or GPU, one expert or N) must reproduce the bits
computed here. All arithmetic is fp32 with IEEE rounding (true division, not a reciprocal multiply).

Formats (``fmt``):

* ``"e4m3"`` / ``"e5m2"``: ``scale = bound / amax`` (bound 448 / 57344);
  ``q = fp8(clamp(x * scale, -bound, bound))`` rounded to nearest even; output ``q / scale``.
* ``"nvfp4"``: global scale ``sg = amax / (6 * 448)``; each block of 16 along the last dim gets
  ``sb = e4m3(clamp(blockmax / 6 / sg, 0, 448))`` and ``s = sb * sg``; values ``x / s`` round to E2M1
  ``{0, .5, 1, 1.5, 2, 3, 4, 6}`` (ties to even, saturating at 6); output ``q * s``. Where ``s == 0`` (an
  all-zero block, or a block scale that underflows E4M3) ``x * 0`` is used instead of ``x / s``.
* ``"int8"`` / ``"int4"`` (and ``"int2"`` .. ``"int7"``): ``scale = B / amax`` with ``B = 2**(b-1) - 1`` (127 / 7,
  Model Optimizer's scale as well); ``q = clamp(round_half_even(x * scale), lo, B)``; output ``q / scale``. ``lo``
  is ``-B`` with ``narrow_range=True`` (symmetric) and ``-B - 1`` with ``narrow_range=False`` (-128 / -8: Model
  Optimizer's default and the configs' default; this function's keyword defaults to the symmetric range).
  ``unsigned=True`` (reference only, not the kernels): ``B = 2**b - 1``, ``lo = 0``. With ``block_size`` the amax of
  each block of the last dim is taken from the data itself (dynamic, like NVFP4's block scales), so it tracks the
  weights during QAT; a last dim that is not a multiple of ``block_size`` is zero-padded to one (as Model Optimizer
  pads), which leaves every block maximum unchanged: the last block of each row is simply shorter.

Edge-value rules (tested in ``tests/unit/numerics/test_formats.py``):

* An amax that is ``<= 2**-24``, zero, negative, NaN or Inf is *invalid* and is replaced by the format's bound,
  i.e. the scale becomes exactly 1 (NVFP4: ``sg = 1``). No NaN or Inf ever comes from the amax.
* A NaN input stays NaN in its own element and nowhere else (block maxima ignore NaN).
* An Inf input saturates to the format's largest value times the scale (block maxima see it as Inf, so that
  block's scale saturates too).
* Inputs may be bf16, fp16 or fp32; the output has the input's dtype (rounded to nearest even from fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FORMATS",
    "TINY_AMAX",
    "NVFP4_BLOCK_SIZE",
    "E4M3_MAX",
    "E2M1_MAX",
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

# An amax at or below this (the smallest fp16 subnormal) is treated as "never calibrated / all zero".
TINY_AMAX = 2.0**-24
NVFP4_BLOCK_SIZE = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0


@dataclass(frozen=True)
class FormatSpec:
    """A number format: its name, its kind and the largest magnitude it represents (the "bound")."""

    name: str
    kind: str  # "fp8", "fp4" or "int"
    bound: float
    num_bits: int | tuple[int, int]
    code: int  # the number the Triton kernels take as their FMT constexpr


FORMATS: dict[str, FormatSpec] = {
    "e4m3": FormatSpec("e4m3", "fp8", E4M3_MAX, (4, 3), 0),
    "e5m2": FormatSpec("e5m2", "fp8", 57344.0, (5, 2), 1),
    # NVFP4's amax bound is the product of its element bound and its block-scale bound.
    "nvfp4": FormatSpec("nvfp4", "fp4", E2M1_MAX * E4M3_MAX, (2, 1), 2),
    "int8": FormatSpec("int8", "int", 127.0, 8, 3),
    "int4": FormatSpec("int4", "int", 7.0, 4, 4),
    # The other integer widths Model Optimizer takes (its num_bits may be any int); kernel codes 5..9.
    **{f"int{b}": FormatSpec(f"int{b}", "int", float(2 ** (b - 1) - 1), b, code)
       for code, b in zip(range(5, 10), (2, 3, 5, 6, 7), strict=True)},
}

_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_INT_FORMATS = [name for name, spec in FORMATS.items() if spec.kind == "int"]
_NUM_BITS_TO_FORMAT = {(4, 3): "e4m3", (5, 2): "e5m2", (2, 1): "nvfp4",
                       **{FORMATS[name].num_bits: name for name in sorted(_INT_FORMATS, reverse=True)}}
_NUM_BITS_ALIASES = {"e4m3": "e4m3", "fp8": "e4m3", "e5m2": "e5m2", "e2m1": "nvfp4", "nvfp4": "nvfp4",
                     **{name: name for name in sorted(_INT_FORMATS, reverse=True)}}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def get_format(fmt: str) -> FormatSpec:
    """Returns the :class:`FormatSpec` named ``fmt``.

    Raises:
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(FORMATS)}") from None


def format_from_num_bits(num_bits: int | str | tuple | list) -> str:
    """Maps a Model-Optimizer style ``num_bits`` (``(4, 3)``, ``8``, ``"e2m1"``, ...) to a format name.

    Raises:
        ValueError: ``num_bits`` names no supported format.
    """
    if isinstance(num_bits, str):
        key = num_bits.strip().lower()
        if key in _NUM_BITS_ALIASES:
            return _NUM_BITS_ALIASES[key]
    else:
        key = tuple(num_bits) if isinstance(num_bits, list | tuple) else num_bits
        try:
            if key in _NUM_BITS_TO_FORMAT and not isinstance(key, bool):
                return _NUM_BITS_TO_FORMAT[key]
        except TypeError:  # unhashable (a nested list, a mapping): not a format either
            pass
    allowed = [*(str(k) for k in _NUM_BITS_TO_FORMAT), *(repr(k) for k in _NUM_BITS_ALIASES)]
    raise ValueError(f"unsupported num_bits {num_bits!r}; expected one of {', '.join(allowed)}")


def safe_amax(amax: torch.Tensor, bound: float) -> torch.Tensor:
    """Returns ``amax`` in fp32 with every invalid entry (<= 2**-24, NaN, Inf) replaced by ``bound``."""
    amax = amax.float()
    valid = torch.isfinite(amax) & (amax > TINY_AMAX)
    return torch.where(valid, amax, torch.full_like(amax, bound))


def clip_limit(amax: torch.Tensor) -> torch.Tensor:
    """The bound of the clipped straight-through estimator: ``amax`` in fp32, with every invalid entry (<= 2**-24,
    NaN, Inf) replaced by +Inf, so that an invalid amax clips nothing."""
    a = amax.float()
    return torch.where(torch.isfinite(a) & (a > TINY_AMAX), a, torch.full_like(a, float("inf")))


def int_range(spec: FormatSpec, narrow_range: bool = True, unsigned: bool = False) -> tuple[float, float]:
    """``(lo, hi)``: the integer levels of an int format. Signed: ``(-B, B)`` narrow, ``(-B - 1, B)`` wide (two's
    complement, Model Optimizer's default); unsigned: ``(0, 2**b - 1)``.

    Raises:
        ValueError: ``spec`` is not an int format.
    """
    if spec.kind != "int":
        raise ValueError(f"int_range: format {spec.name!r} is not an integer format")
    if unsigned:
        return 0.0, float(2**spec.num_bits - 1)
    return (-spec.bound if narrow_range else -spec.bound - 1.0), spec.bound


def _nan_ignoring_block_max(xf: torch.Tensor, block_size: int) -> torch.Tensor:
    """Max of |x| over blocks of the last dim, NaN ignored; shape ``[..., K // block_size, 1]``."""
    blocks = xf.unflatten(-1, (-1, block_size)).abs()
    return torch.where(torch.isnan(blocks), torch.zeros_like(blocks), blocks).amax(dim=-1, keepdim=True)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Rounds fp32 values to the nearest E2M1 value (ties to even mantissa), saturating at +-6, NaN kept."""
    a = v.abs()
    # Each step is (upper edge, inclusive?): a tie goes to the neighbour whose mantissa bit is 0.
    mag = torch.full_like(a, E2M1_MAX)
    mag = torch.where(a <= 5.0, 4.0, mag)
    mag = torch.where(a < 3.5, 3.0, mag)
    mag = torch.where(a <= 2.5, 2.0, mag)
    mag = torch.where(a < 1.75, 1.5, mag)
    mag = torch.where(a <= 1.25, 1.0, mag)
    mag = torch.where(a < 0.75, 0.5, mag)
    mag = torch.where(a <= 0.25, 0.0, mag)
    return torch.where(torch.isnan(v), v, torch.copysign(mag, v))


def _check_inputs(x: torch.Tensor, fmt: str, amax: torch.Tensor | None, block_size: int | None) -> FormatSpec:
    spec = get_format(fmt)
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fake_quant: input dtype {x.dtype} not supported; expected one of {_FLOAT_DTYPES}")
    needs_amax = not (spec.kind == "int" and block_size is not None)
    if needs_amax and amax is None:
        raise ValueError(f"fake_quant: format {fmt!r} needs an amax tensor, got None")
    if fmt == "nvfp4" and block_size not in (None, NVFP4_BLOCK_SIZE):
        raise ValueError(f"fake_quant: nvfp4 uses blocks of {NVFP4_BLOCK_SIZE}, got block_size={block_size}")
    if spec.kind == "fp8" and block_size is not None:
        raise ValueError(f"fake_quant: format {fmt!r} has no block mode, got block_size={block_size}")
    if block_size is not None and spec.kind == "int" and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"fake_quant: block_size must be a positive int, got {block_size!r}")
    # Int blocks pad the last dim (below); NVFP4's blocks of 16 must tile it exactly.
    if fmt == "nvfp4" and (x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK_SIZE != 0):
        raise ValueError(f"fake_quant: last dim of shape {tuple(x.shape)} must be a multiple of block size "
                         f"{NVFP4_BLOCK_SIZE} (nvfp4 blocks are never padded)")
    if block_size is not None and x.dim() == 0:
        raise ValueError(f"fake_quant: block_size={block_size} needs a tensor with a last dim, got a scalar")
    if amax is not None and needs_amax:
        try:
            fits = torch.broadcast_shapes(amax.shape, x.shape) == x.shape
        except RuntimeError:
            fits = False
        if not fits or (fmt == "nvfp4" and amax.dim() > 0 and amax.shape[-1] != 1):
            raise ValueError(
                f"fake_quant: amax of shape {tuple(amax.shape)} does not broadcast to input {tuple(x.shape)}"
                + (" with size 1 in the last dim (nvfp4 blocks run along it)" if fmt == "nvfp4" else "")
            )
    return spec


def _div(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """IEEE ``num / den`` in fp32. torch turns ``float / tensor`` into ``reciprocal(tensor) * float`` and, on CUDA,
    ``tensor / float`` (or a CPU-scalar divisor) into a multiply by the reciprocal: both round twice and the second
    differs between CPU and GPU. Dividing two tensors on one device is a true division everywhere."""
    ref = num if isinstance(num, torch.Tensor) else den
    num, den = (
        t.to(ref.device) if isinstance(t, torch.Tensor) else torch.full((), t, dtype=torch.float32, device=ref.device)
        for t in (num, den)
    )
    return torch.div(num, den)


@dataclass(frozen=True)
class Quantized:
    """What :func:`fake_quant` rounds ``x`` to, before it multiplies back: the format's values and scales.

    ``fake_quant(x, ...) == dequantize(quantize(x, ...)).to(x.dtype)`` bit for bit (the same fp32 operations), so an
    exporter that stores these values and scales stores exactly what training used.

    Attributes:
        fmt: the format name.
        values: fp32 values on the format's grid (E4M3 / E5M2 values, E2M1 values, integers), shape of ``x``
            (``[..., K // block, block]`` for block formats).
        scale: fp8 and int per tensor / channel: the divisor ``bound / amax`` (``values / scale`` is the output);
            nvfp4: the per-tensor (per-expert) second-level scale ``sg = amax / (6 * 448)``, broadcastable over the
            block view; int blocks: the divisor of each block ``[..., K // block, 1]``.
        block_scale: nvfp4 only: each block's E4M3 scale ``sb`` as fp32, ``[..., K // 16, 1]``.
        block_size: the block length of the last dim (nvfp4: 16; int with blocks), None per tensor / channel.
        length: int blocks: the last dim before its zero padding to a whole number of blocks.
    """

    fmt: str
    values: torch.Tensor
    scale: torch.Tensor
    block_scale: torch.Tensor | None = None
    block_size: int | None = None
    length: int | None = None


def quantize(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None, block_size: int | None = None, *,
             narrow_range: bool = True, unsigned: bool = False) -> Quantized:
    """The values and scales :func:`fake_quant` computes (same arguments, same checks); see :class:`Quantized`."""
    spec = _check_inputs(x, fmt, amax, block_size)
    if spec.kind != "int" and (unsigned or not narrow_range):
        raise ValueError(f"fake_quant: narrow_range / unsigned apply to int formats only, got format {fmt!r} with "
                         f"narrow_range={narrow_range}, unsigned={unsigned}")
    xf = x.float()
    if spec.kind == "fp8":
        scale = _div(spec.bound, safe_amax(amax, spec.bound))
        q = torch.clamp(xf * scale, -spec.bound, spec.bound).to(_FP8_DTYPES[fmt]).float()
        return Quantized(fmt, q, scale)
    if spec.kind == "int":
        lo, hi = int_range(spec, narrow_range, unsigned)
        if block_size is None:
            scale = _div(hi, safe_amax(amax, hi))
            return Quantized(fmt, torch.clamp(torch.round(xf * scale), lo, hi), scale)
        k = xf.shape[-1]
        pad = -k % block_size
        xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
        blocks = xp.unflatten(-1, (-1, block_size))
        scale = _div(hi, safe_amax(_nan_ignoring_block_max(xp, block_size), hi))
        return Quantized(fmt, torch.clamp(torch.round(blocks * scale), lo, hi), scale, block_size=block_size,
                         length=k)
    # nvfp4
    sg = _div(safe_amax(amax, spec.bound), spec.bound)
    sg = sg.unsqueeze(-1) if sg.dim() > 0 else sg  # broadcast over the [..., K/16, 16] block view
    blocks = xf.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    block_max = _nan_ignoring_block_max(xf, NVFP4_BLOCK_SIZE)
    sb = torch.clamp(_div(_div(block_max, E2M1_MAX), sg), 0.0, E4M3_MAX).to(torch.float8_e4m3fn).float()
    s = sb * sg
    v = torch.where(s > 0, _div(blocks, s), blocks * 0.0)
    return Quantized(fmt, round_to_e2m1(v), sg, sb, NVFP4_BLOCK_SIZE)


def dequantize(qx: Quantized) -> torch.Tensor:
    """``values`` times their scales in fp32, in :func:`fake_quant`'s order of operations (its output before the
    cast to the input dtype)."""
    if qx.block_scale is not None:  # nvfp4: one multiply by the combined scale, as fake_quant does
        return (qx.values * (qx.block_scale * qx.scale)).flatten(-2)
    out = _div(qx.values, qx.scale)
    if qx.block_size is None:
        return out
    out = out.flatten(-2)
    return out[..., :qx.length] if qx.length is not None else out


def fake_quant(
    x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None, block_size: int | None = None, *,
    narrow_range: bool = True, unsigned: bool = False,
) -> torch.Tensor:
    """Quantizes and dequantizes ``x`` in format ``fmt`` (the reference every fast path must match bit for bit).

    Args:
        x: bf16, fp16 or fp32 tensor.
        fmt: one of :data:`FORMATS`.
        amax: fp32 amax that broadcasts to ``x`` (scalar, per-channel ``[C, 1]``, per-expert ``[N, 1, 1]``, ...).
            For ``nvfp4`` it is the global (per-tensor or per-expert) amax. Unused for int formats with
            ``block_size``.
        block_size: int formats only: quantize blocks of this many elements of the last dim, each with its own
            scale from the block's data (a last dim that is not a multiple is zero-padded). ``nvfp4`` always uses
            blocks of 16.
        narrow_range: int formats only: the symmetric range ``[-B, B]`` (True) or two's complement ``[-B-1, B]``.
        unsigned: int formats only: levels ``[0, 2**b - 1]`` (negative inputs clamp to 0).

    Returns:
        The fake-quantized tensor, same shape and dtype as ``x``.

    Raises:
        ValueError: on an unknown format, an unsupported dtype, a missing or non-broadcastable amax, an nvfp4
            last dim that is not a multiple of 16, or ``narrow_range=False`` / ``unsigned`` on a float format.
    """
    return dequantize(quantize(x, fmt, amax, block_size, narrow_range=narrow_range, unsigned=unsigned)).to(x.dtype)
