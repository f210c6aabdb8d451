"""Quantization configs of a model's experts alone, as the tests and the QAD experiments use them."""

from __future__ import annotations

__all__ = ["expert_quant_config", "CALIBRATIONS", "WEIGHT_CALIBRATIONS"]


_MX = {"block_sizes": {-1: 32, "type": "dynamic", "scale_bits": [8, 0]}}
_NVFP4 = {"num_bits": "e2m1", "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": "e4m3"}}
# 4-over-6 block scales from the data (each block's max on E2M1's 6 or 4, whichever is closer)
_NVFP4_46 = {**_NVFP4, "block_sizes": {**_NVFP4["block_sizes"], "four_over_six": True}}
# format -> (weight quantizer attributes, input quantizer attributes)
EXPERT_FORMATS = {
    "nvfp4": (_NVFP4,) * 2,
    # 4-over-6 on weights and inputs; nvfp4_46in: on the inputs alone; nvfp4_46w: on the weights alone
    "nvfp4_46": (_NVFP4_46,) * 2,
    "nvfp4_46in": (_NVFP4, _NVFP4_46),
    "nvfp4_46w": (_NVFP4_46, _NVFP4),
    "fp8": ({"num_bits": "e4m3", "axis": None},) * 2,
    # configs/int8_default.yaml's quantizers: weights per output channel, inputs per tensor
    "int8": ({"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}),
    "mxfp4": ({"num_bits": [2, 1], **_MX},) * 2,
    "mxfp8": ({"num_bits": [4, 3], **_MX},) * 2,
    "fp8_block": ({"num_bits": "e4m3", "block_sizes": {-1: 128, -2: 128}},
                  {"num_bits": "e4m3", "type": "dynamic", "block_sizes": {-1: 128}}),
}
# calibration name -> the config's ``algorithm`` (Model Optimizer's shapes, as docs/calibration.md shows them)
CALIBRATIONS = {
    "max": "max",
    "mse": {"method": "mse"},  # weight MSE search on Model Optimizer's default grid; inputs stay at max
    "fp8_sweep": {"method": "mse", "fp8_scale_sweep": True},  # static NVFP4 block scales, every E4M3 value tried
    "four_over_six": {"method": "mse", "fp8_scale_sweep": False, "start_multiplier": 1.0, "stop_multiplier": 1.5,
                      "step_size": 0.5},
    "percentile": {"method": "histogram", "histogram_method": "percentile", "percentile": 99.99},
    "hist_mse": {"method": "histogram", "histogram_method": "mse"},
    "smooth": "max",  # max, after smooth_expert_inputs rescales the experts' fc2 inputs (gated experts only)
    "per_expert": "max",  # max, one input amax per expert (experts.input_amax: per_expert) instead of one per layer
}
# the calibrations that choose weight amaxes (QAT keeps them static or learns them; ``dynamic`` would replace them)
WEIGHT_CALIBRATIONS = ("mse", "fp8_sweep", "four_over_six")
# the calibrations that need static NVFP4 weight block scales (as Model Optimizer's presets of the same names)
_STATIC_BLOCKS = {"fp8_sweep": {}, "four_over_six": {"four_over_six": True}}
# the calibrations that rescale the experts first (the config's smooth_expert_inputs; docs/calibration.md)
_SMOOTH = {"smooth": {"alpha": 0.5}}
# the experts' input amax layout per calibration (default: shared, one per layer, as most engines keep it)
_INPUT_AMAX = {"per_expert": "per_expert"}


def expert_quant_config(fmt: str, amax_update: str, calib: str = "max") -> dict:
    """Experts' weights and inputs in ``fmt`` (a key of :data:`EXPERT_FORMATS`), every other quantizer off, calibrated
    by ``calib`` (a key of :data:`CALIBRATIONS`; ``fp8_sweep`` and ``four_over_six`` are NVFP4's, with static weight
    block scales as in ``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG`` and ``NVFP4_FOUR_OVER_SIX_CFG``; ``smooth`` is max
    after ``smooth_expert_inputs: {alpha: 0.5}``, for gated experts; ``per_expert`` is max with one input amax per
    expert, for engines that keep per-expert input scales, instead of one per layer)."""
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {sorted(EXPERT_FORMATS)}")
    if calib not in CALIBRATIONS:
        raise ValueError(f"calibration {calib!r}: expected one of {sorted(CALIBRATIONS)}")
    weight, inputs = EXPERT_FORMATS[fmt]
    if calib in _STATIC_BLOCKS:
        if fmt != "nvfp4":
            raise ValueError(f"calibration {calib!r} chooses static NVFP4 block scales: format 'nvfp4' only, got "
                             f"{fmt!r}")
        weight = {**weight, "block_sizes": {**weight["block_sizes"], "type": "static", **_STATIC_BLOCKS[calib]}}
    config = {
        "quant_cfg": [{"quantizer_name": "*experts*weight_quantizer", "cfg": weight},
                      {"quantizer_name": "*experts*input_quantizer", "cfg": inputs}],
        "algorithm": CALIBRATIONS[calib],
        "experts": {"weight_amax": "vectorized", "input_amax": _INPUT_AMAX.get(calib, "shared")},
        "weight_amax_update": amax_update,
    }
    if calib in _SMOOTH:
        config["smooth_expert_inputs"] = _SMOOTH[calib]
    return config
