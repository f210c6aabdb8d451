"""Codes and scales of the exported weights: FP8 E4M3 and NVFP4, encoded from the training-time quantization.

Encoding goes through :func:`modelopt_moe.numerics.quantize`, the same function ``fake_quant`` is built on, so the
stored codes and block scales are exactly the ones training rounded to. Decoding comes in two kinds:

* the *training convention* (:func:`decode_fp8`, :func:`decode_nvfp4`): codes times the scales as training holds
  them (FP8: divided by ``s = 448 / amax``; NVFP4: times ``sb * sg`` with ``sg = amax / 2688``). Equal to
  ``fake_quant`` bit for bit, every element, every dtype.
* the *file formats' documented formulas* (:func:`decode_fp8_file`, :func:`decode_nvfp4_modelopt`,
  :func:`decode_nvfp4_ct`), what a reader computes from the stored tensors. Model Optimizer's NVFP4 stores
  ``weight_scale_2 = sg`` itself, so its formula is bit-exact too. FP8 (both formats) stores the multiplicative
  ``weight_scale = 1 / s`` and compressed-tensors' NVFP4 the reciprocal ``weight_global_scale = 1 / sg``: no fp32
  number is the exact reciprocal of ``s`` (unless ``s`` is a power of two), so ``q * weight_scale`` can differ
  from training's ``q / s`` by one fp32 rounding (measured on 200,000 random amaxes: 17.6% give every FP8 code
  exactly in fp32, 99.997% in bf16; never more than 1 fp32 ulp; compressed-tensors' NVFP4 formula rounds twice,
  at most 2 ulps). We store the correctly rounded reciprocal, the closest any file can be. See docs/export.md.

NVFP4 packing (both formats, and what vLLM, SGLang, TensorRT-LLM and compressed-tensors unpack): two E2M1 codes per
byte along the input (last) dim, the even column in the low nibble; a code is ``sign << 3 | index`` with index
0..7 for ``0, 0.5, 1, 1.5, 2, 3, 4, 6``.
"""

from __future__ import annotations

import torch

from ..numerics import E4M3_MAX, NVFP4_BLOCK_SIZE, quantize

