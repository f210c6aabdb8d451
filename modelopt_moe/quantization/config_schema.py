"""The config schema: strict pydantic models of what precision goes where (no YAML, no files).

:class:`QuantizeConfig` is what :func:`mtq.quantize` takes; :class:`QuantizerAttributeConfig` is one quantizer's
attributes (Model Optimizer 0.47's names and defaults). Every model forbids unknown keys and validates where it is
built, naming the field, the value and the allowed set. Reading YAML files: :mod:`.config_loader`; shaping
validation errors into messages: :mod:`.config_errors`; both are gathered with these models in :mod:`.config`.
"""

from __future__ import annotations

import difflib
import fnmatch
import warnings
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from ..numerics import (
    E4M3_MAX,
    FOUR_OVER_SIX_SCALE_MAX,
    ScaleLayout,
    UnsupportedSetting,
    format_from_num_bits,
    format_of,
    get_format,
)
from .modelopt_shapes import UNSUPPORTED_ALGORITHMS, normalize_quant_cfg, unsupported
from .modelopt_shapes import parent_class_name as _modelopt_parent_class

__all__ = [
    "QuantizerAttributeConfig",
    "QuantCfgEntry",
    "ExpertsConfig",
    "BackwardConfig",
    "MaxCalibConfig",
    "HistogramCalibConfig",
    "MseCalibConfig",
    "CALIBRATION_OPTIONS",
    "AutoswitchConfig",
    "SmoothExpertInputsConfig",
    "AUTOSWITCH_GEMMS",
    "WEIGHT_AMAX_UPDATES",
    "INPUT_AMAX_UPDATES",
    "DEFAULT_WEIGHT_AMAX_UPDATE",
    "QuantizeConfig",
    "normalize_algorithm",
    "legacy_kernel",
    "LEGACY_TE_FP8_KERNEL",
]


def _check_effective_bits(v: float | None) -> float | None:
    """Model Optimizer's range for ``effective_bits`` (its auto-quantize cost model; no effect here)."""
    if v is not None and not 0 < v <= 16:
        raise ValueError(f"effective_bits must be in (0, 16], got {v}")
    return v


def _block_axes_hint(spec) -> str:
    if ScaleLayout.BLOCKS_2D in spec.scale_layouts:
        return "blocks along the last dim (key -1) or 2-D blocks of the last two dims (keys -1 and -2)"
    return f"{spec.label}: blocks along the last dim only: a single key -1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


