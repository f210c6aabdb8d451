"""FP8 E4M3 and E5M2, per tensor or per channel: the home of the FP8 formats.

``scale = bound / amax`` (bound 448 / 57344); ``q = fp8(clamp(x * scale, -bound, bound))`` rounded to nearest even;
output ``q / scale`` (a true division: one rounding, the same on CPU and GPU). An invalid amax (<= 2**-24, NaN, Inf)
gives scale 1. No block mode.

Export (E4M3 only): codes in ``float8_e4m3fn`` and the multiplicative ``weight_scale = 1 / s`` (compressed-tensors
``float-quantized``, Model Optimizer ``FP8``); per output channel (axis 0) to compressed-tensors only.
"""

from __future__ import annotations

import torch

from .format import (
    ExportCodec,
    Format,
    KernelRoutine,
    KernelSpec,
    Quantized,
    ScaleLayout,
    check_finite_weight,
    reciprocal,
    safe_amax,
    true_div,
)

__all__ = ["E4M3_MAX", "E5M2_MAX", "FP8Format", "E4M3", "E5M2", "encode_fp8", "fp8_scale"]

E4M3_MAX = 448.0
E5M2_MAX = 57344.0


class FP8Format(Format):
    """A scaled FP8 format: one divisor ``bound / amax`` per tensor, expert or channel."""

    def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
        scale = true_div(self.bound, safe_amax(amax, self.bound))
        q = torch.clamp(xf * scale, -self.bound, self.bound).to(self.element_dtype).float()
        return Quantized(self.name, q, scale)


class _FP8Codec(ExportCodec):
    scheme = "FP8"
    label = "FP8"
    expressible = "FP8 E4M3 weights per tensor or per output channel (axis 0) with E4M3 per-tensor inputs or none"
    weight_text = "FP8 E4M3 (per tensor or axis 0)"
    per_channel = True
    ct_format = "float-quantized"

    def accepts_weight(self, axis, block_size) -> bool:
        return block_size is None and axis in (None, 0)

    def input_problem(self, weight, x) -> str | None:
        if x.fmt != weight.fmt or x.axis is not None or x.block_size is not None:
            return f"FP8 weights need E4M3 per-tensor inputs (or none), got input {x}"
        return None

    def modelopt_algo(self, per_channel: bool, input_quantized: bool) -> str | None:
        # Model Optimizer's per-channel FP8 quantizes inputs per token at run time: not what a static amax trained.
        return "FP8" if input_quantized and not per_channel else None

    def ct_args(self, per_channel: bool, inputs: bool) -> dict:
        strategy = "channel" if per_channel and not inputs else "tensor"
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}

    def encode(self, module, weight, weight_amax, input_amax, per_channel, file_format) -> dict[str, torch.Tensor]:
        amax = weight_amax.float().reshape(-1, 1) if per_channel else weight_amax.float().reshape(())
        codes, s = encode_fp8(weight, amax, f"{module}.weight")
        ws = reciprocal(s)
        out = {f"{module}.weight": codes,
               f"{module}.weight_scale": ws.contiguous() if per_channel else self.scalar(ws, file_format)}
        if input_amax is not None:
            out[f"{module}.input_scale"] = self.scalar(reciprocal(fp8_scale(input_amax)), file_format)
        return out


_BOTH_SCALINGS = frozenset({ScaleLayout.PER_TENSOR, ScaleLayout.PER_CHANNEL})
E4M3 = FP8Format("e4m3", (4, 3), E4M3_MAX, E4M3_MAX, "FP8 E4M3", _BOTH_SCALINGS,
                 KernelSpec(KernelRoutine.SCALED_FLOAT, E4M3_MAX, mant=3, emin=-6, emax=8),
                 element_dtype=torch.float8_e4m3fn, aliases=("e4m3", "fp8"), export=_FP8Codec())
E5M2 = FP8Format("e5m2", (5, 2), E5M2_MAX, E5M2_MAX, "FP8 E5M2", _BOTH_SCALINGS,
                 KernelSpec(KernelRoutine.SCALED_FLOAT, E5M2_MAX, mant=2, emin=-14, emax=15),
                 element_dtype=torch.float8_e5m2, aliases=("e5m2",))


def encode_fp8(w: torch.Tensor, amax: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes of ``w`` and the training scale ``s = 448 / amax`` (a divisor; per tensor ``[]`` or per
    output channel ``[C, 1]``, as ``amax``).

    Raises:
        ValueError: ``w`` holds NaN (``name`` says which tensor), or ``amax`` does not fit ``w``.
    """
    check_finite_weight(w, name)
    qx = E4M3.quantize(w, amax)
    return qx.values.to(E4M3.element_dtype), qx.scale


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The training's FP8 E4M3 divisor ``s = 448 / amax`` (invalid amax -> 1, the numeric contract's rule)."""
    return E4M3.quantize(torch.zeros(()), amax.float().reshape(())).scale
