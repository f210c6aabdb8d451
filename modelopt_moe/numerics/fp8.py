"""FP8 E4M3 and E5M2, per tensor, per channel or in blocks: the home of the FP8 formats.

``scale = bound / amax`` (bound 448 / 57344); ``q = fp8(clamp(x * scale, -bound, bound))`` rounded to nearest even;
output ``q / scale`` (a true division: one rounding, the same on CPU and GPU). An invalid amax (<= 2**-24, NaN, Inf)
gives scale 1.

Blocks (FP8 block-wise: DeepSeek-V3/R1, Kimi-K2 and Qwen3 FP8 checkpoints, Transformer Engine's
``Float8BlockScaling``): with ``block_size`` every block takes its amax from its own data, so no calibrated amax is
needed (:meth:`FP8Format.needs_amax`), and then the same rule as above per block, the same divisor convention as per
tensor (one convention for every FP8 scale; Model Optimizer's block path multiplies by a reciprocal instead:
docs/modelopt_compat.md). ``block_size`` is an int for blocks of the last dim (activations: ``128``, one scale per
token and group of 128 features, at any token count) or ``(rows, cols)`` for 2-D blocks of the last two dims
(weights: ``(128, 128)``, ``{-1: 128, -2: 128}`` in a config). Edge rules (:mod:`.blocks`):

* a block whose amax is invalid (all zero, <= 2**-24, or holding an Inf) gets scale 1, as an invalid amax does per
  tensor: zeros stay zero, an Inf saturates to the bound and its neighbours round at scale 1;
* the block max ignores NaN, and a NaN stays NaN in its own element only; ``-0.0`` keeps its sign;
* dims that are not multiples of the block are zero-padded (the last block of a row or column is smaller, as in
  DeepSeek's scale layout and Model Optimizer's padding); the output has the input's shape;
* bf16, fp16 or fp32 in, the same dtype out (the arithmetic is fp32).

Export (E4M3 only): codes in ``float8_e4m3fn`` and the multiplicative ``weight_scale = 1 / s`` (compressed-tensors
``float-quantized``): per tensor with a static per-tensor input scale (Model Optimizer ``FP8``) or weight-only; per
output channel (axis 0) with a static input scale (compressed-tensors only) or per-token dynamic inputs
(``FP8_DYNAMIC``, Model Optimizer ``FP8_PER_CHANNEL_PER_TOKEN``); in 128 x 128 blocks with 1 x 128 dynamic input
groups or weight-only (``FP8_BLOCK``, Model Optimizer ``FP8_PB_WO``): :func:`encode_fp8_blocks` gives the codes and
one divisor per block (compressed-tensors' block decoder reads the codes with ``1 / s`` within one fp32 ulp).
"""

from __future__ import annotations

import torch

from .blocks import block_dims, block_max, from_blocks, to_blocks
from .format import (
    FLOAT_DTYPES,
    ExportCodec,
    Format,
    KernelRoutine,
    KernelSpec,
    Quantized,
    ScaleLayout,
    UnsupportedSetting,
    check_finite_weight,
    reciprocal,
    safe_amax,
    true_div,
)

__all__ = ["E4M3_MAX", "E5M2_MAX", "FP8Format", "E4M3", "E5M2", "encode_fp8", "encode_fp8_blocks", "fp8_scale"]

E4M3_MAX = 448.0
E5M2_MAX = 57344.0


