"""MXFP4 (OCP microscaling): E2M1 values in blocks of 32 along the last dim, one E8M0 power-of-two scale per block, no
second-level scale and no calibrated amax. The pure-torch reference, following NVIDIA Model Optimizer 0.47's MX fake
quant (``num_bits: (2, 1)``, ``block_sizes: {-1: 32, type: dynamic, scale_bits: (8, 0)}``, ``MXFP4_DEFAULT_CFG``).

For each block, with ``amax`` its largest magnitude:

* the shared exponent ``e = clamp(ceil(log2(amax / 6)), -127, 127)``, where ``amax / 6`` is the IEEE fp32 quotient
  and ``ceil(log2(.))`` is read exactly from its bits (a quotient that is a power of two gives that power; a quotient
  of 0, from an amax that underflows, gives -127);
* the values ``|x| * 2**-e`` round to E2M1 ``{0, .5, 1, 1.5, 2, 3, 4, 6}``, ties to even, saturating at 6 (Model
  Optimizer's fake quant; its MXFP4 *exporter* rounds ties toward zero instead, so an exporter must store these
  codes, not re-round);
* output ``q * 2**e`` with the sign of ``x``, in ``x``'s dtype (bf16, fp16 or fp32 in, the same dtype out).

Model Optimizer's rule is not the OCP MX spec's: OCP takes ``e = floor(log2(amax)) - 2`` (2 is E2M1's largest
exponent) and clips the block's largest values to 6, while ``ceil(log2(amax / 6))`` never clips (``amax * 2**-e <=
6``). The two differ exactly where the block maximum's significand exceeds 1.5 (about 41% of blocks for data of
spread magnitudes); there Model Optimizer's exponent is larger by one. Ours is Model Optimizer's.

Edge rules:

* all-zero block (and a block whose elements are all NaN): ``e = 0``, every element 0 (NaN stays NaN);
* a block holding Inf: its amax is invalid, so ``e = 0`` (Model Optimizer's rule for an amax that is 0, Inf or NaN):
  the Inf becomes ``+-6`` and the other elements round at scale 1;
* NaN: the block maximum ignores it (as Model Optimizer's ``fmaxf`` reduction does) and it stays NaN in its own
  element. Model Optimizer's kernel leaves the sign of a NaN (and of a zero) input unset and returns a saturated
  value for NaN: undefined there, NaN here. ``-0.0`` keeps its sign;
* a last dim that is not a multiple of 32 is zero-padded to one (as Model Optimizer pads): the last block of each row
  is simply shorter, its maximum unchanged;
* Model Optimizer builds its MX kernel with ``--use_fast_math``: the quotient ``amax / 6`` is then not correctly
  rounded and fp32 subnormals flush to zero. Both matter only at edges (a quotient within an ulp of a power of two;
  data below 2**-126); the GPU comparison against the installed package settles them. This reference uses IEEE
  arithmetic throughout.
"""

from __future__ import annotations

import torch

from .format import Format, Quantized, ScaleLayout, nan_ignoring_block_max, true_div
from .nvfp4 import E2M1_MAX, round_to_e2m1

__all__ = ["MX_BLOCK_SIZE", "E8M0_MIN", "E8M0_MAX", "MXFP4Format", "MXFP4", "e8m0_exponent"]

MX_BLOCK_SIZE = 32
E8M0_MIN, E8M0_MAX = -127, 127  # the exponents an E8M0 scale holds (bias 127; 0xFF is NaN)


def e8m0_exponent(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """``clamp(ceil(log2(amax / element_max)), -127, 127)`` per entry as int32, exactly from the quotient's bits;
    0 where ``amax`` is 0, Inf or NaN (Model Optimizer's invalid-amax rule).

    Args:
        amax: fp32 block maxima (>= 0 or NaN).
        element_max: the element format's largest value (6 for E2M1).
    """
    amax = amax.float()
    ratio = true_div(amax, element_max)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    # log2(ratio) = exponent - 1 + log2(2 * mantissa): an integer when mantissa is exactly 0.5, else rounded up.
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    e = torch.where(ratio == 0, E8M0_MIN, ceil_log2).clamp(E8M0_MIN, E8M0_MAX)
    invalid = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(invalid, 0, e).to(torch.int32)


class MXFP4Format(Format):
    """E2M1 values with one E8M0 power-of-two scale per block of the data's own maximum."""

    def needs_amax(self, block_size: int | None) -> bool:
        """Never: every scale comes from its block."""
        return False

    def block_size_problem(self, block_size: int | None) -> str | None:
        """Blocks of 32 only."""
        if block_size is None or block_size == self.block_length:
            return None
        return f"{self.name} uses blocks of {self.block_length}, got block_size={block_size}"

    def _check_inputs(self, x: torch.Tensor, amax: torch.Tensor | None, block_size: int | None) -> None:
        # Unlike NVFP4 the blocks pad (as Model Optimizer's MX kernel does), so only the generic checks apply.
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"fake_quant: input dtype {x.dtype} not supported; expected fp32, bf16 or fp16")
        problem = self.block_size_problem(block_size)
        if problem is not None:
            raise ValueError(f"fake_quant: {problem}")
        if x.dim() == 0:
            raise ValueError(f"fake_quant: {self.name} needs a tensor with a last dim, got a scalar")

    def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
        b = self.block_length
        k = xf.shape[-1]
        pad = -k % b
        xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
        e = e8m0_exponent(nan_ignoring_block_max(xp, b), E2M1_MAX)  # [..., K / 32, 1]
        # The divisor 2**-e, as the int blocks' scale: a power of two, so x * scale and q / scale are exact (up to
        # fp32 subnormals, see the module docstring).
        scale = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=xf.device), -e)
        q = round_to_e2m1(xp.unflatten(-1, (-1, b)) * scale)
        return Quantized(self.name, q, scale, block_size=b, length=k)


# Not in the registry yet: the config, kernels and export take it when it is registered.
MXFP4 = MXFP4Format("mxfp4", (2, 1), E2M1_MAX, E2M1_MAX, "MXFP4", frozenset({ScaleLayout.BLOCKS_1D}), kernel=None,
                    aliases=("mxfp4",), block=(MX_BLOCK_SIZE,), block_scale="e8m0")
