"""The published MXFP4 layout of fused 3-D experts (gpt-oss): Hugging Face ``quant_method: mxfp4``, what
transformers' MXFP4 integration (``Mxfp4Config``) and vLLM's gpt-oss loader read.

A fused expert weight that Hugging Face holds in memory as ``[E, in, out]`` (gpt-oss's ``gate_up_proj``
``[E, H, 2I]``, gate and up interleaved along ``out``; ``down_proj`` ``[E, I, H]``) is stored as two uint8 tensors of
its transpose, each expert's ``[out, in]`` matrix quantized in blocks of 32 along ``in``:

* ``<name>_blocks`` ``[E, out, in / 32, 16]``: two E2M1 codes per byte, the even element in the low nibble (the
  packing of :func:`~modelopt_moe.numerics.nvfp4.pack_fp4`; a code is ``sign << 3 | index``, index 0..7 for
  ``0, .5, 1, 1.5, 2, 3, 4, 6``);
* ``<name>_scales`` ``[E, out, in / 32]``: E8M0, the block's value is ``code * 2**(scale - 127)``.

Biases and every other tensor stay unquantized (bf16 in the published checkpoints); ``config.json`` carries
``quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}``.

Encoding goes through :func:`~modelopt_moe.numerics.mx.encode_mx`, so the codes and scales are exactly what
training's MXFP4 fake quant rounded to. Decoding is exact in fp32 (and in bf16: every value is a bf16 number).
"""

from __future__ import annotations

import torch

from ..numerics.mx import MX_BLOCK_SIZE, MXFP4, encode_mx
from ..numerics.nvfp4 import e2m1_values, unpack_fp4
from .errors import ExportError
from .mapping import STACKED

__all__ = ["FILE_FORMAT", "QUANT_METHOD", "SUFFIXES", "packed_kinds", "check_family", "packed_shapes",
           "encode_experts", "decode_experts", "quantization_config", "check_expert_quant"]

FILE_FORMAT = "hf-mxfp4"  # export_hf's format name for this layout
QUANT_METHOD = "mxfp4"  # config.json's quantization_config.quant_method
SUFFIXES = ("_blocks", "_scales")
_BYTES = MX_BLOCK_SIZE // 2  # bytes per block of 32 E2M1 codes
_E8M0_NAN = 255


def packed_kinds(family) -> frozenset[str]:
    """The kinds (last part of the canonical name) of a family's fused expert weights, the tensors this layout
    packs; empty for a family that stores experts one by one."""
    stacked = [p for p in family.megatron.layer if p.rule in STACKED and p.holder is not None]
    return frozenset(p.canonical[0].rsplit(".", 1)[-1] for p in stacked)  # one canonical name each


def check_family(family) -> frozenset[str]:
    """:func:`packed_kinds` of a family this layout can store (one with fused 3-D experts).

    Raises:
        ExportError: a family that stores its experts one by one (names it and the format to use).
    """
    kinds = packed_kinds(family)
    if not kinds:
        raise ExportError(f"format={FILE_FORMAT!r} stores fused 3-D experts (gpt-oss's layout); "
                          f"{family.architecture} stores its experts one by one: use format='compressed-tensors'")
    return kinds


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``_blocks`` and ``_scales`` shapes of a fused weight of Hugging Face shape ``[E, in, out]``."""
    e, k, n = shape
    return (e, n, k // MX_BLOCK_SIZE, _BYTES), (e, n, k // MX_BLOCK_SIZE)


def encode_experts(weights: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's ``[out, in]`` weight (``weights`` ``[E, out, in]``, rows in the file's order) -> ``(blocks,
    scales)``: exactly the codes and scales MXFP4 fake quant rounds each expert's weight to.

    Raises:
        ExportError: ``in`` is not a multiple of 32, or a weight holds NaN (names the tensor).
    """
    e, n, k = weights.shape
    try:
        pairs = [encode_mx(w, MXFP4, f"{name}[{i}]") for i, w in enumerate(weights)]
    except ValueError as err:
        raise ExportError(str(err)) from None
    blocks = torch.stack([c for c, _ in pairs]).reshape(e, n, k // MX_BLOCK_SIZE, _BYTES)
    return blocks, torch.stack([s for _, s in pairs])


def decode_experts(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """``(blocks, scales)`` -> fp32 ``[E, out, in]``, exactly (``code * 2**(scale - 127)``).

    Raises:
        ExportError: the shapes do not pair, or a scale is 255 (E8M0's NaN), naming the tensor.
    """
    if blocks.dim() != 4 or blocks.shape[-1] != _BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ExportError(f"{name}: _blocks of shape {list(blocks.shape)} and _scales of shape {list(scales.shape)} "
                          f"do not pair (expected [E, out, in/32, {_BYTES}] and [E, out, in/32])")
    if bool((scales == _E8M0_NAN).any()):
        raise ExportError(f"{name}_scales: holds {_E8M0_NAN}, E8M0's NaN (expected 0..254)")
    values = e2m1_values(unpack_fp4(blocks))  # [E, out, in/32, 32]
    exps = scales.to(torch.int32).sub(127).unsqueeze(-1)
    return torch.ldexp(values, exps).flatten(-2)


def quantization_config(not_converted: list[str]) -> dict:
    """``config.json``'s ``quantization_config``, as the published checkpoints write it (``not_converted``: the
    unquantized modules' name patterns, ``model.layers.*.self_attn.q_proj``)."""
    return {"quant_method": QUANT_METHOD, "modules_to_not_convert": not_converted}


def check_expert_quant(where: str, quant) -> None:
    """The experts' quantizers this layout stores: MXFP4 weights (blocks of 32), no input or output quantizer.

    Raises:
        ExportError: naming the module and what it quantizes.
    """
    w = quant.weight
    if w is None or w.fmt != MXFP4.name:  # its blocks are always 32 (the format refuses other configs)
        raise ExportError(f"{where}: format={FILE_FORMAT!r} stores MXFP4 experts (weights in blocks of "
                          f"{MX_BLOCK_SIZE}), got weight quantizer {w or 'disabled'} (expected MXFP4 weights, e.g. "
                          "configs/mxfp4_experts_only.yaml with the experts' input quantizers disabled)")
    others = [f"{k} {q}" for k, q in (("input", quant.input), ("output", quant.output)) if q is not None]
    if others:
        raise ExportError(f"{where}: format={FILE_FORMAT!r} is weight-only (transformers and vLLM run these experts "
                          f"on bf16 activations), got {', '.join(others)}; disable them before exporting, e.g. "
                          "mtq.disable_quantizer(model, '*experts*input_quantizer')")
