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
    ExportCodec,
    Format,
    KernelRoutine,
    KernelSpec,
    Quantized,
    ScaleLayout,
    check_finite_weight,
    nan_ignoring_block_max,
    reciprocal,
    safe_amax,
    true_div,
)

__all__ = ["IntFormat", "INT_FORMATS", "int_range", "INT4_GROUPS", "encode_int4_groups", "pack_int4"]


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


INT4_GROUPS = (32, 64, 128)  # the group sizes compressed-tensors' W4A16 kernels (Marlin, Machete) in vLLM take


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes ``[R, K]`` (K a multiple of 8) -> compressed-tensors' ``pack-quantized`` int32 ``[R, K / 8]``:
    element ``8j + i`` of a row in bits ``4i .. 4i+3`` of word ``j``, offset by 8 (``code + 8`` in 0..15)."""
    nibbles = (codes.to(torch.int32) + 8).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    return (nibbles << shifts).sum(-1, dtype=torch.int64).to(torch.int64).bitwise_and(0xFFFFFFFF).to(
        torch.uint32).view(torch.int32)


def encode_int4_groups(w: torch.Tensor, group: int, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 codes of the 2-D ``w`` in dynamic groups of ``group`` along the last dim, exactly what the fake quant
    rounded to (int8 ``[R, K]``, in [-8, 7]), and each group's training divisor ``s = 7 / groupmax`` ``[R, K /
    group]`` (files store the multiplicative ``1 / s``, as for FP8).

    Raises:
        ValueError: ``w`` is not 2-D, its last dim is not a multiple of ``group``, or it holds NaN (``name`` says
            which tensor).
    """
    if w.dim() != 2 or w.shape[-1] % group:
        raise ValueError(f"{name}: INT4 group export takes 2-D weights whose input dim is a multiple of the group "
                         f"({group}), got shape {tuple(w.shape)}")
    check_finite_weight(w, name)
    qx = INT_FORMATS[1].quantize(w, None, group)
    return qx.values.flatten(-2).to(torch.int8), qx.scale.squeeze(-1)


class _Int4Codec(ExportCodec):
    """INT4 weight-only in dynamic groups (W4A16): compressed-tensors ``pack-quantized``. No Model Optimizer name an
    engine reads (its INT4 export, ``W4A16_AWQ``, carries AWQ's pre-quant scales and is read by TensorRT-LLM's own
    checkpoint converter only)."""

    scheme = "W4A16"
    label = "INT4"
    expressible = f"INT4 weights in dynamic groups of {' / '.join(map(str, INT4_GROUPS))} without input quantizer"
    weight_text = f"INT4 in dynamic groups of {' / '.join(map(str, INT4_GROUPS))}"
    ct_format = "pack-quantized"

    def accepts_weight(self, axis, block_size) -> bool:
        return axis is None and block_size in INT4_GROUPS

    def input_problem(self, weight, x) -> str | None:
        return f"INT4 weights export weight-only (W4A16), got input {x}"

    def schemes(self) -> list[dict]:
        return [{"name": f"W4A16_G{g}", "per_channel": False, "input_quantized": False, "weight_block": g}
                for g in INT4_GROUPS]

    def scheme_name(self, weight, x) -> str:
        return f"W4A16_G{weight.block_size}"

    def modelopt_algo(self, scheme) -> str | None:
        return None

    def ct_args(self, scheme, inputs: bool) -> dict:
        return {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": scheme.weight_block, "dynamic": False}

    def reads_amax(self, scheme, inputs: bool) -> bool:
        return False  # every group's scale comes from the weight itself

    def describe(self, scheme, file_format) -> tuple[str, str, list[str]] | None:
        g = scheme.weight_block
        return (f"INT4, fp32 scale per group of {g} inputs", None,
                ["`weight_packed` int32 `[out, in/8]` (eight codes + 8 per word, the first in the low bits)",
                 f"`weight_scale` fp32 `[out, in/{g}]` = group amax / 7", "`weight_shape` int64 `[2]`"])

    def encode(self, module, weight, weight_amax, input_amax, scheme, file_format) -> dict[str, torch.Tensor]:
        codes, s = encode_int4_groups(weight, scheme.weight_block, f"{module}.weight")
        return {f"{module}.weight_packed": pack_int4(codes), f"{module}.weight_scale": reciprocal(s).contiguous(),
                f"{module}.weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}


def _int_format(bits: int) -> IntFormat:
    bound = float(2 ** (bits - 1) - 1)
    name = f"int{bits}"
    return IntFormat(name, bits, bound, bound, f"INT{bits}",
                     frozenset({ScaleLayout.PER_TENSOR, ScaleLayout.PER_CHANNEL, ScaleLayout.BLOCKS_1D}),
                     KernelSpec(KernelRoutine.SCALED_INT, bound), aliases=(name,), integer=True,
                     export=_Int4Codec() if bits == 4 else None)


# INT8 and INT4 first, then the other widths Model Optimizer takes (its num_bits may be any int).
INT_FORMATS = tuple(_int_format(b) for b in (8, 4, 2, 3, 5, 6, 7))
