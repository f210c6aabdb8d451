"""Quantization configs: strict pydantic models, YAML loading with ``$import``, and the shipped presets.

A config says *what* precision goes *where*; :mod:`tensor_quantizer` says *how*. Shape (YAML or dict)::

    quant_cfg:                       # ordered; later entries win (Model Optimizer 0.47 semantics)
      - quantizer_name: "*weight_quantizer"
        cfg: {num_bits: e4m3, axis: null}
      - quantizer_name: "*router*"
        enable: false
    algorithm: max
    experts: {weight_amax: vectorized, input_amax: shared}
    backward: {mode: dequantized, ste: pass_through, grad_num_bits: e5m2}
    kernel: auto                     # auto | triton | torch: how expert fake quant is computed
    gemm: fake_quant                 # fake_quant | te_fp8: real FP8 forward GEMMs in TE grouped linears
    weight_amax_update: dynamic      # static | dynamic | learned (docs/qad.md)
    input_amax_update: static        # static | learned (docs/qad.md)
    autoswitch: {every: 100, underflow_pct: 5.0, mse: 0.05, gemms: [fprop, dgrad, wgrad]}   # optional
    smooth_expert_inputs: {alpha: 0.5}   # optional: exact power-of-two rescaling of the experts' fc2 inputs

``$import: other.yaml`` at the top of a file merges that file first (its ``quant_cfg`` entries come before this
file's); ``- $import: other.yaml`` inside ``quant_cfg`` splices the other file's entries at that place.

The names live in four modules, gathered here: the schema (:mod:`.config_schema`), the loader
(:mod:`.config_loader`), the presets (:mod:`.presets`) and the error messages (:mod:`.config_errors`).
"""

from .config_errors import ConfigError
from .config_loader import load_config, to_config
from .config_schema import (
    AUTOSWITCH_GEMMS,
    DEFAULT_WEIGHT_AMAX_UPDATE,
    INPUT_AMAX_UPDATES,
    WEIGHT_AMAX_UPDATES,
    AutoswitchConfig,
    BackwardConfig,
    ExpertsConfig,
    MaxCalibConfig,
    QuantCfgEntry,
    QuantizeConfig,
    QuantizerAttributeConfig,
    SmoothExpertInputsConfig,
    normalize_algorithm,
)
from .presets import PRESET_FILES, find_preset, preset_path

__all__ = [
    "ConfigError",
    "QuantizerAttributeConfig",
    "QuantCfgEntry",
    "ExpertsConfig",
    "BackwardConfig",
    "MaxCalibConfig",
    "AutoswitchConfig",
    "SmoothExpertInputsConfig",
    "AUTOSWITCH_GEMMS",
    "WEIGHT_AMAX_UPDATES",
    "INPUT_AMAX_UPDATES",
    "DEFAULT_WEIGHT_AMAX_UPDATE",
    "QuantizeConfig",
    "normalize_algorithm",
    "load_config",
    "to_config",
    "preset_path",
    "find_preset",
    "PRESET_FILES",
]