class QuantizerAttributeConfig(_Strict):
    """How one quantizer quantizes (names and defaults follow NVIDIA Model Optimizer 0.47 so users switch by import).

    Attributes:
        num_bits: ``(4, 3)``/``"e4m3"``, ``(5, 2)``/``"e5m2"``, ``(2, 1)``/``"e2m1"`` (NVFP4), an int 2..8.
        axis: ``None`` for one amax per tensor; an int (or tuple of ints) for one amax per slice along those axes
            (per channel: the kept axes, as in Model Optimizer).
        block_sizes: ``{-1: 16, "type": "dynamic", "scale_bits": (4, 3)}`` for NVFP4; ``{-1: 32, "type":
            "dynamic", "scale_bits": (8, 0)}`` with ``num_bits`` ``(2, 1)`` / ``(4, 3)`` for MXFP4 / MXFP8 (E8M0
            block scales; any other block refused); ``{-1: 128, "type": "static"}`` for INT4 blocks with calibrated
            (static) per-block amaxes, ``"type": "dynamic"`` for block amaxes taken from the data at every call;
            ``{-1: None}`` with ``type: dynamic``: one amax per token.
            Without ``"type"`` int blocks are static (Model Optimizer's default) and NVFP4 blocks dynamic (the only
            NVFP4 this package has). A last dim that is not a multiple of an int block is zero-padded. FP8:
            ``{-1: 128, -2: 128}`` for 2-D weight blocks (scales always from the data), ``{-1: 128}`` with ``type:
            dynamic`` for per-token groups of 128 (a dynamic quantizer's blocks are dynamic blocks).
        enable: whether the quantizer is on.
        narrow_range: int formats: levels ``[-B, B]`` (True) or ``[-B-1, B]`` (False, Model Optimizer's default).
        unsigned: int formats: levels ``[0, 2**b - 1]``.
        type: ``"static"`` (calibrated amax) or ``"dynamic"`` (amax of each tensor, never calibrated).
        pass_through_bwd: straight-through gradient (True) or zero gradient where ``|x| > amax`` (False; also set
            for every quantizer by ``backward.ste: clipped``).
        effective_bits, trt_high_precision_dtype: accepted for Model Optimizer configs; no effect here (auto-quantize
            cost model, ONNX export).
        fake_quant, learn_amax, calibrator, bias, rotate, backend, backend_extra_args, use_constant_amax,
            constant_amax: accepted at Model Optimizer's defaults only; other values are features this package does
            not have and raise (see ``docs/modelopt_compat.md``).
    """

    num_bits: int | tuple[int, int] | str = 8
    axis: int | tuple[int, ...] | None = None
    block_sizes: dict[int | str, Any] | None = None
    enable: bool = True
    narrow_range: bool = False
    unsigned: bool = False
    type: Literal["static", "dynamic"] = "static"
    pass_through_bwd: bool = True
    effective_bits: float | None = None
    trt_high_precision_dtype: Literal["Float", "Half", "BFloat16"] = "Float"
    fake_quant: bool = True
    learn_amax: bool = False
    calibrator: Any = "max"
    bias: Any = None
    rotate: Any = False
    backend: str | None = None
    backend_extra_args: dict | None = None
    use_constant_amax: bool = False
    constant_amax: float | None = None

    @field_validator("num_bits", mode="before")
    @classmethod
    def _num_bits(cls, v):
        if isinstance(v, list):
            v = tuple(v)
        format_from_num_bits(v)  # raises ValueError naming the allowed values
        return v

    @field_validator("axis", mode="before")
    @classmethod
    def _axis(cls, v):
        return tuple(v) if isinstance(v, list) else v

    @field_validator("block_sizes", mode="before")
    @classmethod
    def _block_sizes(cls, v):
        if isinstance(v, dict) and isinstance(v.get("scale_bits"), list):
            v = {**v, "scale_bits": tuple(v["scale_bits"])}
        return v

    @field_validator("effective_bits")
    @classmethod
    def _effective_bits(cls, v):
        return _check_effective_bits(v)

    @model_validator(mode="after")
    def _modelopt_defaults_only(self):
        """Model Optimizer features this package does not have: accepted only at their defaults."""
        checks = [
            ("fake_quant", self.fake_quant is True, "real quantization: modelopt_moe only fake-quantizes"),
            ("learn_amax", self.learn_amax is False, "deprecated in Model Optimizer as well"),
            ("calibrator", self.calibrator == "max", "the calibrator is chosen for the whole model by 'algorithm'; "
                                                      "histograms: algorithm {'method': 'histogram', ...}"),
            ("bias", self.bias is None, "no affine (biased) quantization"),
            ("rotate", not (self.rotate is True or (isinstance(self.rotate, dict) and self.rotate.get("enable"))),
             "no Hadamard rotation"),
            ("backend", self.backend is None, "no custom quantization backends"),
            ("backend_extra_args", not self.backend_extra_args, "no custom quantization backends"),
            ("use_constant_amax", self.use_constant_amax is False, "no constant amax; calibrate instead"),
            ("constant_amax", self.constant_amax is None, "no constant amax; calibrate instead"),
        ]
        for name, ok, hint in checks:
            if not ok:
                raise ValueError(unsupported(name, getattr(self, name), hint))
        return self

    @model_validator(mode="after")
    def _blocks(self):
        fmt = self.format
        spec = get_format(fmt)
        bs = self.block_sizes
        if self.unsigned and not spec.integer:
            raise ValueError(f"unsigned=True applies to int formats only, got num_bits={self.num_bits!r} ({fmt})")
        if self.axis is not None and not isinstance(self.axis, int):
            if not all(isinstance(a, int) and not isinstance(a, bool) for a in self.axis) or not self.axis:
                raise ValueError(f"axis must be None, an int or a tuple of ints, got {self.axis!r}")
        if bs is not None:
            unknown = {k for k in bs if isinstance(k, str)} - {"type", "scale_bits", "four_over_six"}
            if "scale_block_sizes" in unknown:
                raise ValueError(unsupported("block_sizes.scale_block_sizes", bs["scale_block_sizes"],
                                             "no double-quantized block scales"))
            if unknown:
                raise ValueError(f"block_sizes: unsupported keys {sorted(unknown)}; expected -1 (last-dim block "
                                 "size), 'type', 'scale_bits', 'four_over_six'")
            if "four_over_six" in bs and ScaleLayout.TWO_LEVEL not in spec.scale_layouts:
                raise ValueError(f"block_sizes.four_over_six applies to two-level block scales (NVFP4), got "
                                 f"num_bits={self.num_bits!r} ({fmt})")
            axes = [k for k in bs if not isinstance(k, str)]
            two_d = sorted(axes) == [-2, -1] and ScaleLayout.BLOCKS_2D in spec.scale_layouts
            if axes != [-1] and not two_d:
                raise ValueError(unsupported("block_sizes", bs, _block_axes_hint(spec))
                                 if axes and all(isinstance(k, int) for k in axes) else
                                 f"block_sizes: unsupported keys {sorted(map(str, axes))}; expected -1 (last-dim "
                                 "block size), 'type', 'scale_bits'")
            if two_d and not all(isinstance(bs[k], int) and not isinstance(bs[k], bool) and bs[k] > 0
                                 for k in (-1, -2)):
                raise ValueError(f"block_sizes: 2-D blocks need positive ints for -1 and -2, got {bs!r}")
            if bs.get("type", "static") not in ("static", "dynamic"):
                raise ValueError(f"block_sizes.type={bs.get('type')!r}: expected 'static' or 'dynamic'")
            if bs[-1] is not None and (isinstance(bs[-1], bool) or not isinstance(bs[-1], int) or bs[-1] <= 0):
                raise ValueError(f"block_sizes[-1] must be a positive int (or None: one amax per token), got "
                                 f"{bs[-1]!r}")
            if self.axis is not None:
                raise ValueError(f"axis={self.axis} cannot be combined with block_sizes")
            if bs[-1] is None:
                if self.type != "dynamic" and bs.get("type") != "dynamic":
                    raise ValueError(unsupported("block_sizes", bs, "a static amax per token depends on the number "
                                                 "of tokens; use type: dynamic"))
            elif "scale_bits" in bs and spec.block_scale is None:
                raise ValueError(unsupported("block_sizes.scale_bits", bs["scale_bits"], "no quantized block scales "
                                             "besides NVFP4's E4M3 and MX's E8M0"))
        try:
            spec.check_config(bs, self.axis)  # the format's own rules
        except UnsupportedSetting as e:
            raise ValueError(unsupported(e.key, e.value, e.hint)) from None
        return self

    @property
    def format(self) -> str:
        """The format name in :data:`formats.FORMATS` (``num_bits``, and the block scales' ``scale_bits`` where they
        select the format: E8M0 for MX)."""
        return format_of(self.num_bits, self.block_sizes)

    @property
    def _int_block(self) -> int | None:
        if self.block_sizes is None or get_format(self.format).block is not None:  # a fixed block is no int block
            return None
        return self.block_sizes[-1]

    @property
    def block_2d(self) -> tuple[int, int] | None:
        """``(rows, cols)`` of 2-D blocks (``block_sizes: {-1: cols, -2: rows}``), whose scales always come from the
        data; None otherwise."""
        if self.block_sizes is None or self.block_sizes.get(-2) is None:
            return None
        return self.block_sizes[-2], self.block_sizes[-1]

    @property
    def _dynamic_blocks(self) -> bool:
        # Block amaxes from the data: ``block_sizes.type: dynamic``, or a dynamic quantizer (``type: dynamic``, Model
        # Optimizer's spelling of 1x128 per-token FP8 groups), whose amaxes are never calibrated.
        return self.block_sizes.get("type") == "dynamic" or self.type == "dynamic"

    @property
    def block_size(self) -> int | tuple[int, int] | None:
        """Last-dim block size of blocks whose amax comes from the data (dynamic), or ``(rows, cols)`` of 2-D blocks;
        None otherwise (NVFP4's 16 is implied). What the kernels and ``formats.fake_quant`` take as ``block_size``."""
        if self.block_2d is not None:
            return self.block_2d
        b = self._int_block
        return b if b and self._dynamic_blocks else None

    @property
    def static_block_size(self) -> int | None:
        """Last-dim block size of int blocks with calibrated (static) per-block amaxes; None otherwise."""
        b = self._int_block
        return b if b and self.block_2d is None and not self._dynamic_blocks else None

    @property
    def static_block_scales(self) -> bool:
        """Two-level formats (NVFP4) with calibrated per-block amaxes (``block_sizes.type: static``) instead of block
        scales from the data."""
        return (self.block_sizes is not None and self.block_sizes.get("type") == "static"
                and ScaleLayout.TWO_LEVEL in get_format(self.format).scale_layouts and self.type != "dynamic")

    @property
    def block_scale_max(self) -> float:
        """The normalization of two-level block scales: 448 (E4M3's largest), or 256 with ``four_over_six``."""
        return FOUR_OVER_SIX_SCALE_MAX if (self.block_sizes or {}).get("four_over_six") else E4M3_MAX

    @property
    def per_token(self) -> bool:
        """``block_sizes: {-1: None}``: one amax per slice of the last dim (per token), always dynamic."""
        return self.block_sizes is not None and -1 in self.block_sizes and self.block_sizes[-1] is None

    @property
    def is_dynamic(self) -> bool:
        """The amax is taken from each tensor (``type: dynamic``, or per token); never calibrated."""
        return self.type == "dynamic" or self.per_token

    @property
    def int_kwargs(self) -> dict:
        """``narrow_range`` / ``unsigned`` for ``formats.fake_quant`` (int formats only; floats take neither)."""
        if not get_format(self.format).integer:
            return {}
        return {"narrow_range": self.narrow_range, "unsigned": self.unsigned}