class FP8Format(Format):
    """A scaled FP8 format: one divisor ``bound / amax`` per tensor, expert, channel, or block of the data."""

    def needs_amax(self, block_size) -> bool:
        """An amax per tensor or channel; none with blocks, which take every scale from the data."""
        return block_size is None

    def block_size_problem(self, block_size) -> str | None:
        """Blocks of the last dim (an int) or of the last two dims (a pair), of any positive lengths."""
        if block_size is None or block_dims(block_size) is not None:
            return None
        return (f"{self.name} takes blocks of the last dim (a positive int) or of the last two dims (rows, cols), "
                f"got block_size={block_size!r}")

    def check_config(self, block_sizes: dict | None, axis) -> None:
        """Blocks of the last dim (static or dynamic, as int blocks) or 2-D blocks ``{-1: c, -2: r}``, whose scales
        always come from the data.

        Raises:
            UnsupportedSetting: 2-D blocks with ``type: static``.
        """
        if block_sizes is None or block_sizes.get(-2) is None:
            return
        if block_sizes.get("type", "dynamic") != "dynamic":
            raise UnsupportedSetting("block_sizes.type", block_sizes["type"], "2-D FP8 block scales always come from "
                                     "the current weights (the same numbers as a calibrated block amax at "
                                     "calibration); drop 'type' or write 'dynamic'")

    def _check_inputs(self, x, amax, block_size) -> None:
        dims = block_dims(block_size) if block_size is not None else None
        if dims is None or len(dims) == 1:
            return super()._check_inputs(x, amax, block_size)
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"fake_quant: input dtype {x.dtype} not supported; expected one of {FLOAT_DTYPES}")
        if x.dim() < 2:
            raise ValueError(f"fake_quant: 2-D blocks {tuple(block_size)} need a tensor of at least 2 dims, got "
                             f"shape {tuple(x.shape)}")

    def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
        if block_size is None:
            scale = true_div(self.bound, safe_amax(amax, self.bound))
            q = torch.clamp(xf * scale, -self.bound, self.bound).to(self.element_dtype).float()
            return Quantized(self.name, q, scale)
        dims = block_dims(block_size)
        blocks, length = to_blocks(xf, dims)
        scale = true_div(self.bound, safe_amax(block_max(blocks, dims), self.bound))
        q = torch.clamp(blocks * scale, -self.bound, self.bound).to(self.element_dtype).float()
        return Quantized(self.name, q, scale, block_size=block_size, length=length)

    def dequantize(self, qx: Quantized) -> torch.Tensor:
        """``values / scale`` in fp32, blocks back in the input's shape (padding dropped)."""
        if qx.block_size is None:
            return true_div(qx.values, qx.scale)
        return from_blocks(true_div(qx.values, qx.scale), block_dims(qx.block_size), qx.length)


FP8_WEIGHT_BLOCK = (128, 128)  # the weight block every engine's block-FP8 path reads (DeepSeek's layout)
FP8_INPUT_GROUP = 128  # ... with its activations per token in groups of 128 features, scales from the data


