"""Codes and scales of the exported weights: FP8 E4M3 and NVFP4, encoded from the training-time quantization.

Encoding lives in each format's home (:mod:`modelopt_moe.numerics.fp8`, :mod:`modelopt_moe.numerics.nvfp4`, their
``ExportCodec``; re-exported here) and goes through the format's ``quantize``, the same function ``fake_quant`` is
built on, so the stored codes and block scales are exactly the ones training rounded to. Decoding comes in two kinds:

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

from ..numerics.format import reciprocal
from ..numerics.fp8 import encode_fp8, fp8_scale
from ..numerics.nvfp4 import (
    E2M1_VALUES,
    NVFP4_BLOCK_SIZE,
    e2m1_codes,
    e2m1_values,
    encode_nvfp4,
    nvfp4_global_scale,
    pack_fp4,
    unpack_fp4,
)

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
