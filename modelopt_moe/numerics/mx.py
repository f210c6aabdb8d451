"""MX (OCP microscaling): MXFP4 and MXFP8, the home of the MX formats. Elements of a small float format (MXFP4: E2M1,
largest 6; MXFP8: E4M3, largest 448) in blocks of 32 along the last dim, one E8M0 power-of-two scale per block, no
second-level scale and no calibrated amax. The pure-torch reference, following NVIDIA Model Optimizer 0.47's MX fake
quant (``num_bits: (2, 1)`` / ``(4, 3)`` with ``block_sizes: {-1: 32, type: dynamic, scale_bits: (8, 0)}``;
``MXFP4_DEFAULT_CFG``, ``MXFP8_DEFAULT_CFG``): the E8M0 ``scale_bits`` select MX among the formats of a ``num_bits``.

For each block, with ``amax`` its largest magnitude and ``m`` the element format's largest value:

* the shared exponent ``e = clamp(ceil(log2(amax / m)), -127, 127)``, where ``amax / m`` is the IEEE fp32 quotient
  and ``ceil(log2(.))`` is read exactly from its bits (a quotient that is a power of two gives that power; a quotient
  of 0, from an amax that underflows, gives -127);
* the values ``|x| * 2**-e`` round to the element format, ties to even, saturating at ``m`` (MXFP4: E2M1 ``{0, .5, 1,
  1.5, 2, 3, 4, 6}``, Model Optimizer's fake quant; its MXFP4 *exporter* rounds ties toward zero instead, so an
  exporter must store these codes, not re-round. MXFP8: E4M3 with its subnormals, as ``float8_e4m3fn``);
* output ``q * 2**e`` with the sign of ``x``, in ``x``'s dtype (bf16, fp16 or fp32 in, the same dtype out).

Model Optimizer's rule is not the OCP MX spec's: OCP takes ``e = floor(log2(amax)) - emax`` (``emax`` the element
format's largest exponent: 2 for E2M1, 8 for E4M3) and clips the block's largest values to ``m``, while ``ceil(log2(
amax / m))`` never clips (``amax * 2**-e <= m``). The two differ exactly where the block maximum's significand exceeds
that of ``m`` (1.5 for E2M1, 1.75 for E4M3: about 41% and 20% of blocks for data of spread magnitudes); there Model
Optimizer's exponent is larger by one. Ours is Model Optimizer's.

Edge rules:

* all-zero block (and a block whose elements are all NaN): ``e = 0``, every element 0 (NaN stays NaN);
* Inf: the block maximum counts it as the largest finite fp32 (Model Optimizer's reduction clamps ``|x|`` to
  ``FLT_MAX``), so ``e`` is that of ``3.4e38 / m`` (126 for E2M1, 120 for E4M3): the Inf saturates to ``m`` and
  ``m * 2**e`` overflows back to Inf (with its sign), and the block's finite elements round at that scale (to 0
  unless they are huge themselves);
* NaN: the block maximum ignores it (as Model Optimizer's ``fmaxf`` reduction does) and it stays NaN in its own
  element. MXFP8 agrees with Model Optimizer there; its MXFP4 kernel returns a saturated value of unset sign for NaN
  (undefined there, NaN here). ``-0.0`` keeps its sign (Model Optimizer leaves the sign of a zero unset);
* saturation: none happens for finite data (``amax * 2**-e <= m``); only Inf saturates;
* a last dim that is not a multiple of 32 is zero-padded to one (as Model Optimizer pads): the last block of each row
  is simply shorter, its maximum unchanged;
* Model Optimizer builds its MX kernel with ``--use_fast_math``: the quotient ``amax / m`` is then not correctly
  rounded and fp32 subnormals flush to zero. Both matter only at edges (a quotient within an ulp or two of a power of
  two, such as a block maximum of exactly ``3 * 2**k``; data below 2**-126); the GPU comparison against the installed
  package runs away from them. This reference uses IEEE arithmetic throughout.

Encoding (the export codec, ``_MXCodec``): :func:`encode_mx` gives the codes and the
E8M0 scales (uint8 ``127 + e``) of exactly what the fake quant rounded to (MXFP4: two E2M1 codes per byte as NVFP4
packs them; MXFP8: ``float8_e4m3fn``), as compressed-tensors' ``mxfp4-pack-quantized`` / ``mxfp8-quantized`` store
and decode them.

Calibration: MX quantizers take every scale from the data, so the forward never reads an amax; calibration records
each quantizer's absolute max all the same (as for dynamic int blocks), for reports and checkpoints only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .format import (
    ExportCodec,
    Format,
    KernelRoutine,
    KernelSpec,
    Quantized,
    ScaleLayout,
    UnsupportedSetting,
    nan_ignoring_block_max,
    true_div,
)
from .fp8 import E4M3, E4M3_MAX
from .nvfp4 import E2M1_MAX, e2m1_codes, pack_fp4, round_to_e2m1

__all__ = ["MX_BLOCK_SIZE", "E8M0_MIN", "E8M0_MAX", "E8M0_BITS", "FP32_MAX", "MXFormat", "MXFP4", "MXFP8",
           "MX_FORMATS", "e8m0_exponent", "encode_mx"]

MX_BLOCK_SIZE = 32
E8M0_MIN, E8M0_MAX = -127, 127  # the exponents an E8M0 scale holds (bias 127; 0xFF is NaN)
E8M0_BITS = (8, 0)  # Model Optimizer's scale_bits of E8M0 block scales
FP32_MAX = torch.finfo(torch.float32).max


def e8m0_exponent(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """``clamp(ceil(log2(amax / element_max)), -127, 127)`` per entry as int32, exactly from the quotient's bits;
    0 where ``amax`` is 0, Inf or NaN (Model Optimizer's invalid-amax rule).

    Args:
        amax: fp32 block maxima (>= 0 or NaN).
        element_max: the element format's largest value (6 for E2M1, 448 for E4M3).
    """
    amax = amax.float()
    ratio = true_div(amax, element_max)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    # log2(ratio) = exponent - 1 + log2(2 * mantissa): an integer when mantissa is exactly 0.5, else rounded up.
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    e = torch.where(ratio == 0, E8M0_MIN, ceil_log2).clamp(E8M0_MIN, E8M0_MAX)
    invalid = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(invalid, 0, e).to(torch.int32)


@dataclass(frozen=True, eq=False)
class MXFormat(Format):
    """Elements of a small float format with one E8M0 power-of-two scale per block of 32 of the data's own maximum.

    Attributes:
        round_elements: fp32 magnitudes times the block scale -> the element grid (saturating at ``element_max``,
            ties to even, NaN kept).
    """

    round_elements: Callable[[torch.Tensor], torch.Tensor] | None = None

    def needs_amax(self, block_size: int | None) -> bool:
        """Never: every scale comes from its block."""
        return False

    def check_config(self, block_sizes: dict | None, axis) -> None:
        """Blocks of exactly 32 along the last dim, their E8M0 scales from the data, and no axis."""
        got = None if block_sizes is None else block_sizes.get(-1)
        if got != self.block_length:
            raise ValueError(f"{self.label} (num_bits {self.num_bits} with scale_bits {E8M0_BITS}) quantizes blocks "
                             f"of {self.block_length} (the OCP MX block), got block_sizes[-1]={got!r}; use "
                             f"block_sizes {{-1: {self.block_length}, type: dynamic, scale_bits: {E8M0_BITS}}}")
        if block_sizes.get("type", "dynamic") != "dynamic":
            raise UnsupportedSetting("block_sizes.type", block_sizes["type"], f"{self.label} block scales always come "
                                     "from the data (dynamic), as Model Optimizer's MX formats")
        if axis is not None:
            raise ValueError(f"{self.label} takes every scale from its block of {self.block_length}: axis must be "
                             f"null, got {axis}")

    def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
        b = self.block_length
        k = xf.shape[-1]
        pad = -k % b
        xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
        # Inf counts as the largest finite fp32 in the block maximum (Model Optimizer's clamp before its reduction).
        block_max = torch.clamp(nan_ignoring_block_max(xp, b), max=FP32_MAX)  # [..., K / 32, 1]
        e = e8m0_exponent(block_max, self.element_max)
        # The divisor 2**-e, as the int blocks' scale: a power of two, so x * scale and q / scale are exact (up to
        # fp32 subnormals, see the module docstring).
        scale = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=xf.device), -e)
        q = self.round_elements(xp.unflatten(-1, (-1, b)) * scale)
        return Quantized(self.name, q, scale, block_size=b, length=k)


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 (``float8_e4m3fn``, ties to even, subnormals) saturating at +-448, back to fp32; NaN kept."""
    return torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(E4M3.element_dtype).float()


class _MXCodec(ExportCodec):
    """MX weights (and MX inputs of the same format, their scales from the data at run time, or none): codes and
    E8M0 scales from :func:`encode_mx`. compressed-tensors ``mxfp4-pack-quantized`` / ``mxfp8-quantized``; Model
    Optimizer ``MXFP8`` (weights and inputs, what vLLM's ``ModelOptMxFp8`` methods read); MXFP4 has no Model
    Optimizer name an engine reads."""

    group_size = MX_BLOCK_SIZE

    def __init__(self, name: str, ct_format: str, num_bits: int, modelopt: str | None):
        self.scheme = self.label = name
        self.expressible = f"{name} weights with {name} inputs or none"
        self.weight_text = name
        self.ct_format = ct_format
        self._num_bits, self._modelopt = num_bits, modelopt

    def accepts_weight(self, axis, block_size) -> bool:
        return axis is None

    def input_problem(self, weight, x) -> str | None:
        if x.fmt == weight.fmt:
            return None
        return f"{self.label} weights need {self.label} inputs (or none), got input {x}"

    def schemes(self) -> list[dict]:
        return [{**s, "weight_block": MX_BLOCK_SIZE, "dynamic_input": s["input_quantized"]} for s in super().schemes()]

    def modelopt_algo(self, scheme) -> str | None:
        return self._modelopt if scheme.input_quantized else None

    def ct_args(self, scheme, inputs: bool) -> dict:
        return {"num_bits": self._num_bits, "type": "float", "symmetric": True, "group_size": MX_BLOCK_SIZE,
                "strategy": "group", "dynamic": inputs, "scale_dtype": "torch.uint8"}

    def reads_amax(self, scheme, inputs: bool) -> bool:
        return False  # every scale comes from its block

    def describe(self, scheme, file_format) -> tuple[str, str, list[str]] | None:
        four = self._num_bits == 4
        codes = ("`weight_packed` uint8 `[out, in/2]` (two E2M1 codes per byte, the even column in the low nibble)"
                 if four else "`weight` float8_e4m3fn")
        element = "E2M1" if four else "E4M3"
        return (f"{self.label}: {element}, E8M0 scale per block of 32 inputs",
                f"{self.label}: E8M0 scale per block of 32 computed at run time" if scheme.input_quantized else None,
                [codes, "`weight_scale` uint8 `[out, in/32]` (E8M0: 127 + the block's exponent)"])

    def encode(self, module, weight, weight_amax, input_amax, scheme, file_format) -> dict[str, torch.Tensor]:
        fmt = next(f for f in MX_FORMATS if f.name == scheme.weight_fmt)
        codes, e8m0 = encode_mx(weight, fmt, f"{module}.weight")
        packed = fmt.element_dtype is None and file_format == "compressed-tensors"
        return {f"{module}.weight_packed" if packed else f"{module}.weight": codes,
                f"{module}.weight_scale": e8m0}


_MX = {"scale_layouts": frozenset({ScaleLayout.BLOCKS_1D}), "block": (MX_BLOCK_SIZE,), "block_scale": "e8m0",
       "pads": True, "scale_bits": E8M0_BITS}
MXFP4 = MXFormat("mxfp4", (2, 1), E2M1_MAX, E2M1_MAX, "MXFP4",
                 kernel=KernelSpec(KernelRoutine.POWER_OF_TWO_BLOCKS, E2M1_MAX, mant=1, emin=0, emax=2),
                 aliases=("mxfp4",), round_elements=round_to_e2m1,
                 export=_MXCodec("MXFP4", "mxfp4-pack-quantized", 4, None), **_MX)
MXFP8 = MXFormat("mxfp8", (4, 3), E4M3_MAX, E4M3_MAX, "MXFP8",
                 kernel=KernelSpec(KernelRoutine.POWER_OF_TWO_BLOCKS, E4M3_MAX, mant=3, emin=-6, emax=8),
                 element_dtype=E4M3.element_dtype, aliases=("mxfp8",), round_elements=_round_e4m3,
                 export=_MXCodec("MXFP8", "mxfp8-quantized", 8, "MXFP8"), **_MX)
MX_FORMATS = (MXFP4, MXFP8)


def encode_mx(w: torch.Tensor, fmt: MXFormat, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of the 2-D ``w`` in MX format ``fmt`` and its E8M0 block scales, exactly what :meth:`fake_quant`
    rounded to: MXFP4 ``[R, K // 2]`` uint8 (two E2M1 codes per byte, column ``2j`` in the low nibble of byte ``j``),
    MXFP8 ``[R, K]`` ``float8_e4m3fn``; scales ``[R, K // 32]`` uint8 ``127 + e`` (the value is ``codes * 2**e``).

    Raises:
        ValueError: ``w`` is not 2-D, holds NaN, or its last dim is not a multiple of 32 (``name`` says which tensor).
    """
    b = fmt.block_length
    if w.dim() != 2 or w.shape[-1] % b:
        raise ValueError(f"{name}: {fmt.label} encodes 2-D weights whose last dim is a multiple of {b}, got shape "
                         f"{tuple(w.shape)}")
    if bool(torch.isnan(w).any()):
        raise ValueError(f"{name}: the weight holds NaN; a NaN weight cannot be encoded (was training diverging?)")
    qx = fmt.quantize(w)
    # scale = 2**-e exactly (e in [-127, 127]): its exponent field gives e without rounding.
    e = -(torch.frexp(qx.scale.squeeze(-1))[1] - 1)
    e8m0 = (e + 127).to(torch.uint8)
    values = qx.values.flatten(-2)
    codes = pack_fp4(e2m1_codes(values)) if fmt.element_dtype is None else values.to(fmt.element_dtype)
    return codes, e8m0
