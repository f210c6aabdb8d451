"""Quantization configs of a model's experts alone, as the tests and the QAD experiments use them."""

from __future__ import annotations

__all__ = ["expert_quant_config"]


_MX = {"block_sizes": {-1: 32, "type": "dynamic", "scale_bits": [8, 0]}}
# format -> (weight quantizer attributes, input quantizer attributes)
EXPERT_FORMATS = {
    "nvfp4": ({"num_bits": "e2m1", "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": "e4m3"}},) * 2,
    "fp8": ({"num_bits": "e4m3", "axis": None},) * 2,
    "mxfp4": ({"num_bits": [2, 1], **_MX},) * 2,
    "mxfp8": ({"num_bits": [4, 3], **_MX},) * 2,
    "fp8_block": ({"num_bits": "e4m3", "block_sizes": {-1: 128, -2: 128}},
                  {"num_bits": "e4m3", "type": "dynamic", "block_sizes": {-1: 128}}),
}


def expert_quant_config(fmt: str, amax_update: str) -> dict:
    """Experts' weights and inputs in ``fmt`` (a key of :data:`EXPERT_FORMATS`), every other quantizer off."""
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {sorted(EXPERT_FORMATS)}")
    weight, inputs = EXPERT_FORMATS[fmt]
    return {
        "quant_cfg": [{"quantizer_name": "*experts*weight_quantizer", "cfg": weight},
                      {"quantizer_name": "*experts*input_quantizer", "cfg": inputs}],
        "algorithm": "max",
        "experts": {"weight_amax": "vectorized", "input_amax": "shared"},
        "weight_amax_update": amax_update,
    }
