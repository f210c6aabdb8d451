"""Quantization configs of a model's experts alone, as the tests and the QAD experiments use them."""

from __future__ import annotations

__all__ = ["expert_quant_config"]


def expert_quant_config(fmt: str, amax_update: str) -> dict:
    """Experts' weights and inputs in ``fmt`` (``nvfp4`` or ``fp8``), every other quantizer off."""
    if fmt == "nvfp4":
        attrs = {"num_bits": "e2m1", "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": "e4m3"}}
    elif fmt == "fp8":
        attrs = {"num_bits": "e4m3", "axis": None}
    else:
        raise ValueError(f"format {fmt!r}: expected 'nvfp4' or 'fp8'")
    return {
        "quant_cfg": [{"quantizer_name": "*experts*weight_quantizer", "cfg": attrs},
                      {"quantizer_name": "*experts*input_quantizer", "cfg": attrs}],
        "algorithm": "max",
        "experts": {"weight_amax": "vectorized", "input_amax": "shared"},
        "weight_amax_update": amax_update,
    }