class QuantCfgEntry(_Strict):
    """One rule of ``quant_cfg``: quantizers whose full name matches ``quantizer_name`` (fnmatch wildcard) and,
    if given, whose parent module is a ``parent_class``, get ``cfg`` and/or ``enable``.

    ``parent_class`` is a class-name wildcard matched against the parent's class and its bases (so a subclass
    matches, as Model Optimizer's ``isinstance`` does); Model Optimizer's registry names (``"nn.Linear"``,
    ``"megatron_RowParallelLinear"``) are accepted. An empty ``cfg`` with ``enable: false`` only disables; an empty
    ``cfg`` otherwise is an error (Model Optimizer's rule: it would silently quantize with defaults).
    """

    quantizer_name: str
    parent_class: str | None = None
    cfg: QuantizerAttributeConfig | None = None
    enable: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _cfg_shape(cls, values):
        if not isinstance(values, dict):
            return values
        cfg = values.get("cfg")
        if isinstance(cfg, list):
            if not cfg or all(isinstance(c, dict) and not c for c in cfg):
                cfg = {}
            else:
                raise ValueError(unsupported("cfg", cfg, "a list of attribute dicts is Model Optimizer's "
                                             "SequentialQuantizer (e.g. W4A8); one format per quantizer here"))
        if isinstance(cfg, dict) and not cfg:
            if values.get("enable") is False:
                return {**values, "cfg": None}
            raise ValueError(f"entry for {values.get('quantizer_name')!r}: 'cfg' is empty; give at least one "
                             "attribute, or drop 'cfg' and set 'enable'")
        return values

    @model_validator(mode="after")
    def _something(self):
        if self.cfg is None and self.enable is None:
            raise ValueError(f"entry for {self.quantizer_name!r} sets neither 'cfg' nor 'enable'")
        return self

    @property
    def configures(self) -> bool:
        """Whether the entry turns quantizers on or sets their format (an enable-only ``false`` entry only
        excludes): such an entry that matches nothing is a likely typo."""
        return self.cfg is not None or self.enable is True

    def matches(self, quantizer_name: str, parent_class_name: str | tuple[str, ...]) -> bool:
        """``parent_class_name``: the parent's class name, or the names of its class and bases (MRO)."""
        if not fnmatch.fnmatchcase(quantizer_name, self.quantizer_name):
            return False
        if self.parent_class is None:
            return True
        names = (parent_class_name,) if isinstance(parent_class_name, str) else parent_class_name
        pattern = _modelopt_parent_class(self.parent_class)
        return any(fnmatch.fnmatchcase(n, pattern) for n in names)


