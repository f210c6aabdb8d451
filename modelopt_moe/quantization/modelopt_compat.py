"""Model Optimizer 0.47 compatibility in one place: its config shapes and names (:mod:`.modelopt_shapes`) and its
quantizer state, translated both ways.

A Model Optimizer ``TensorQuantizer`` state is plain data under its private attribute names (``_num_bits``,
``_axis``, ``_block_sizes``, ``_disabled``, ``_if_quant``, ``_pytorch_state_metadata``, ...).
:func:`modelopt_quantizer_state` writes ours in that form (``get_modelopt_state``);
:func:`parse_modelopt_quantizer_state` reads it back, and reads what Model Optimizer writes, refusing the features
this package does not have by name.
"""

from __future__ import annotations

from typing import Any

import torch

from ..numerics import get_format, scale_bits_tuple
from .config_schema import QuantizerAttributeConfig
from .modelopt_shapes import COMPAT_DOC, UNSUPPORTED_ALGORITHMS, normalize_quant_cfg, parent_class_name, unsupported
from .utils import warn_once

__all__ = [
    "COMPAT_DOC",
    "unsupported",
    "normalize_quant_cfg",
    "parent_class_name",
    "UNSUPPORTED_ALGORITHMS",
    "modelopt_quantizer_state",
    "parse_modelopt_quantizer_state",
]


# Written by Model Optimizer 0.47 at these values for features this package has not: anything else is refused.
_MODELOPT_FIXED = {
    "_fake_quant": (True,), "_learn_amax": (False,), "_bias": (None,), "_rotate": (False, None),
    "backend": (None,), "backend_extra_args": ({}, None), "_use_constant_amax": (False,), "_constant_amax": (None,),
    "_dequantize": (False,), "_enable_pre_quant_scale": (True,), "_is_nvfp4_static_quantizer": (False,),
}
# Runtime details Model Optimizer keeps on the module (shapes derived at the first forward, dtypes, flags).
_MODELOPT_IGNORED = {
    "_input_dtype", "_quant_max_bound", "_amax_shape_for_export", "_is_static_block_scale_quantizer",
    "_original_shape", "_block_reshape_size", "_padding", "_slices", "_calibrator", "_bias_calibrator",
    "_quantizer_cache", "_shared_quant_tied_attrs", "_onnx_quantizer_type", "_calib_seen",
}
_MODELOPT_FIELDS = {"_num_bits", "_axis", "_block_sizes", "_unsigned", "_narrow_range", "_dynamic", "_effective_bits",
                    "_trt_high_precision_dtype", "_pass_through_bwd", "_disabled", "_if_quant", "_if_calib",
                    "_pytorch_state_metadata"}


def _modelopt_num_bits(cfg: QuantizerAttributeConfig):
    """``num_bits`` as Model Optimizer writes it: an int, or an (E, M) tuple."""
    return get_format(cfg.format).num_bits


def modelopt_quantizer_state(q, properties_only: bool = False) -> dict[str, Any]:
    """The state :meth:`TensorQuantizer.get_modelopt_state` returns, for ``q`` (a ``TensorQuantizer``, an
    ``ExpertQuantizer`` or one expert's ``ExpertView``)."""
    cfg, switches = q.cfg, q.switches()
    block_sizes = None
    if cfg.block_sizes is not None:
        block_sizes = dict(cfg.block_sizes)
        if "scale_bits" in block_sizes:
            block_sizes["scale_bits"] = scale_bits_tuple(block_sizes["scale_bits"])
    state = {
        "_num_bits": _modelopt_num_bits(cfg), "_axis": cfg.axis, "_block_sizes": block_sizes,
        "_unsigned": cfg.unsigned, "_narrow_range": cfg.narrow_range, "_dynamic": cfg.type == "dynamic",
        "_effective_bits": cfg.effective_bits, "_trt_high_precision_dtype": cfg.trt_high_precision_dtype,
        "_pass_through_bwd": q.ste != "clipped", "_disabled": not q.is_enabled,
        "_if_quant": switches["if_quant"], "_if_calib": switches["if_calib"],
        **{k: v[0] for k, v in _MODELOPT_FIXED.items() if k != "_is_nvfp4_static_quantizer"},
    }
    if cfg.static_block_size is not None:
        state["_is_static_block_scale_quantizer"] = True
    if not properties_only:
        amax = q.amax
        buffers = {} if amax is None else {"_amax": {"shape": torch.Size(amax.shape), "dtype": torch.float32}}
        state["_pytorch_state_metadata"] = {"params": {}, "buffers": buffers}
    return state


def parse_modelopt_quantizer_state(state: dict[str, Any]) -> tuple[QuantizerAttributeConfig, dict, tuple | None]:
    """A Model Optimizer (or :func:`modelopt_quantizer_state`) quantizer state as ``(attribute config, {"enabled",
    "if_quant", "if_calib"}, amax shape or None)``.

    Raises:
        ValueError: a feature this package does not have, naming the attribute and its value.
    """
    if not isinstance(state, dict):
        raise ValueError(f"quantizer state: expected a dict, got {type(state).__name__}")
    for key, allowed in _MODELOPT_FIXED.items():
        if key in state and not any(state[key] == a or state[key] is a for a in allowed):
            if key == "_rotate" and isinstance(state[key], dict) and not state[key].get("enable"):
                continue
            raise ValueError(unsupported(f"quantizer state {key}", state[key], "a Model Optimizer feature "
                                         "modelopt_moe does not implement"))
    unknown = sorted(k for k in state if k not in _MODELOPT_FIELDS | _MODELOPT_IGNORED | set(_MODELOPT_FIXED))
    if unknown:
        warn_once(f"quantizer state: ignoring attributes this version does not know: {unknown}")
    block_sizes = state.get("_block_sizes")
    axis = state.get("_axis")
    int_block = block_sizes is not None and isinstance(block_sizes.get(-1), int)
    if int_block:
        axis = None  # Model Optimizer sets _axis=(0,) on the [-1, block] view of static blocks
    if isinstance(axis, list):
        axis = tuple(axis)
    fields = {
        "num_bits": state.get("_num_bits", 8), "axis": axis, "block_sizes": block_sizes,
        "unsigned": bool(state.get("_unsigned", False)), "narrow_range": bool(state.get("_narrow_range", False)),
        "type": "dynamic" if state.get("_dynamic") else "static",
        "pass_through_bwd": bool(state.get("_pass_through_bwd", True)),
        "effective_bits": state.get("_effective_bits"),
        "trt_high_precision_dtype": state.get("_trt_high_precision_dtype", "Float"),
        "enable": not state.get("_disabled", False),
    }
    # A dynamic quantizer with kept axes and no block_sizes is Model Optimizer's per-token {-1: None} after its first
    # forward (it rewrites the blocks into axes): the same quantizer here.
    cfg = QuantizerAttributeConfig(**fields)
    flags = {"enabled": fields["enable"], "if_quant": bool(state.get("_if_quant", True)),
             "if_calib": bool(state.get("_if_calib", False))}
    meta = state.get("_pytorch_state_metadata") or {}
    if meta.get("params"):
        raise ValueError(unsupported("quantizer state parameters", sorted(meta["params"]), "learned amaxes or "
                                     "scales (LSQ) are not implemented"))
    buffers = dict(meta.get("buffers") or {})
    amax_meta = buffers.pop("_amax", None)
    if buffers:
        raise ValueError(unsupported("quantizer state buffers", sorted(buffers), "only an _amax buffer (no "
                                     "pre-quant scale, bias or global amax)"))
    shape = None if amax_meta is None else tuple(amax_meta["shape"])
    return cfg, flags, shape
