"""A workaround for transformers 5.23 reading compressed-tensors NVFP4 MoE experts (tests and the demo only).

transformers 5.23's per-expert dequantize never receives ``weight_global_scale``, so every NVFP4 expert comes out
mis-scaled (about 1e4 times too large) while dense layers are right. Inside :func:`nvfp4_experts_decoded_right`, each
expert is decoded with compressed-tensors' own ``NVFP4PackedCompressor.decompress`` instead. A test
(``tests/distributed/test_hf_export.py``) tells the day upstream fixes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["nvfp4_experts_decoded_right"]


@contextlib.contextmanager
def nvfp4_experts_decoded_right() -> Iterator[None]:
    """Patches transformers' compressed-tensors expert dequantize for the duration of the block."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from transformers.integrations import compressed_tensors as ct_integration

    original = ct_integration.CompressedTensorsDequantize.convert

    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        packed = [k for k in input_dict if k.endswith("weight_packed")]
        dense = "weight_packed" in input_dict  # one dense module's own names: transformers' path is right
        if dense or not packed or not all(k.replace("weight_packed", "weight_global_scale") in input_dict
                                          for k in packed):
            return original(self, input_dict, source_patterns, target_patterns, full_layer_name=full_layer_name,
                            **kwargs)
        scheme = self.scheme or ct_integration.get_experts_scheme(self.hf_quantizer.compressor.quantization_config)
        dtype = kwargs["model"].get_parameter(full_layer_name).dtype
        out = {}
        for key in packed:
            parts = zip(*(input_dict[key.replace("weight_packed", n)]
                          for n in ("weight_packed", "weight_scale", "weight_global_scale")), strict=True)
            out[key] = torch.stack([NVFP4PackedCompressor.decompress(
                {"weight_packed": p, "weight_scale": s, "weight_global_scale": g}, scheme)["weight"].to(dtype)
                for p, s, g in parts])
        return out

    ct_integration.CompressedTensorsDequantize.convert = convert
    try:
        yield
    finally:
        ct_integration.CompressedTensorsDequantize.convert = original