class ExpertsConfig(_Strict):
    """Amax layouts of expert quantizers (see quantization/expert_quantizer.py and docs/architecture.md)."""

    weight_amax: Literal["shared", "vectorized", "per_expert"] = "vectorized"
    input_amax: Literal["shared", "per_expert"] = "shared"


class BackwardConfig(_Strict):
    """Which operands the backward GEMMs see, and the straight-through estimator.

    ``dequantized``: the fake-quantized forward operands; ``high_precision``: the original operands;
    ``quantized``: the fake-quantized operands and a fake-quantized incoming gradient (``grad_num_bits``,
    per-tensor scale from the gradient's own amax).

    ``weight_operands`` (grouped expert GEMMs, outside a ``reuse_quantized_weights`` block): ``recompute``
    fake-quantizes the unchanged expert weights again in the backward (one more launch per GEMM, same bits) instead of
    keeping the forward's copy alive until then; ``keep`` keeps it (one extra copy of the expert weights at the step's
    peak, one launch fewer). Inside a reuse block the step's cached values serve both passes.
    """

    mode: Literal["dequantized", "high_precision", "quantized"] = "dequantized"
    ste: Literal["pass_through", "clipped"] = "pass_through"
    grad_num_bits: int | tuple[int, int] | str = "e5m2"
    weight_operands: Literal["recompute", "keep"] = "recompute"

    @field_validator("grad_num_bits", mode="before")
    @classmethod
    def _grad_bits(cls, v):
        if isinstance(v, list):
            v = tuple(v)
        fmt = format_from_num_bits(v)
        if get_format(fmt).element_dtype is None:  # gradients: a torch float8 dtype (E4M3 or E5M2)
            raise ValueError(f"grad_num_bits={v!r} ({fmt}): gradients can be fake-quantized to e4m3 or e5m2 only")
        return v

    @property
    def grad_format(self) -> str:
        """The format name (``e4m3`` or ``e5m2``) of ``grad_num_bits``."""
        return format_from_num_bits(self.grad_num_bits)