__all__ = [
    "E2M1_VALUES",
    "e2m1_codes",
    "e2m1_values",
    "pack_fp4",
    "unpack_fp4",
    "encode_fp8",
    "encode_nvfp4",
    "fp8_scale",
    "nvfp4_global_scale",
    "decode_fp8",
    "decode_nvfp4",
    "reciprocal",
    "decode_fp8_file",
    "decode_nvfp4_modelopt",
    "decode_nvfp4_ct",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# |value| * 2 -> code index (0, 1, 2, 3, 4, 6, 8, 12 -> 0..7); other entries are never looked up.
_DOUBLED_TO_INDEX = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, one per element) of fp32 values that lie on the E2M1 grid; ``-0.0`` keeps its sign.

    Raises:
        ValueError: a value is NaN or not on the grid.
    """
    doubled = values.abs() * 2
    on_grid = torch.isin(doubled, torch.tensor([2.0 * v for v in E2M1_VALUES], device=values.device))
    if not bool(on_grid.all()):
        bad = values[~on_grid].flatten()[:4].tolist()
        raise ValueError(f"e2m1_codes: values {bad} are not E2M1 values {E2M1_VALUES} (NaN weights cannot be encoded)")
    index = _DOUBLED_TO_INDEX.to(values.device)[doubled.to(torch.int64)]
    return index | (torch.signbit(values).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes (the sign bit gives ``-0.0`` for code 8)."""
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 7).to(torch.int64)]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` 4-bit codes -> ``[..., K // 2]`` bytes, column ``2j`` in the low nibble of byte ``j``."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dim of shape {tuple(codes.shape)} must be even")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., K // 2]`` uint8 -> ``[..., K]`` 4-bit codes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8 packed codes, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _check_finite(w: torch.Tensor, name: str) -> None:
    if bool(torch.isnan(w).any()):
        raise ValueError(f"{name}: the weight holds NaN; a NaN weight cannot be exported (was training diverging?)")


def encode_fp8(w: torch.Tensor, amax: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes of ``w`` and the training scale ``s = 448 / amax`` (a divisor; per tensor ``[]`` or per
    output channel ``[C, 1]``, as ``amax``).

    Raises:
        ValueError: ``w`` holds NaN (``name`` says which tensor), or ``amax`` does not fit ``w``.
    """
    _check_finite(w, name)
    qx = quantize(w, "e4m3", amax)
    return qx.values.to(torch.float8_e4m3fn), qx.scale


def encode_nvfp4(w: torch.Tensor, amax: torch.Tensor,
                 name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 codes of the 2-D ``w`` packed two per byte ``[R, K // 2]``, its E4M3 block scales ``[R, K // 16]`` and
    the training's second-level scale ``sg = amax / 2688`` (fp32 scalar).

    Raises:
        ValueError: ``w`` is not 2-D, holds NaN, or its last dim is not a multiple of 16.
    """
    if w.dim() != 2:
        raise ValueError(f"{name}: NVFP4 export takes a 2-D weight, got shape {tuple(w.shape)}")
    _check_finite(w, name)
    qx = quantize(w, "nvfp4", amax)
    codes = e2m1_codes(qx.values.flatten(-2))
    block_scale = qx.block_scale.squeeze(-1)
    if bool((block_scale > E4M3_MAX).any()):  # cannot happen (quantize clamps); a guard for the cast below
        raise ValueError(f"{name}: an NVFP4 block scale exceeds E4M3's range")
    return pack_fp4(codes), block_scale.to(torch.float8_e4m3fn), qx.scale.reshape(())


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The training's FP8 E4M3 divisor ``s = 448 / amax`` (invalid amax -> 1, the numeric contract's rule)."""
    return quantize(torch.zeros(()), "e4m3", amax.float().reshape(())).scale


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The training's NVFP4 second-level scale ``sg = amax / 2688`` (invalid amax -> 1)."""
    return quantize(torch.zeros(NVFP4_BLOCK_SIZE), "nvfp4", amax.float().reshape(())).scale.reshape(())


def decode_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Training convention: ``codes / s`` in fp32, cast to ``dtype``; equals ``fake_quant`` bit for bit."""
    return torch.div(codes.float(), scale.float()).to(dtype)


def decode_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """Training convention: ``value * (sb * sg)`` per block in fp32, cast to ``dtype``; equals ``fake_quant`` bit for
    bit (``global_scale`` is ``sg = amax / 2688``: Model Optimizer's ``weight_scale_2``)."""
    values = e2m1_values(unpack_fp4(packed)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    scale = block_scale.float().unsqueeze(-1) * global_scale.float().reshape(())
    return (values * scale).flatten(-2).to(dtype)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in fp32, correctly rounded (a true division): the multiplicative FP8 ``weight_scale`` from the
    training divisor ``s``, and compressed-tensors' ``weight_global_scale`` from ``sg``."""
    scale = scale.float()
    return torch.div(torch.ones_like(scale), scale)


def decode_fp8_file(codes: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 formats' formula (compressed-tensors ``float-quantized``, Model Optimizer ``FP8``):
    ``weight = codes * weight_scale`` in fp32."""
    return (codes.float() * weight_scale.float()).to(dtype)


def decode_nvfp4_modelopt(packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """Model Optimizer's NVFP4 formula ``value * weight_scale * weight_scale_2`` (``weight_scale_2 = sg``): the
    training convention itself, bit-exact."""
    return decode_nvfp4(packed, weight_scale, weight_scale_2, dtype)


def decode_nvfp4_ct(packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' NVFP4 formula ``value * (weight_scale / weight_global_scale)`` in fp32."""
    values = e2m1_values(unpack_fp4(packed)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    scale = torch.div(weight_scale.float(), weight_global_scale.float().reshape(())).unsqueeze(-1)
    return (values * scale).flatten(-2).to(dtype)
