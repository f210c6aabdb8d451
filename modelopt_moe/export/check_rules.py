"""The engines' loader contracts as data: what each checkpoint format stores per quantized linear, and what each
serving engine does with an MoE layer's per-expert scales. :mod:`.check` walks these tables; adding a format or an
engine is a few entries here.

A :class:`FormatRule` lists the tensors of one quantized linear (name suffix, safetensors dtype, shape in terms of
the linear's ``[R, C]`` weight and the scheme's group or block) and how each stored scale maps to an *amax* (the
range it covers), so that scales of different conventions compare. An :class:`EngineRule` says, for one (engine,
format, scheme), which scales the engine fuses over gate and up (``equal``: the engine keeps one of them and the
other projection is dequantized with it; ``max``: it requantizes both onto the larger one), how it collapses the
per-expert input scales (``layer``: one scale per layer, the max over experts; ``expert``: one per expert, the max
over gate and up; ``none``: the inputs' scales come from the data at run time), and what its MoE loader refuses.

Read from the loaders (vLLM ``model_executor/layers/quantization/modelopt.py`` and
``compressed_tensors/compressed_tensors_moe/*.py``, ``compressed_tensors/schemes/*.py``, SGLang
``srt/layers/quantization/modelopt_quant.py`` and ``compressed_tensors/``, TensorRT-LLM
``_torch/modules/fused_moe/quantization.py`` and ``quantization/mode.py``):

* NVFP4 experts: vLLM and SGLang keep the gate's weight global scale for the fused gate/up GEMM and only warn when
  the up projection's differs; TensorRT-LLM asserts they are equal. vLLM's CUTLASS path keeps one input scale per
  expert (max of gate and up), its FlashInfer paths and TensorRT-LLM one per layer.
* FP8 per-tensor experts: every engine takes one input scale per layer (the max over experts, with a warning) and
  requantizes gate and up onto the larger of their two weight scales.
* FP8 per-channel experts (``FP8_DYNAMIC``): one scale per output row, nothing to fuse; vLLM's compressed-tensors
  MoE method (``CompressedTensorsW8A8Fp8MoEMethod``) takes per-channel weights only with dynamic per-token inputs
  (static per-tensor inputs fail its assertion). Model Optimizer's ``FP8_PER_CHANNEL_PER_TOKEN`` scale is ``[R]``
  (vLLM's ``ModelOptFp8PcPtLinearMethod`` registers ``[out]``), compressed-tensors' ``[R, 1]``.
* FP8 128x128 blocks: fp32 scale grid ``[ceil(R/128), ceil(C/128)]`` (compressed-tensors; Model Optimizer
  ``FP8_PB_WO`` ``[ceil(R/128), 1, ceil(C/128), 1]``, what vLLM's ``ModelOptFp8PbWoLinearMethod`` reads). The fused
  gate/up weight stacks the two grids, so vLLM's block MoE method refuses an expert FFN size that is not a multiple
  of the block's rows (``intermediate_size_per_partition % block_n``). TensorRT-LLM's ``QuantAlgo`` has no
  ``FP8_PB_WO`` (its block FP8 is ``FP8_BLOCK_SCALES``).
* INT4 W4A16 groups (``pack-quantized``): ``weight_packed`` int32 ``[R, C/8]``, a float scale per group ``[R, C/g]``
  (vLLM's ``CompressedTensorsWNA16`` / ``CompressedTensorsWNA16MoEMethod``: ``C // group_size`` groups, any float
  dtype), ``weight_shape`` ``[2]``; scales per row, nothing to fuse.
* MXFP4 / MXFP8: E2M1 codes packed two per byte ``[R, C/2]`` (MXFP4) or E4M3 ``[R, C]`` (MXFP8), an E8M0 uint8
  scale per 32 inputs ``[R, C/32]`` (``127 + exponent``; 255 is NaN); inputs, where quantized, scaled from the data.
* TensorRT-LLM and compressed-tensors (``tensorrt_llm/models/quant_config_utils.py``): one ``QuantAlgo`` per config
  group, a ValueError for the rest. FP8 per channel needs ``token`` inputs, FP8 blocks inputs in groups of 128,
  NVFP4 ``tensor_group`` inputs in groups of 16, MXFP4 groups of 32 (read as weight-only); per-tensor FP8, MXFP8 and
  integer weights are refused. The experts then load as a Model Optimizer checkpoint's do.
* KV cache (:data:`KV_RULES`): one fp32 ``k_scale`` / ``v_scale`` per attention layer, ``[]`` or ``[1]``
  (compressed-tensors ``<attn>.k_scale``, Model Optimizer ``<attn>.k_proj.k_scale``; vLLM's and SGLang's
  ``maybe_remap_kv_scale_name`` maps both onto the attention layer). An absent one is read as 1.0 by vLLM (a scale the
  model did not train with).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..numerics.nvfp4 import NVFP4, NVFP4_FOUR_OVER_SIX

__all__ = ["TensorRule", "FormatRule", "EngineRule", "KvRule", "FORMAT_RULES", "ENGINE_RULES", "KV_RULES", "ENGINES",
           "rule_key"]

ENGINES = ("vllm", "sglang", "trtllm")
FP8_MAX = 448.0
# NVFP4's second-level scale is amax / 2688; with 4-over-6 block scales (normalized to 256) amax / 1536
NVFP4_BOUND, NVFP4_FOUR_OVER_SIX_BOUND = NVFP4.bound, NVFP4_FOUR_OVER_SIX.bound
FLOAT_SCALE = "F32|BF16|F16"  # group scales: the loaders copy them into their own float dtype


@dataclass(frozen=True)
class TensorRule:
    """One stored tensor of a quantized linear.

    Attributes:
        suffix: appended to the module name (``weight_scale``).
        dtype: the safetensors dtype name the loaders take (``F8_E4M3``, ``U8``, ``F32``; ``|`` between several).
        shape: ``w`` ``[R, C]``, ``packed`` ``[R, C/2]``, ``packed8`` ``[R, C/8]``, ``blocks16`` ``[R, C/16]``,
            ``groups`` ``[R, C/g]`` (``g`` the scheme's group), ``tiles`` ``[ceil(R/bR), ceil(C/bC)]`` (the scheme's
            2-D block), ``tiles4d`` ``[ceil(R/bR), 1, ceil(C/bC), 1]``, ``scalar`` ``[]`` or ``[1]``, ``rows``
            ``[R, 1]`` or ``[R]``, ``rows1d`` ``[R]``, ``pair`` ``[2]``.
        role: ``weight``; ``block_scale`` (E4M3 per block: finite, non-negative); ``e8m0_scale`` (uint8 exponents:
            not 255, NaN); ``group_scale`` (float per group or 2-D block: finite, positive, normal);
            ``weight_scale`` / ``input_scale`` (per tensor or channel: finite, positive, normal, with a normal
            reciprocal); ``weight_shape`` (the value ``[R, C]``).
        to_amax: the amax the stored value stands for (``v * 448``, ``2688 / v``, ...), to compare scales.
        inputs_only: stored only when the scheme quantizes inputs with a static scale.
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

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The safetensors dtype names the loaders take."""
        return tuple(self.dtype.split("|"))

    def expected_shapes(self, r: int, c: int, group) -> tuple[tuple[tuple[int, ...], ...], str | None]:
        """The shapes this tensor may have for an ``[R, C]`` weight and the scheme's ``group`` (an int or a 2-D
        block), and why none fits (None: they do)."""
        if self.shape in ("packed8", "groups", "blocks16", "packed"):
            div = {"packed8": 8, "groups": group, "blocks16": 16, "packed": 2}[self.shape]
            if not div or c % div:
                return (), f"the input dim {c} is not a multiple of {div} (the loaders take whole groups)"
            return ((r, c // div),), None
        if self.shape in ("tiles", "tiles4d"):
            br, bc = group
            rows, cols = math.ceil(r / br), math.ceil(c / bc)
            return (((rows, cols),) if self.shape == "tiles" else ((rows, 1, cols, 1),)), None
        return {"w": ((r, c),), "scalar": ((), (1,)), "rows": ((r, 1), (r,)), "rows1d": ((r,),),
                "pair": ((2,),)}[self.shape], None


@dataclass(frozen=True)
class FormatRule:
    """A format's tensors for one scheme (``fp8_tensor``, ``fp8_channel``, ``nvfp4_blocks``, ``fp8_block``,
    ``int4_groups``, ``mxfp4_blocks``, ``mxfp8_blocks``)."""

    tensors: tuple[TensorRule, ...]

    def stored(self, inputs: bool) -> tuple[TensorRule, ...]:
        """The tensors a linear of this scheme holds (with or without static input scales)."""
        return tuple(t for t in self.tensors if inputs or not t.inputs_only)

    def role(self, role: str) -> TensorRule | None:
        """The tensor of ``role`` (None: this format has none)."""
        return next((t for t in self.tensors if t.role == role), None)

    def four_over_six(self, weights: bool, inputs: bool) -> FormatRule:
        """This rule for a linear whose weights and / or inputs use NVFP4 4-over-6 block scales: their second-level
        scales stand for ``amax / 1536`` instead of NVFP4's ``amax / 2688`` (itself where neither does, or where this
        format has no NVFP4 second-level scale)."""
        roles = {r for r, used in (("weight_scale", weights), ("input_scale", inputs)) if used}
        tensors = tuple(replace(t, to_amax=math.copysign(NVFP4_FOUR_OVER_SIX_BOUND, t.to_amax))
                        if t.role in roles and abs(t.to_amax) == NVFP4_BOUND else t for t in self.tensors)
        return self if tensors == self.tensors else FormatRule(tensors)


@dataclass(frozen=True)
class EngineRule:
    """What one engine does with an MoE layer's expert scales in one format and scheme.

    Attributes:
        gate_up: scale role -> ``equal`` (the engine keeps the gate's; a different up scale is an error) or ``max``
            (requantized onto the larger one: a warning with the ratio).
        input_collapse: ``layer`` (one input scale per layer: max over experts), ``expert`` (one per expert) or
            ``none`` (no stored input scale: dynamic inputs, or weight-only).
        dynamic_expert_inputs: the engine's MoE method takes this scheme's experts only with dynamic inputs (a
            static input scale is an error).
        whole_row_blocks: the engine stacks gate and up into one weight whose 2-D scale blocks must not straddle
            them: the expert FFN size must be a multiple of the block's rows.
        refuses: the engine has no loader for this scheme: why (an error).
        input_strategies: the inputs' compressed-tensors strategies the engine's config reader takes for this scheme
            (``token``, ``group128``, ``tensor_group``; ``none``: not quantized); empty: any. Another is an error.
        groups: the weight group sizes the engine's config reader takes; empty: any. Another is an error.
        source: where the loader says so.
    """

    gate_up: dict[str, str] = field(default_factory=dict)
    input_collapse: str = "layer"
    dynamic_expert_inputs: bool = False
    whole_row_blocks: bool = False
    refuses: str = ""
    input_strategies: tuple[str, ...] = ()
    groups: tuple[int, ...] = ()
    source: str = ""


@dataclass(frozen=True)
class KvRule:
    """The KV cache's per-layer scales in one format: ``k_scale`` / ``v_scale`` on the attention module
    (``attention``) or on its ``k_proj`` / ``v_proj`` (``projection``)."""

    on: str
    scale: TensorRule


_FP8_W = TensorRule("weight", "F8_E4M3", "w", "weight")
_NVFP4_BLOCKS = TensorRule("weight_scale", "F8_E4M3", "blocks16", "block_scale")
_E8M0 = TensorRule("weight_scale", "U8", "groups", "e8m0_scale")
_BLOCK_SCALES = "F32"  # fp32 per 2-D block (compressed-tensors' block strategy, DeepSeek's and Model Optimizer's)

FORMAT_RULES: dict[tuple[str, str], FormatRule] = {
    ("compressed-tensors", "fp8_tensor"): FormatRule((
        _FP8_W, TensorRule("weight_scale", "F32", "scalar", "weight_scale", FP8_MAX),
        TensorRule("input_scale", "F32", "scalar", "input_scale", FP8_MAX, inputs_only=True))),
    ("compressed-tensors", "fp8_channel"): FormatRule((
        _FP8_W, TensorRule("weight_scale", "F32", "rows", "weight_scale", FP8_MAX),
        TensorRule("input_scale", "F32", "scalar", "input_scale", FP8_MAX, inputs_only=True))),
    ("compressed-tensors", "nvfp4_blocks"): FormatRule((
        TensorRule("weight_packed", "U8", "packed", "weight"), _NVFP4_BLOCKS,
        TensorRule("weight_global_scale", "F32", "scalar", "weight_scale", -NVFP4_BOUND),
        TensorRule("input_global_scale", "F32", "scalar", "input_scale", -NVFP4_BOUND, inputs_only=True))),
    ("compressed-tensors", "fp8_block"): FormatRule((
        _FP8_W, TensorRule("weight_scale", _BLOCK_SCALES, "tiles", "group_scale"))),
    ("compressed-tensors", "int4_groups"): FormatRule((
        TensorRule("weight_packed", "I32", "packed8", "weight"),
        TensorRule("weight_scale", FLOAT_SCALE, "groups", "group_scale"),
        TensorRule("weight_shape", "I64|I32", "pair", "weight_shape"))),
    ("compressed-tensors", "mxfp4_blocks"): FormatRule((TensorRule("weight_packed", "U8", "packed", "weight"), _E8M0)),
    ("compressed-tensors", "mxfp8_blocks"): FormatRule((_FP8_W, _E8M0)),
    ("modelopt", "fp8_tensor"): FormatRule((
        _FP8_W, TensorRule("weight_scale", "F32", "scalar", "weight_scale", FP8_MAX),
        TensorRule("input_scale", "F32", "scalar", "input_scale", FP8_MAX, inputs_only=True))),
    ("modelopt", "fp8_channel"): FormatRule((_FP8_W, TensorRule("weight_scale", "F32", "rows1d", "weight_scale",
                                                                FP8_MAX))),
    ("modelopt", "nvfp4_blocks"): FormatRule((
        TensorRule("weight", "U8", "packed", "weight"), _NVFP4_BLOCKS,
        TensorRule("weight_scale_2", "F32", "scalar", "weight_scale", NVFP4_BOUND),
        TensorRule("input_scale", "F32", "scalar", "input_scale", NVFP4_BOUND, inputs_only=True))),
    ("modelopt", "fp8_block"): FormatRule((_FP8_W, TensorRule("weight_scale", _BLOCK_SCALES, "tiles4d",
                                                              "group_scale"))),
    ("modelopt", "mxfp8_blocks"): FormatRule((_FP8_W, _E8M0)),
}

_KV_SCALE = TensorRule("", FLOAT_SCALE, "scalar", "input_scale", FP8_MAX)
KV_RULES: dict[str, KvRule] = {"compressed-tensors": KvRule("attention", _KV_SCALE),
                               "modelopt": KvRule("projection", _KV_SCALE)}

_FP8_MOE = EngineRule({"weight_scale": "max"}, "layer",
                      source="fp8 MoE process_weights_after_loading: max over experts of w13/w2 input scales; w1/w3 "
                      "requantized with the max weight scale")
_NVFP4_VLLM = EngineRule({"weight_scale": "equal"}, "expert",
                         source="ModelOptNvFp4FusedMoE / CompressedTensorsW4A4Nvfp4MoEMethod: w13 global scale [:, 0] "
                         "(warns 'w1_weight_scale_2 must match w3_weight_scale_2'); CUTLASS input scale max(dim=1)")
_NVFP4_SGLANG = EngineRule({"weight_scale": "equal"}, "layer",
                           source="ModelOptNvFp4FusedMoEMethod: w13 global scale [:, 0]; one input scale per layer on "
                           "its FlashInfer backends")
_NVFP4_TRTLLM = EngineRule({"weight_scale": "equal"}, "layer",
                           source="load_expert_fc31_alpha_nvfp4 asserts w1_weight_scale_2 == w3_weight_scale_2; "
                           "fc31/fc2 input scale max over experts")
# Scales per row, group or block, inputs scaled from the data: nothing the engines fuse or collapse.
_PER_ROW = EngineRule({}, "none", source="scales per output row / group / block: each projection keeps its own")
_FP8_CHANNEL_VLLM_CT = EngineRule({}, "layer", dynamic_expert_inputs=True,
                                  source="CompressedTensorsW8A8Fp8MoEMethod: channel weights with token inputs only")
_FP8_BLOCK_MOE = EngineRule({}, "none", whole_row_blocks=True,
                            source="CompressedTensorsW8A8Fp8MoEMethod / Fp8MoEMethod create_weights: "
                            "intermediate_size_per_partition % block_n")
_FP8_PB_WO_TRTLLM = EngineRule(refuses="quant_algo FP8_PB_WO is not a TensorRT-LLM QuantAlgo (its 128x128 block FP8 "
                               "is FP8_BLOCK_SCALES)", source="tensorrt_llm/quantization/mode.py QuantAlgo")


# TensorRT-LLM's compressed-tensors reader (tensorrt_llm/models/quant_config_utils.py,
# _quant_config_from_config_group) maps each config group onto one QuantAlgo and raises ValueError on the rest:
# 8-bit weights per channel with token inputs (FP8_PER_CHANNEL_PER_TOKEN) or per block with inputs in groups of 128
# (FP8_BLOCK_SCALES); 4-bit float weights in tensor groups of 16 with tensor-group inputs (NVFP4); 4-bit float weights
# in groups of 32 (mxfp4-pack-quantized: W4A16_MXFP4, inputs left unquantized). The experts then go through the same
# fused-MoE loaders as a Model Optimizer checkpoint's.
_TRTLLM_CT_SOURCE = "tensorrt_llm/models/quant_config_utils.py _quant_config_from_config_group"
_TRTLLM_CT_8BIT = ("8-bit weights are read per 'channel' (with 'token' inputs) or per 'block' (with inputs in groups "
                   "of 128) only")
_TRTLLM_CT: dict[str, EngineRule] = {
    "fp8_tensor": EngineRule(refuses=f"weights strategy 'tensor' is not read by TensorRT-LLM's compressed-tensors "
                             f"reader: {_TRTLLM_CT_8BIT}", source=_TRTLLM_CT_SOURCE),
    "fp8_channel": EngineRule({}, "none", input_strategies=("token",), source=_TRTLLM_CT_SOURCE),
    "fp8_block": EngineRule({}, "none", input_strategies=("group128",), source=_TRTLLM_CT_SOURCE),
    "nvfp4_blocks": replace(_NVFP4_TRTLLM, input_strategies=("tensor_group",), groups=(16,)),
    "mxfp4_blocks": replace(_PER_ROW, groups=(32,), source=_TRTLLM_CT_SOURCE),
    "mxfp8_blocks": EngineRule(refuses=f"weights strategy 'group' with 8 bits (MXFP8) is not read by TensorRT-LLM's "
                               f"compressed-tensors reader: {_TRTLLM_CT_8BIT}", source=_TRTLLM_CT_SOURCE),
    "int4_groups": EngineRule(refuses="integer weights are not read by TensorRT-LLM's compressed-tensors reader (it "
                              "takes 8-bit float and 4-bit float NVFP4 / MXFP4 weights only)",
                              source=_TRTLLM_CT_SOURCE),
}


def _engine_rule(engine: str, fmt: str, scheme: str) -> EngineRule | None:
    if engine == "trtllm" and fmt == "compressed-tensors":
        return _TRTLLM_CT[scheme]
    if scheme == "fp8_tensor":
        return _FP8_MOE
    if scheme == "nvfp4_blocks":
        return {"vllm": _NVFP4_VLLM, "sglang": _NVFP4_SGLANG, "trtllm": _NVFP4_TRTLLM}[engine]
    if scheme == "fp8_channel":
        return _FP8_CHANNEL_VLLM_CT if (engine, fmt) == ("vllm", "compressed-tensors") else EngineRule({}, "layer")
    if scheme == "fp8_block":
        return _FP8_PB_WO_TRTLLM if engine == "trtllm" else _FP8_BLOCK_MOE
    if scheme == "mxfp8_blocks" and engine == "trtllm":
        return None  # not read for this page: reported as unchecked
    return _PER_ROW


ENGINE_RULES: dict[tuple[str, str, str], EngineRule] = {
    (engine, fmt, scheme): rule
    for engine in ENGINES for (fmt, scheme) in FORMAT_RULES
    if (rule := _engine_rule(engine, fmt, scheme)) is not None
}


def rule_key(weight_bits: int, per_channel: bool) -> str:
    """The scheme key of :data:`FORMAT_RULES` for a float weight of ``weight_bits`` bits."""
    if weight_bits == 4:
        return "nvfp4_blocks"
    return "fp8_channel" if per_channel else "fp8_tensor"