class MaxCalibConfig(_Strict):
    """Options of max calibration: Model Optimizer's ``{"method": "max", ...}`` algorithm dict.

    Attributes:
        method: ``"max"``.
        distributed_sync: max-reduce amaxes over the parallel groups after calibration (False: keep each rank's).
        sync_expert_weight_amax: one weight amax for all experts of a layer (every local expert and EP rank): the
            ``shared`` expert weight layout.
        skip_forward_without_activation_calib: skip ``forward_loop`` when no enabled activation quantizer needs
            calibration data (weights are calibrated from themselves).
        moe_calib_experts_ratio: route each calibration token to ``max(top_k, round(ratio * num_experts))``
            experts of every MoE layer (the model's outputs still come from its own top-k), so that seldom-picked
            experts calibrate too; in ``(0, 1]``, None: the model's routing.
        layerwise, shared_states: accepted at Model Optimizer's defaults only.
    """

    # Whether the algorithm chooses weight amaxes of its own (which weight_amax_update=dynamic would overwrite).
    sets_weight_amax: ClassVar[bool] = False

    method: Literal["max"] = "max"
    distributed_sync: bool | None = True
    sync_expert_weight_amax: bool = False
    skip_forward_without_activation_calib: bool = False
    moe_calib_experts_ratio: float | None = Field(None, gt=0.0, le=1.0)
    layerwise: dict | None = None
    shared_states: dict | None = None

    @model_validator(mode="after")
    def _defaults_only(self):
        if self.layerwise and (self.layerwise.get("enable") or self.layerwise.get("checkpoint_dir")):
            raise ValueError(unsupported("algorithm.layerwise", self.layerwise, "no layer-by-layer calibration"))
        if self.shared_states:
            raise ValueError(unsupported("algorithm.shared_states", self.shared_states, "no shared global amaxes"))
        return self


class MseCalibConfig(MaxCalibConfig):
    """Options of the weight MSE search (:mod:`.calib.mse`): Model Optimizer 0.47's ``{"method": "mse", ...}``,
    plus max calibration's options (the search starts from it).

    Attributes:
        step_size, start_multiplier, stop_multiplier: the grid of multipliers of the max amax,
            ``linspace(start, stop, ceil((stop - start) / step_size) + 1)``.
        fp8_scale_sweep: Model Optimizer's sweep of static NVFP4 block scales: each block takes the E4M3 block
            scale of least squared error of all 126; every other weight keeps its max calibration (the grid is
            then unused), as in Model Optimizer.
    """

    sets_weight_amax: ClassVar[bool] = True

    method: Literal["mse"] = "mse"
    step_size: float = Field(0.1, gt=0.0)
    start_multiplier: float = Field(0.25, gt=0.0)
    stop_multiplier: float = Field(4.0, gt=0.0)
    fp8_scale_sweep: bool = False

    @model_validator(mode="after")
    def _grid(self):
        if self.stop_multiplier < self.start_multiplier:
            raise ValueError(f"algorithm.stop_multiplier={self.stop_multiplier} is below start_multiplier="
                             f"{self.start_multiplier}; the search runs from start to stop")
        return self


class HistogramCalibConfig(MaxCalibConfig):
    """Options of activation calibration over histograms (:mod:`.calib.histogram`): Model Optimizer 0.47's
    ``HistogramCalibrator`` (``num_bins``) and its ``compute_amax(method, stride=, start_bin=, percentile=)``, plus
    max calibration's options (the histograms' common range is max calibration's amax).

    Attributes:
        histogram_method: ``"percentile"`` (the amax clips ``100 - percentile`` percent of the values) or ``"mse"``
            (the bin center of least squared quantization error); Model Optimizer's ``"entropy"`` is refused.
        num_bins: bins of each histogram over ``[0, amax]``.
        percentile: in ``[0, 100]`` (``percentile`` only).
        start_bin, stride: the candidate bin centers ``start_bin, start_bin + stride, ...`` (``mse`` only).
    """

    method: Literal["histogram"] = "histogram"
    histogram_method: Literal["percentile", "mse"] = "percentile"
    num_bins: int = Field(2048, ge=1)
    percentile: float = Field(99.99, ge=0.0, le=100.0)
    start_bin: int = Field(128, ge=0)
    stride: int = Field(1, ge=1)

    @field_validator("histogram_method", mode="before")
    @classmethod
    def _no_entropy(cls, v):
        if v == "entropy":
            raise ValueError(unsupported("algorithm.histogram_method", v, "percentile and mse"))
        return v

    @model_validator(mode="after")
    def _candidates(self):
        if self.histogram_method == "mse" and self.start_bin >= self.num_bins:
            raise ValueError(f"algorithm.start_bin={self.start_bin} leaves no candidate among num_bins="
                             f"{self.num_bins} bins; expected start_bin < num_bins")
        return self


# The options of each calibration method, by name; the calibrators themselves: calib/registry.py (same names).
CALIBRATION_OPTIONS: dict[str, type[MaxCalibConfig]] = {"max": MaxCalibConfig, "mse": MseCalibConfig,
                                                        "histogram": HistogramCalibConfig}


