"""Number formats and the pure-torch reference fake quantization: the numeric contract every fast path matches.

The bottom layer of the project: it imports torch only, and nothing else of the project imports below it. Each
format family has one home (:mod:`.fp8`, :mod:`.nvfp4`, :mod:`.integer`, :mod:`.mx`) on the
:class:`~.format.Format` base; the formats are registered once in :mod:`.registry`.
"""

from .format import ExportCodec, Format, KernelRoutine, KernelSpec, ScaleLayout, UnsupportedSetting
from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    FORMATS,
    FOUR_OVER_SIX_SCALE_MAX,
    NVFP4_BLOCK_SIZE,
    TINY_AMAX,
    FormatSpec,
    Quantized,
    clip_limit,
    dequantize,
    fake_quant,
    format_from_num_bits,
    get_format,
    quantize,
    round_to_e2m1,
    safe_amax,
)
from .quant_error import STAT_FIELDS, quant_error_sums, relative_mse, underflow_pct
from .registry import format_of, scale_bits_tuple
from .row_scale import scale_rows, scale_rows_backward

__all__ = [
    "E2M1_MAX", "FOUR_OVER_SIX_SCALE_MAX",
    "E4M3_MAX", "FORMATS", "NVFP4_BLOCK_SIZE", "TINY_AMAX", "FormatSpec", "Quantized", "clip_limit",
    "dequantize", "fake_quant", "format_from_num_bits", "get_format", "quantize", "round_to_e2m1", "safe_amax",
    "STAT_FIELDS", "quant_error_sums", "relative_mse", "underflow_pct", "scale_rows", "scale_rows_backward",
    "ExportCodec", "Format", "KernelRoutine", "KernelSpec", "ScaleLayout", "UnsupportedSetting", "format_of",
    "scale_bits_tuple",
]
