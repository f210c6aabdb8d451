"""INT2 - INT8, per tensor, per channel or in dynamic blocks of the last dim: the home of the integer formats.

``scale = B / amax`` with ``B = 2**(b-1) - 1`` (127 / 7, Model Optimizer's scale as well); ``q = clamp(round_half_even(x
* scale), lo, B)``; output ``q / scale``. ``lo`` is ``-B`` with ``narrow_range=True`` (symmetric) and ``-B - 1`` with
``narrow_range=False`` (-128 / -8: Model Optimizer's default and the configs' default; the reference's keyword
defaults to the symmetric range). ``unsigned=True`` (reference only, not the kernels): ``B = 2**b - 1``, ``lo = 0``.

With ``block_size`` the amax of each block of the last dim is taken from the data itself (dynamic, like NVFP4's block
scales), so it tracks the weights during QAT and no calibrated amax is needed (:meth:`IntFormat.needs_amax`: the one
place of that rule); a last dim that is not a multiple of ``block_size`` is zero-padded to one (as Model Optimizer
pads), which leaves every block maximum unchanged: the last block of each row is simply shorter.
"""

from __future__ import annotations

import torch

from .format import (
    Format,
    KernelRoutine,
    KernelSpec,
    Quantized,
    ScaleLayout,
    nan_ignoring_block_max,
    safe_amax,
    true_div,
)

__all__ = ["IntFormat", "INT_FORMATS", "int_range"]


class IntFormat(Format):
    """A symmetric integer format of ``num_bits`` bits: one divisor per tensor, channel or data block."""

    def needs_amax(self, block_size: int | None) -> bool:
        """An amax per tensor or channel; none with dynamic blocks, which take every scale from the data."""
        return block_size is None

    def check_config(self, block_sizes: dict | None, axis) -> None:
        """Blocks of any length, static or dynamic: the config's generic checks cover them."""
        return None

    def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
        lo, hi = int_range(self, narrow_range, unsigned)
        if block_size is None:
            scale = true_div(hi, safe_amax(amax, hi))
            return Quantized(self.name, torch.clamp(torch.round(xf * scale), lo, hi), scale)
        k = xf.shape[-1]
        pad = -k % block_size
        xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
        blocks = xp.unflatten(-1, (-1, block_size))
        scale = true_div(hi, safe_amax(nan_ignoring_block_max(xp, block_size), hi))
        return Quantized(self.name, torch.clamp(torch.round(blocks * scale), lo, hi), scale, block_size=block_size,
                         length=k)


def int_range(spec: Format, narrow_range: bool = True, unsigned: bool = False) -> tuple[float, float]:
    """``(lo, hi)``: the integer levels of an int format. Signed: ``(-B, B)`` narrow, ``(-B - 1, B)`` wide (two's
    complement, Model Optimizer's default); unsigned: ``(0, 2**b - 1)``.

    Raises:
        ValueError: ``spec`` is not an int format.
    """
    if not spec.integer:
        raise ValueError(f"int_range: format {spec.name!r} is not an integer format")
    if unsigned:
        return 0.0, float(2**spec.num_bits - 1)
    return (-spec.bound if narrow_range else -spec.bound - 1.0), spec.bound


def _int_format(bits: int) -> IntFormat:
    bound = float(2 ** (bits - 1) - 1)
    name = f"int{bits}"
    return IntFormat(name, bits, bound, bound, f"INT{bits}",
                     frozenset({ScaleLayout.PER_TENSOR, ScaleLayout.PER_CHANNEL, ScaleLayout.BLOCKS_1D}),
                     KernelSpec(KernelRoutine.SCALED_INT, bound), aliases=(name,), integer=True)


# INT8 and INT4 first, then the other widths Model Optimizer takes (its num_bits may be any int).
INT_FORMATS = tuple(_int_format(b) for b in (8, 4, 2, 3, 5, 6, 7))