def normalize_algorithm(algorithm: Any) -> MaxCalibConfig | None:
    """``algorithm`` as Model Optimizer takes it (``"max"``, ``"mse"``, ``None``, ``{"method": "mse", ...}``, an
    options object) as the options of the registered calibrator it names (a :class:`MaxCalibConfig` or a subclass),
    or None for no calibration.

    Raises:
        ValueError: a method no calibrator is registered for (naming it and the registered ones) or an unknown
            option.
    """
    if algorithm is None or isinstance(algorithm, MaxCalibConfig):
        return algorithm
    if isinstance(algorithm, str):
        algorithm = {"method": algorithm}
    if not isinstance(algorithm, dict):
        raise ValueError(f"algorithm: expected one of {sorted(CALIBRATION_OPTIONS)}, None or a dict with "
                         f"'method', got {algorithm!r}")
    method = algorithm.get("method", "max")
    if method is None:
        return None
    if method not in CALIBRATION_OPTIONS:
        if method in UNSUPPORTED_ALGORITHMS:
            raise ValueError(unsupported("algorithm", method, f"calibration methods: "
                                                              f"{sorted(CALIBRATION_OPTIONS)} (QAT trains the rest)"))
        raise ValueError(f"algorithm: unknown calibration method {method!r}; expected one of "
                         f"{sorted(CALIBRATION_OPTIONS)} (or None)")
    options = CALIBRATION_OPTIONS[method]
    try:
        return options(**algorithm)
    except ValidationError as e:
        raise ValueError("; ".join(_option_problem(method, options, err) for err in e.errors())) from None