class _FP8Codec(ExportCodec):
    scheme = "FP8"
    label = "FP8"
    expressible = ("FP8 E4M3 weights per tensor or per output channel (axis 0) with E4M3 per-tensor inputs or none, "
                   "per output channel with per-token inputs (FP8_DYNAMIC), in 128x128 blocks with 1x128 "
                   "dynamic input groups or none (FP8_BLOCK)")
    weight_text = "FP8 E4M3 (per tensor, axis 0, or 128x128 blocks)"
    per_channel = True
    ct_format = "float-quantized"

    def accepts_weight(self, axis, block_size) -> bool:
        if block_size is not None:
            return tuple(block_size) == FP8_WEIGHT_BLOCK if isinstance(block_size, tuple | list) else False
        return axis in (None, 0)

    def input_problem(self, weight, x) -> str | None:
        if x.fmt != weight.fmt:
            return (f"FP8 weights need E4M3 per-tensor inputs (per token with per-channel weights, 1x128 groups "
                    f"with 128x128 blocks) or none, got input {x}")
        if weight.block_size is not None:
            if x.block_size != FP8_INPUT_GROUP or x.axis is not None:
                return (f"FP8 128x128 weight blocks need E4M3 inputs in dynamic groups of {FP8_INPUT_GROUP} (or none), "
                        f"got input {x}")
            return None
        if x.per_token or (x.dynamic and x.axis is None and x.block_size is None):
            # Per token, or (experts, which train no per-token amax) per tensor from each expert's tokens: served per
            # token (FP8_DYNAMIC), a scale of each token's own, never coarser than the trained one.
            return None if weight.axis is not None else (
                f"dynamic E4M3 inputs go with per-output-channel weights (FP8_DYNAMIC), got weight {weight}")
        if x.axis is not None or x.block_size is not None:
            return f"FP8 weights need E4M3 per-tensor or per-token inputs (or none), got input {x}"
        return None

    def schemes(self) -> list[dict]:
        return [*super().schemes(),
                {"name": "FP8_DYNAMIC", "per_channel": True, "input_quantized": True, "dynamic_input": True},
                {"name": "FP8_BLOCK", "per_channel": False, "input_quantized": True,
                 "weight_block": FP8_WEIGHT_BLOCK, "dynamic_input": True},
                {"name": "FP8_BLOCK_A16", "per_channel": False, "input_quantized": False,
                 "weight_block": FP8_WEIGHT_BLOCK}]

    def scheme_name(self, weight, x) -> str:
        if weight.block_size is not None:
            return "FP8_BLOCK" if x is not None else "FP8_BLOCK_A16"
        if x is not None and (x.per_token or x.dynamic):
            return "FP8_DYNAMIC"
        return super().scheme_name(weight, x)

    def modelopt_algo(self, scheme) -> str | None:
        if scheme.weight_block is not None:
            # Model Optimizer's block-wise weights; vLLM runs them with 1x128 dynamic input groups.
            return "FP8_PB_WO"
        if scheme.dynamic_input:
            return "FP8_PER_CHANNEL_PER_TOKEN"
        # Per-channel weights with a static per-tensor input scale: no Model Optimizer name.
        return "FP8" if scheme.input_quantized and not scheme.per_channel else None

    def ct_args(self, scheme, inputs: bool) -> dict:
        args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
        if scheme.weight_block is not None:
            return {**args, "strategy": "group", "group_size": FP8_INPUT_GROUP, "dynamic": True} if inputs else {
                **args, "strategy": "block", "block_structure": list(scheme.weight_block)}
        if inputs:
            return {**args, "strategy": "token", "dynamic": True} if scheme.dynamic_input else args
        return {**args, "strategy": "channel"} if scheme.per_channel else args

    def describe(self, scheme, file_format) -> tuple[str, str, list[str]] | None:
        if scheme.weight_block is not None:
            shape = "`[out/128, 1, in/128, 1]`" if file_format == "modelopt" else "`[out/128, in/128]`"
            return ("FP8 E4M3, fp32 scale per 128x128 block",
                    "FP8 E4M3, scale per token and 128 features computed at run time" if scheme.input_quantized
                    else None,
                    ["`weight` float8_e4m3fn", f"`weight_scale` fp32 {shape} = block amax / 448"])
        if scheme.dynamic_input:
            shape = "`[out]`" if file_format == "modelopt" else "`[out, 1]`"
            return ("FP8 E4M3, fp32 scale per output channel", "FP8 E4M3, scale per token computed at run time",
                    ["`weight` float8_e4m3fn", f"`weight_scale` fp32 {shape} = channel amax / 448"])
        return None

    def reads_amax(self, scheme, inputs: bool) -> bool:
        if not inputs and scheme.weight_block is not None:
            return False  # every block's scale comes from the weight itself
        return super().reads_amax(scheme, inputs)

    def encode(self, module, weight, weight_amax, input_amax, scheme, file_format) -> dict[str, torch.Tensor]:
        if scheme.weight_block is not None:
            codes, s = encode_fp8_blocks(weight, scheme.weight_block, f"{module}.weight")
            ws = reciprocal(s)
            # Model Optimizer writes its block scales [out_blocks, 1, in_blocks, 1] (what vLLM's FP8_PB_WO reads).
            ws = ws[:, None, :, None] if file_format == "modelopt" else ws
            return {f"{module}.weight": codes, f"{module}.weight_scale": ws.contiguous()}
        per_channel = scheme.per_channel
        amax = weight_amax.float().reshape(-1, 1) if per_channel else weight_amax.float().reshape(())
        codes, s = encode_fp8(weight, amax, f"{module}.weight")
        ws = reciprocal(s)
        if per_channel and scheme.dynamic_input and file_format == "modelopt":
            ws = ws.reshape(-1)  # FP8_PER_CHANNEL_PER_TOKEN: one scale per output channel, [out]
        out = {f"{module}.weight": codes,
               f"{module}.weight_scale": ws.contiguous() if per_channel else self.scalar(ws, file_format)}
        if input_amax is not None:
            out[f"{module}.input_scale"] = self.scalar(reciprocal(fp8_scale(input_amax)), file_format)
        return out


_BOTH_SCALINGS = frozenset({ScaleLayout.PER_TENSOR, ScaleLayout.PER_CHANNEL, ScaleLayout.BLOCKS_1D,
                            ScaleLayout.BLOCKS_2D})
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


def encode_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                      name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes of the 2-D ``w`` in 2-D blocks (the codes training rounded to) and each block's training
    divisor ``s = 448 / blockmax``, ``[ceil(R / rows), ceil(C / cols)]`` (DeepSeek's and compressed-tensors'
    ``FP8_BLOCK`` layout: a partial block has a scale of its own). Files store the multiplicative ``1 / s``
    (:func:`~.format.reciprocal`), as for per-tensor FP8.

    Raises:
        ValueError: ``w`` is not 2-D or holds NaN (``name`` says which tensor).
    """
    if w.dim() != 2:
        raise ValueError(f"{name}: FP8 block export takes a 2-D weight, got shape {tuple(w.shape)}")
    check_finite_weight(w, name)
    qx = E4M3.quantize(w, None, tuple(block))
    codes = from_blocks(qx.values, block_dims(tuple(block)), qx.length).to(E4M3.element_dtype)
    return codes, qx.scale[:, 0, :, 0]


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The training's FP8 E4M3 divisor ``s = 448 / amax`` (invalid amax -> 1, the numeric contract's rule)."""
    return E4M3.quantize(torch.zeros(()), amax.float().reshape(())).scale
