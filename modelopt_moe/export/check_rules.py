"""The engines' loader contracts as data: what each checkpoint format stores per quantized linear, and what each
serving engine does with an MoE layer's per-expert scales. :mod:`.check` walks these tables; adding a format or an
engine is a few entries here.

A :class:`FormatRule` lists the tensors of one quantized linear (name suffix, safetensors dtype, shape in terms of
the linear's ``[R, C]`` weight) and how each stored scale maps to an *amax* (the range it covers), so that scales of
different conventions compare. An :class:`EngineRule` says, for one (engine, format, scheme), which scales the
engine fuses over gate and up (``equal``: the engine keeps one of them and the other projection is dequantized
with it; ``max``: it requantizes both onto the larger one) and how it collapses the per-expert input scales
(``layer``: one scale per layer, the max over experts; ``expert``: one per expert, the max over gate and up).

Read from the loaders (vLLM ``model_executor/layers/quantization/modelopt.py`` and
``compressed_tensors/compressed_tensors_moe*.py``, SGLang ``srt/layers/quantization/modelopt_quant.py``,
TensorRT-LLM ``_torch/modules/fused_moe/quantization.py``):

* NVFP4 experts: vLLM and SGLang keep the gate's weight global scale for the fused gate/up GEMM and only warn when
  the up projection's differs; TensorRT-LLM asserts they are equal. vLLM's CUTLASS path keeps one input scale per
  expert (max of gate and up), its FlashInfer paths and TensorRT-LLM one per layer.
* FP8 per-tensor experts: every engine takes one input scale per layer (the max over experts, with a warning) and
  requantizes gate and up onto the larger of their two weight scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TensorRule", "FormatRule", "EngineRule", "FORMAT_RULES", "ENGINE_RULES", "ENGINES", "rule_key"]

ENGINES = ("vllm", "sglang", "trtllm")
FP8_MAX, FP4_MAX = 448.0, 6.0


@dataclass(frozen=True)
class TensorRule:
    """One stored tensor of a quantized linear.

    Attributes:
        suffix: appended to the module name (``weight_scale``).
        dtype: the safetensors dtype name the loaders take (``F8_E4M3``, ``U8``, ``F32``).
        shape: ``w`` ``[R, C]``, ``packed`` ``[R, C/2]``, ``blocks16`` ``[R, C/16]``, ``scalar`` ``[]`` or ``[1]``,
            ``rows`` ``[R, 1]``.
        role: ``weight``, ``block_scale`` (E4M3 per block: finite, non-negative), ``weight_scale`` / ``input_scale``
            (per tensor or channel: finite, positive, normal, with a normal reciprocal).
        to_amax: the amax the stored value stands for (``v * 448``, ``2688 / v``, ...), to compare scales.
        inputs_only: stored only when the scheme quantizes inputs.
    """

    suffix: str
    dtype: str
    shape: str
    role: str
    to_amax: float = 0.0  # amax = to_amax * v (> 0) or -to_amax / v (< 0): the reciprocal conventions
    inputs_only: bool = False

    def amax(self, v: float) -> float:
        """The amax a stored per-tensor scale value ``v`` stands for."""
        return self.to_amax * v if self.to_amax > 0 else -self.to_amax / v


@dataclass(frozen=True)
class FormatRule:
    """A format's tensors for one scheme (``fp8_tensor``, ``fp8_channel``, ``nvfp4_blocks``)."""

    tensors: tuple[TensorRule, ...]

    def stored(self, inputs: bool) -> tuple[TensorRule, ...]:
        """The tensors a linear of this scheme holds (with or without quantized inputs)."""
        return tuple(t for t in self.tensors if inputs or not t.inputs_only)

    def role(self, role: str) -> TensorRule | None:
        """The tensor of ``role`` (None: this format has none)."""
        return next((t for t in self.tensors if t.role == role), None)


@dataclass(frozen=True)
class EngineRule:
    """What one engine does with an MoE layer's expert scales in one format and scheme.

    Attributes:
        gate_up: scale role -> ``equal`` (the engine keeps the gate's; a different up scale is an error) or ``max``
            (requantized onto the larger one: a warning with the ratio).
        input_collapse: ``layer`` (one input scale per layer: max over experts) or ``expert`` (one per expert).
        source: where the loader says so.
    """

    gate_up: dict[str, str] = field(default_factory=dict)
    input_collapse: str = "layer"
    source: str = ""