def _option_problem(method: str, options: type[MaxCalibConfig], err: dict) -> str:
    """One invalid option of calibration method ``method``, named as ``algorithm.<key>`` (with the allowed keys and a
    suggestion for an unknown one)."""
    key = ".".join(str(p) for p in err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        allowed = sorted(options.model_fields)
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"algorithm.{key}: unknown option of method {method!r}{hint}; allowed: {', '.join(allowed)}"
    message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"algorithm.{key}={err.get('input')!r}: {message}" if key else f"algorithm: {message}"


AUTOSWITCH_GEMMS = ("fprop", "dgrad", "wgrad")


class AutoswitchConfig(_Strict):
    """Precision autoswitch (docs/autoswitch.md): every ``every`` steps, each quantized GEMM (per expert) measures
    the quantization error of the operands it uses and runs in high precision for that step where any monitored
    operand crosses a threshold.

    Attributes:
        every: sample steps ``0, every, 2 * every, ...`` (the step of :func:`mtq.autoswitch_step`).
        underflow_pct: switch when more than this percentage of an operand's non-zero values quantize to zero.
        mse: switch when an operand's quantization MSE relative to its mean square exceeds this.
        gemms: which GEMMs may switch: ``fprop`` (input x weight), ``dgrad`` (gradient x weight), ``wgrad``
            (gradient x input).
        log_dir: directory of the per-rank JSON-lines logs (``autoswitch_rank<r>.jsonl``).
    """

    every: int = Field(ge=1)
    underflow_pct: float | None = Field(default=None, ge=0.0, le=100.0)
    mse: float | None = Field(default=None, ge=0.0)
    gemms: list[Literal["fprop", "dgrad", "wgrad"]] = Field(default_factory=lambda: list(AUTOSWITCH_GEMMS))
    log_dir: str = "autoswitch_logs"

    @model_validator(mode="after")
    def _thresholds(self):
        if self.underflow_pct is None and self.mse is None:
            raise ValueError("autoswitch: set underflow_pct, mse or both (with neither nothing could switch)")
        if not self.gemms or len(set(self.gemms)) != len(self.gemms):
            raise ValueError(f"autoswitch.gemms={self.gemms!r}: expected a non-empty list of distinct GEMMs from "
                             f"{list(AUTOSWITCH_GEMMS)}")
        return self


class SmoothExpertInputsConfig(_Strict):
    """The exact power-of-two SmoothQuant rescaling of the experts' fc2 inputs that :func:`mtq.quantize` applies
    before calibration (:mod:`.smooth_experts`, docs/calibration.md).

    Attributes:
        alpha: SmoothQuant's migration strength in [0, 1]: ``s_j = amax_x_j**alpha / amax_w_j**(1 - alpha)``, rounded
            to a power of two.
    """

    alpha: float = Field(0.5, ge=0.0, le=1.0)


# How weight amaxes follow the weights while training (docs/qad.md): "static" keeps the calibrated amax, "dynamic"
# recomputes it from the current weights at every re-quantization, "learned" trains it (LSQ-style gradient).
WEIGHT_AMAX_UPDATES = ("static", "dynamic", "learned")
DEFAULT_WEIGHT_AMAX_UPDATE = "dynamic"  # chosen by measurement: docs/qad.md
# How input (activation) amaxes follow training (docs/qad.md): "static" keeps the calibrated amax, "learned" trains it
# from the calibrated value (one per layer or one per expert, as experts.input_amax says).
INPUT_AMAX_UPDATES = ("static", "learned")


# Before ``gemm`` existed, ``kernel: te_fp8`` chose the real FP8 GEMMs (and the "auto" fake quant everywhere else).
LEGACY_TE_FP8_KERNEL = "te_fp8"
_legacy_kernel_warned = False


def _warn_legacy_kernel() -> None:
    global _legacy_kernel_warned
    if not _legacy_kernel_warned:
        _legacy_kernel_warned = True
        warnings.warn("config: 'kernel: te_fp8' is deprecated; write 'gemm: te_fp8' (kernel: auto | triton | torch "
                      "now says only how fake quant is computed)", FutureWarning,
                      stacklevel=2)


def _gemm_from_legacy_kernel(values: dict) -> dict:
    """``values`` with a legacy ``kernel: te_fp8`` written as ``gemm: te_fp8`` and ``kernel: auto`` (warned once). It
    wins over a ``gemm`` beside it: a dumped preset carries ``gemm: fake_quant``, and ``{**preset, "kernel":
    "te_fp8"}`` asked for te_fp8."""
    values = dict(values)
    if values.get("kernel") != LEGACY_TE_FP8_KERNEL:
        return values
    _warn_legacy_kernel()
    return {**values, "kernel": "auto", "gemm": "te_fp8"}


def legacy_kernel(kernel: str, gemm: str) -> str:
    """The one ``kernel`` value that versions before ``gemm`` existed read: ``te_fp8`` for real FP8 GEMMs, else the
    fake-quant kernel (saved quantization states carry it, so those versions still load them)."""
    return LEGACY_TE_FP8_KERNEL if gemm == "te_fp8" else kernel


class QuantizeConfig(_Strict):
    """The whole config given to :func:`mtq.quantize`.

    ``quant_cfg`` and ``algorithm`` take every shape Model Optimizer 0.47 takes (its entry list, the legacy
    ``{pattern: attributes}`` dict, ``"max"`` or ``{"method": "max", ...}``); the algorithm is kept as
    ``algorithm`` (the method) plus its options in ``max_calib``. ``strict``: a ``quant_cfg`` entry that configures
    quantizers but matches none is an error (otherwise a rank-0 warning naming the closest quantizer names).
    """

    quant_cfg: list[QuantCfgEntry] = Field(default_factory=list)
    algorithm: str | None = "max"
    max_calib: SerializeAsAny[MaxCalibConfig] = Field(default_factory=MaxCalibConfig)  # the method's options
    effective_bits: float | None = None
    strict: bool = False
    # How expert fake quant is computed: "auto" = the one-launch Triton kernels on CUDA, the torch reference
    # elsewhere; "triton" = the kernels wherever Triton runs (CPU only under TRITON_INTERPRET=1); "torch" = the
    # reference.
    kernel: Literal["auto", "triton", "torch"] = "auto"
    # Whether forward GEMMs run on fake-quantized operands ("fake_quant") or, in calibrated FP8 Transformer Engine
    # grouped linears, as real FP8 GEMMs with the calibrated scales ("te_fp8": modelopt_moe.plugins.te_fp8; every
    # other module fake-quantizes).
    gemm: Literal["fake_quant", "te_fp8"] = "fake_quant"
    experts: ExpertsConfig = Field(default_factory=ExpertsConfig)
    backward: BackwardConfig = Field(default_factory=BackwardConfig)
    # A property of the training run, not of one quantizer: it applies to every enabled weight quantizer (activation
    # amaxes stay calibrated), and it stays out of the per-quantizer attributes, which mirror Model Optimizer's.
    weight_amax_update: Literal["static", "dynamic", "learned"] = DEFAULT_WEIGHT_AMAX_UPDATE
    # The same for the GEMMs' input quantizers (``input_quantizer``; output and KV-cache quantizers stay calibrated).
    input_amax_update: Literal["static", "learned"] = "static"
    autoswitch: AutoswitchConfig | None = None
    # Off by default: rescale the experts' fc2 input channels (exactly, by powers of two) before calibration.
    smooth_expert_inputs: SmoothExpertInputsConfig | None = None

    @model_validator(mode="after")
    def _combinations(self):
        if self.weight_amax_update == "learned" and self.experts.weight_amax == "shared":
            raise ValueError("weight_amax_update=learned with experts.weight_amax=shared: a shared amax is the max "
                             "over experts, a learned one is each expert's own; use weight_amax vectorized or "
                             "per_expert")
        if self.weight_amax_update == "learned" and self.backward.mode == "high_precision":
            raise ValueError("weight_amax_update=learned with backward.mode=high_precision: that backward runs through "
                             "the unquantized weights, so a learned amax would get no gradient; use backward.mode "
                             "dequantized or quantized")
        if self.input_amax_update == "learned" and self.backward.mode == "high_precision":
            raise ValueError("input_amax_update=learned with backward.mode=high_precision: that backward runs through "
                             "the unquantized inputs, so a learned input amax would get no gradient; use backward.mode "
                             "dequantized or quantized")
        if self.input_amax_update == "learned" and self.gemm == "te_fp8":
            raise ValueError("input_amax_update=learned with gemm=te_fp8: the real FP8 GEMMs take the input scale as a "
                             "constant, so a learned input amax would get no gradient; use gemm fake_quant")
        if self.algorithm is not None and self.max_calib.sets_weight_amax and self.weight_amax_update == "dynamic":
            raise ValueError(f"algorithm={self.algorithm!r} chooses the weight amaxes, but weight_amax_update=dynamic "
                             "recomputes them from the weights at every re-quantization; set weight_amax_update to "
                             "static or learned")
        static_blocks = [e.quantizer_name for e in self.quant_cfg if e.cfg is not None and e.cfg.enable
                         and e.cfg.static_block_scales]
        if static_blocks and self.weight_amax_update == "dynamic":
            raise ValueError(f"quant_cfg {static_blocks[0]!r}: static NVFP4 block scales (block_sizes.type: static) "
                             "with weight_amax_update=dynamic, which recomputes the second-level amax from the "
                             "weights under block scales calibrated for the old one; set weight_amax_update to "
                             "static or learned")
        hp = sorted({"dgrad", "wgrad"} & set(self.autoswitch.gemms)) if self.autoswitch else []
        if hp and self.backward.mode == "high_precision":
            raise ValueError(f"autoswitch.gemms includes {hp} but backward.mode=high_precision already runs dgrad "
                             "and wgrad in high precision; monitor [fprop] only")
        return self

    @model_validator(mode="before")
    @classmethod
    def _modelopt_shapes(cls, values):
        if not isinstance(values, dict):
            return values
        values = _gemm_from_legacy_kernel(values)
        if "quant_cfg" in values:
            values["quant_cfg"] = normalize_quant_cfg(values["quant_cfg"])
        algo = values.get("algorithm", "max")
        given = values.get("max_calib")
        if isinstance(algo, dict | MaxCalibConfig) or (isinstance(algo, str) and algo != "max") or (
                isinstance(given, dict) and given.get("method", "max") != "max"):
            calib = normalize_algorithm(algo)
            values["algorithm"] = None if calib is None else calib.method
            if calib is not None:
                given = given.model_dump(exclude_unset=True) if isinstance(given, MaxCalibConfig) else (given or {})
                # Options written in the algorithm dict win over a max_calib (a dumped preset carries defaults);
                # a max_calib dumped from another method's options keeps only the options the chosen one takes.
                if given.get("method", "max") != calib.method:
                    given = {k: v for k, v in given.items() if k in MaxCalibConfig.model_fields and k != "method"}
                values["max_calib"] = type(calib)(**{**given, **calib.model_dump(exclude_unset=True),
                                                     "method": calib.method})
        return values

    @model_validator(mode="after")
    def _expert_weight_sync(self):
        # Model Optimizer's sync_expert_weight_amax is this package's `shared` expert weight layout.
        if self.max_calib.sync_expert_weight_amax:
            if "weight_amax" in self.experts.model_fields_set and self.experts.weight_amax != "shared":
                raise ValueError(f"algorithm.sync_expert_weight_amax=True shares one weight amax over the experts, "
                                 f"but experts.weight_amax={self.experts.weight_amax!r}; use 'shared' (or drop one)")
            self.experts.weight_amax = "shared"
        return self

    @field_validator("effective_bits")
    @classmethod
    def _effective_bits(cls, v):
        return _check_effective_bits(v)

    def __setattr__(self, name: str, value) -> None:
        if name == "kernel" and value == LEGACY_TE_FP8_KERNEL:  # ``cfg.kernel = "te_fp8"`` as before the split
            _warn_legacy_kernel()
            super().__setattr__("gemm", "te_fp8")
            value = "auto"
        super().__setattr__(name, value)

    def resolve(self, quantizer_name: str, parent_class_name: str | tuple[str, ...]) -> QuantizerAttributeConfig | None:
        """Applies the rules in order (later wins); returns the final attribute config, or None if no rule
        configured this quantizer."""
        result: QuantizerAttributeConfig | None = None
        for entry in self.quant_cfg:
            if not entry.matches(quantizer_name, parent_class_name):
                continue
            if entry.cfg is not None:
                result = entry.cfg.model_copy()
            if entry.enable is not None:
                result = (result or QuantizerAttributeConfig(enable=entry.enable)).model_copy(
                    update={"enable": entry.enable})
        return result
