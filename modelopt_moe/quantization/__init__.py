"""``import modelopt_moe.quantization as mtq``: quantize, calibrate, print_quant_summary, enable/disable_quantizer,
fold_weight, reuse_quantized_weights, update_weight_amax, autoswitch_step / autoswitch_summary, presets and
load_config, and NVIDIA Model Optimizer 0.47's other ``mtq`` functions under their names (set_quantizer_by_cfg,
set_quantizer_attribute(s_full/_partial), postprocess_amax, replace_quant_module); see docs/modelopt_compat.md.

Presets are the YAML files in ``configs/`` loaded at import, as plain dicts (like Model Optimizer's), so users can
copy and edit them.
"""

from ..numerics import FORMATS, fake_quant
from . import nn  # noqa: F401  the framework-free wrappers (registered by the conversion's one registration call)
from .autoswitch import autoswitch_step, autoswitch_summary
from .calibration import CalibrationError, sync_amax
from .config import (
    ConfigError,
    MaxCalibConfig,
    QuantCfgEntry,
    QuantizeConfig,
    QuantizerAttributeConfig,
    load_config,
    preset_path,
)
from .conversion import QuantModuleRegistry, named_quantizers
from .expert_quantizer import ExpertQuantizer
from .model_quant import (
    calibrate,
    disable_quantizer,
    enable_quantizer,
    fold_weight,
    postprocess_amax,
    print_quant_summary,
    quantize,
    replace_quant_module,
    set_quantizer_attribute,
    set_quantizer_attributes_full,
    set_quantizer_attributes_partial,
    set_quantizer_by_cfg,
)
from .quant_mode import QuantMode
from .tensor_quantizer import TensorQuantizer
from .weight_amax import update_weight_amax
from .weight_reuse import reuse_quantized_weights

FP8_DEFAULT_CFG = load_config(preset_path("fp8_default.yaml")).model_dump()
NVFP4_DEFAULT_CFG = load_config(preset_path("nvfp4_default.yaml")).model_dump()
MXFP4_DEFAULT_CFG = load_config(preset_path("mxfp4_default.yaml")).model_dump()
MXFP8_DEFAULT_CFG = load_config(preset_path("mxfp8_default.yaml")).model_dump()
INT8_DEFAULT_CFG = load_config(preset_path("int8_default.yaml")).model_dump()
INT4_BLOCKWISE_WEIGHT_ONLY_CFG = load_config(preset_path("int4_blockwise_weight_only.yaml")).model_dump()
FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG = load_config(preset_path("fp8_block_weight_only.yaml")).model_dump()
FP8_BLOCKWISE_W8A8_CFG = load_config(preset_path("fp8_block_w8a8.yaml")).model_dump()
NVFP4_EXPERTS_FP8_CFG = load_config(preset_path("nvfp4_experts_fp8.yaml")).model_dump()
# NVIDIA's whole recipe in one: NVFP4_EXPERTS_FP8_CFG with FP8_KV_CFG's FP8 KV cache
NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG = load_config(preset_path("nvfp4_experts_fp8_attn_fp8_kv.yaml")).model_dump()
NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG = load_config(preset_path("nvfp4_w4a4_weight_mse_fp8_sweep.yaml")).model_dump()
NVFP4_FOUR_OVER_SIX_CFG = load_config(preset_path("nvfp4_four_over_six.yaml")).model_dump()
# 4-over-6 block scales from the data on weights and inputs (Transformer Engine's nvfp4_4over6 recipe)
NVFP4_4OVER6_CFG = load_config(preset_path("nvfp4_4over6.yaml")).model_dump()
# KV-cache presets, Model Optimizer's shape: rules only, to append to a model preset's quant_cfg.
FP8_KV_CFG = {"quant_cfg": load_config(preset_path("fp8_kv.yaml")).model_dump()["quant_cfg"]}
NVFP4_KV_CFG = {"quant_cfg": load_config(preset_path("nvfp4_kv.yaml")).model_dump()["quant_cfg"]}

__all__ = [
    "quantize", "calibrate", "print_quant_summary", "enable_quantizer", "disable_quantizer", "fold_weight",
    "set_quantizer_by_cfg", "set_quantizer_attributes_full", "set_quantizer_attributes_partial",
    "set_quantizer_attribute", "postprocess_amax", "replace_quant_module", "MaxCalibConfig", "QuantCfgEntry",
    "load_config", "ConfigError", "QuantizeConfig", "QuantizerAttributeConfig", "TensorQuantizer", "ExpertQuantizer",
    "QuantMode", "CalibrationError",
    "reuse_quantized_weights", "fake_quant", "update_weight_amax", "autoswitch_step", "autoswitch_summary",
    "FORMATS", "QuantModuleRegistry", "named_quantizers", "sync_amax", "FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG",
    "MXFP4_DEFAULT_CFG", "MXFP8_DEFAULT_CFG",
    "INT8_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "FP8_BLOCKWISE_W8A8_CFG",
    "NVFP4_EXPERTS_FP8_CFG", "NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG",
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG",
    "NVFP4_FOUR_OVER_SIX_CFG",
    "NVFP4_4OVER6_CFG",
    "FP8_KV_CFG", "NVFP4_KV_CFG",
]