_FP8_W = TensorRule("weight", "F8_E4M3", "w", "weight")
_NVFP4_BLOCKS = TensorRule("weight_scale", "F8_E4M3", "blocks16", "block_scale")

FORMAT_RULES: dict[tuple[str, str], FormatRule] = {
    ("compressed-tensors", "fp8_tensor"): FormatRule((
        _FP8_W, TensorRule("weight_scale", "F32", "scalar", "weight_scale", FP8_MAX),
        TensorRule("input_scale", "F32", "scalar", "input_scale", FP8_MAX, inputs_only=True))),
    ("compressed-tensors", "fp8_channel"): FormatRule((
        _FP8_W, TensorRule("weight_scale", "F32", "rows", "weight_scale", FP8_MAX),
        TensorRule("input_scale", "F32", "scalar", "input_scale", FP8_MAX, inputs_only=True))),
    ("compressed-tensors", "nvfp4_blocks"): FormatRule((
        TensorRule("weight_packed", "U8", "packed", "weight"), _NVFP4_BLOCKS,
        TensorRule("weight_global_scale", "F32", "scalar", "weight_scale", -FP8_MAX * FP4_MAX),
        TensorRule("input_global_scale", "F32", "scalar", "input_scale", -FP8_MAX * FP4_MAX, inputs_only=True))),
    ("modelopt", "fp8_tensor"): FormatRule((
        _FP8_W, TensorRule("weight_scale", "F32", "scalar", "weight_scale", FP8_MAX),
        TensorRule("input_scale", "F32", "scalar", "input_scale", FP8_MAX, inputs_only=True))),
    ("modelopt", "nvfp4_blocks"): FormatRule((
        TensorRule("weight", "U8", "packed", "weight"), _NVFP4_BLOCKS,
        TensorRule("weight_scale_2", "F32", "scalar", "weight_scale", FP8_MAX * FP4_MAX),
        TensorRule("input_scale", "F32", "scalar", "input_scale", FP8_MAX * FP4_MAX, inputs_only=True))),
}

_FP8_MOE = EngineRule({"weight_scale": "max"}, "layer",
                      "fp8 MoE process_weights_after_loading: max over experts of w13/w2 input scales; w1/w3 "
                      "requantized with the max weight scale")
_NVFP4_VLLM = EngineRule({"weight_scale": "equal"}, "expert",
                         "ModelOptNvFp4FusedMoE / CompressedTensorsW4A4Nvfp4MoEMethod: w13 global scale [:, 0] "
                         "(warns 'w1_weight_scale_2 must match w3_weight_scale_2'); CUTLASS input scale max(dim=1)")
_NVFP4_SGLANG = EngineRule({"weight_scale": "equal"}, "layer",
                           "ModelOptNvFp4FusedMoEMethod: w13 global scale [:, 0]; one input scale per layer on its "
                           "FlashInfer backends")
_NVFP4_TRTLLM = EngineRule({"weight_scale": "equal"}, "layer",
                           "load_expert_fc31_alpha_nvfp4 asserts w1_weight_scale_2 == w3_weight_scale_2; "
                           "fc31/fc2 input scale max over experts")

ENGINE_RULES: dict[tuple[str, str, str], EngineRule] = {
    (engine, fmt, scheme): rule
    for engine, nvfp4 in (("vllm", _NVFP4_VLLM), ("sglang", _NVFP4_SGLANG), ("trtllm", _NVFP4_TRTLLM))
    for fmt in ("compressed-tensors", "modelopt")
    for scheme, rule in (("fp8_tensor", _FP8_MOE), ("nvfp4_blocks", nvfp4),
                         ("fp8_channel", EngineRule({}, "layer", "")))
    if (fmt, scheme) in FORMAT_RULES and not (engine == "trtllm" and fmt == "compressed-tensors")
}


def rule_key(weight_bits: int, per_channel: bool) -> str:
    """The scheme key of :data:`FORMAT_RULES` for a float weight of ``weight_bits`` bits."""
    if weight_bits == 4:
        return "nvfp4_blocks"
    return "fp8_channel" if per_channel else "fp8_tensor"
