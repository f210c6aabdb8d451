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
    kernel: auto                     # auto | triton | torch (expert fake quant backend)
    weight_amax_update: dynamic      # static | dynamic | learned (docs/qad.md)
    autoswitch: {every: 100, underflow_pct: 5.0, mse: 0.05, gemms: [fprop, dgrad, wgrad]}   # optional

``$import: other.yaml`` at the top of a file merges that file first (its ``quant_cfg`` entries come before this
file's); ``- $import: other.yaml`` inside ``quant_cfg`` splices the other file's entries at that place.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..numerics import NVFP4_BLOCK_SIZE, format_from_num_bits

__all__ = [
    "ConfigError",
    "QuantizerAttributeConfig",
    "QuantCfgEntry",
    "ExpertsConfig",
    "BackwardConfig",
    "AutoswitchConfig",
    "AUTOSWITCH_GEMMS",
    "WEIGHT_AMAX_UPDATES",
    "DEFAULT_WEIGHT_AMAX_UPDATE",
    "QuantizeConfig",
    "load_config",
    "to_config",
    "preset_path",
    "PRESET_FILES",
]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file (if any), the key and the value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


class QuantizerAttributeConfig(_Strict):
    """How one quantizer quantizes (names follow NVIDIA Model Optimizer so users switch by import).

    Attributes:
        num_bits: ``(4, 3)``/``"e4m3"``, ``(5, 2)``/``"e5m2"``, ``(2, 1)``/``"e2m1"`` (NVFP4), ``8``, ``4``.
        axis: ``None`` for one amax per tensor; an int for one amax per slice along that axis (per channel).
        block_sizes: ``{-1: 16, "type": "dynamic", "scale_bits": (4, 3)}`` for NVFP4, ``{-1: 128}`` for INT4
            blocks. Block scales are always computed from the data (dynamic).
        enable: whether the quantizer is on.
    """

    num_bits: int | tuple[int, int] | str = 8
    axis: int | None = None
    block_sizes: dict[int | str, Any] | None = None
    enable: bool = True

    @field_validator("num_bits", mode="before")
    @classmethod
    def _num_bits(cls, v):
        if isinstance(v, list):
            v = tuple(v)
        format_from_num_bits(v)  # raises ValueError naming the allowed values
        return v

    @model_validator(mode="after")
    def _blocks(self):
        fmt = self.format
        bs = self.block_sizes
        if bs is not None:
            unknown = set(bs) - {-1, "type", "scale_bits"}
            if unknown:
                raise ValueError(f"block_sizes: unsupported keys {sorted(map(str, unknown))}; "
                                 "expected -1 (last-dim block size), 'type', 'scale_bits'")
            if bs.get("type", "dynamic") != "dynamic":
                raise ValueError(f"block_sizes.type={bs.get('type')!r}: only 'dynamic' block scales are supported")
            if -1 not in bs or not isinstance(bs[-1], int) or bs[-1] <= 0:
                raise ValueError(f"block_sizes[-1] must be a positive int, got {bs.get(-1)!r}")
            if self.axis is not None:
                raise ValueError(f"axis={self.axis} cannot be combined with block_sizes")
        if fmt == "nvfp4":
            if bs is None or bs.get(-1) != NVFP4_BLOCK_SIZE:
                raise ValueError(f"num_bits e2m1 (NVFP4) needs block_sizes {{-1: {NVFP4_BLOCK_SIZE}}}, got {bs!r}")
            scale_bits = bs.get("scale_bits", (4, 3))
            if format_from_num_bits(scale_bits) != "e4m3":
                raise ValueError(f"NVFP4 block scales are E4M3: scale_bits must be (4, 3), got {scale_bits!r}")
            if self.axis is not None:
                raise ValueError(f"NVFP4 uses a per-tensor global amax: axis must be null, got {self.axis}")
        elif fmt in ("e4m3", "e5m2") and bs is not None:
            raise ValueError(f"format {fmt} has no block mode; remove block_sizes {bs!r}")
        return self

    @property
    def format(self) -> str:
        """The format name in :data:`formats.FORMATS`."""
        return format_from_num_bits(self.num_bits)

    @property
    def block_size(self) -> int | None:
        """Last-dim block size for int block quantization (None otherwise; NVFP4's 16 is implied)."""
        if self.block_sizes is None or self.format == "nvfp4":
            return None
        return int(self.block_sizes[-1])


class QuantCfgEntry(_Strict):
    """One rule of ``quant_cfg``: quantizers whose full name matches ``quantizer_name`` (fnmatch wildcard) and,
    if given, whose parent module's class name matches ``parent_class``, get ``cfg`` and/or ``enable``."""

    quantizer_name: str
    parent_class: str | None = None
    cfg: QuantizerAttributeConfig | None = None
    enable: bool | None = None

    @model_validator(mode="after")
    def _something(self):
        if self.cfg is None and self.enable is None:
            raise ValueError(f"entry for {self.quantizer_name!r} sets neither 'cfg' nor 'enable'")
        return self

    def matches(self, quantizer_name: str, parent_class_name: str) -> bool:
        if not fnmatch.fnmatchcase(quantizer_name, self.quantizer_name):
            return False
        return self.parent_class is None or fnmatch.fnmatchcase(parent_class_name, self.parent_class)


class ExpertsConfig(_Strict):
    """Amax layouts of expert quantizers (see quantization/expert_quantizer.py and docs/architecture.md)."""

    weight_amax: Literal["shared", "vectorized", "per_expert"] = "vectorized"
    input_amax: Literal["shared", "per_expert"] = "shared"


class BackwardConfig(_Strict):
    """Which operands the backward GEMMs see, and the straight-through estimator.

    ``dequantized``: the fake-quantized forward operands; ``high_precision``: the original operands;
    ``quantized``: the fake-quantized operands and a fake-quantized incoming gradient (``grad_num_bits``,
    per-tensor scale from the gradient's own amax).
    """

    mode: Literal["dequantized", "high_precision", "quantized"] = "dequantized"
    ste: Literal["pass_through", "clipped"] = "pass_through"
    grad_num_bits: int | tuple[int, int] | str = "e5m2"

    @field_validator("grad_num_bits", mode="before")
    @classmethod
    def _grad_bits(cls, v):
        if isinstance(v, list):
            v = tuple(v)
        fmt = format_from_num_bits(v)
        if fmt not in ("e4m3", "e5m2"):
            raise ValueError(f"grad_num_bits={v!r} ({fmt}): gradients can be fake-quantized to e4m3 or e5m2 only")
        return v

    @property
    def grad_format(self) -> str:
        return format_from_num_bits(self.grad_num_bits)


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


# How weight amaxes follow the weights while training (docs/qad.md): "static" keeps the calibrated amax, "dynamic"
# recomputes it from the current weights at every re-quantization, "learned" trains it (LSQ-style gradient).
WEIGHT_AMAX_UPDATES = ("static", "dynamic", "learned")
DEFAULT_WEIGHT_AMAX_UPDATE = "dynamic"  # chosen by measurement: docs/qad.md


class QuantizeConfig(_Strict):
    """The whole config given to :func:`mtq.quantize`."""

    quant_cfg: list[QuantCfgEntry] = Field(default_factory=list)
    algorithm: Literal["max"] | None = "max"
    # Expert fake quant: "auto" = the one-launch Triton kernels on CUDA, the torch reference elsewhere;
    # "triton" = the kernels wherever Triton runs (CPU only under TRITON_INTERPRET=1); "torch" = the reference.
    kernel: Literal["auto", "triton", "torch"] = "auto"
    experts: ExpertsConfig = Field(default_factory=ExpertsConfig)
    backward: BackwardConfig = Field(default_factory=BackwardConfig)
    # A property of the training run, not of one quantizer: it applies to every enabled weight quantizer (activation
    # amaxes stay calibrated), and it stays out of the per-quantizer attributes, which mirror Model Optimizer's.
    weight_amax_update: Literal["static", "dynamic", "learned"] = DEFAULT_WEIGHT_AMAX_UPDATE
    autoswitch: AutoswitchConfig | None = None

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
        hp = sorted({"dgrad", "wgrad"} & set(self.autoswitch.gemms)) if self.autoswitch else []
        if hp and self.backward.mode == "high_precision":
            raise ValueError(f"autoswitch.gemms includes {hp} but backward.mode=high_precision already runs dgrad "
                             "and wgrad in high precision; monitor [fprop] only")
        return self

    def resolve(self, quantizer_name: str, parent_class_name: str) -> QuantizerAttributeConfig | None:
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


# ---------------------------------------------------------------------------------------------------------------
# YAML loading


PRESET_FILES = {
    "FP8_DEFAULT_CFG": "fp8_default.yaml",
    "NVFP4_DEFAULT_CFG": "nvfp4_default.yaml",
    "INT8_DEFAULT_CFG": "int8_default.yaml",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": "int4_blockwise_weight_only.yaml",
}


def preset_path(name: str) -> Path:
    """Path of a YAML file shipped in ``configs/`` (package data ``modelopt_moe.configs``)."""
    return Path(str(resources.files("modelopt_moe.configs").joinpath(name)))


def _read_yaml(path: Path, imported_from: Path | None) -> Any:
    if not path.is_file():
        where = f" (imported from {imported_from})" if imported_from else ""
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def _import_target(importer: Path, name: str) -> Path:
    """``name`` beside the importing file, or else the shipped preset of that file name."""
    beside = importer.parent / name
    if not beside.is_file() and Path(name).name == name and preset_path(name).is_file():
        return preset_path(name)
    return beside


def _resolve_imports(path: Path, stack: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError(f"{stack[-1]}: key '$import': import cycle {chain}")
    data = _read_yaml(path, stack[-1] if stack else None)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base: dict = {}
    imports = data.pop("$import") if "$import" in data else []
    if not isinstance(imports, str | list):
        raise ConfigError(f"{path}: key '$import': expected a file name or a list of them, "
                          f"got {json.dumps(imports, default=str)}")
    for target in [imports] if isinstance(imports, str) else imports:
        if not isinstance(target, str):
            raise ConfigError(f"{path}: key '$import': expected a file name or a list of them, got {target!r}")
        base = _merge(base, _resolve_imports(_import_target(path, target), (*stack, path)))
    entries = data.get("quant_cfg")
    if entries is not None:
        if not isinstance(entries, list):
            raise ConfigError(f"{path}: key 'quant_cfg': expected a list of entries, got {type(entries).__name__}")
        spliced = []
        for i, entry in enumerate(entries):
            if isinstance(entry, dict) and "$import" in entry:
                if len(entry) != 1 or not isinstance(entry["$import"], str):
                    raise ConfigError(f"{path}: key 'quant_cfg.{i}.$import': expected a lone file name, got {entry!r}")
                sub = _resolve_imports(_import_target(path, entry["$import"]), (*stack, path))
                spliced.extend(sub.get("quant_cfg", []))
            else:
                spliced.append(entry)
        data["quant_cfg"] = spliced
    return _merge(base, data)


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge, ``quant_cfg`` lists concatenate (later wins), anything else is replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k == "quant_cfg" and isinstance(out.get(k), list) and isinstance(v, list):
            out[k] = out[k] + v
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _format_validation_error(err: ValidationError, source: str, data: Any) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            key = str(e["loc"][-1])
            allowed = _allowed_keys(e["loc"][:-1])
            hint = difflib.get_close_matches(key, allowed, n=1)
            msg = f"unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            msg += f"; allowed keys: {', '.join(allowed)}"
        else:
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"{source}: key '{loc}': {msg}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names of the model found at ``loc`` inside :class:`QuantizeConfig` (for error hints)."""
    model: type[BaseModel] = QuantizeConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            break
        nxt = {"quant_cfg": QuantCfgEntry, "cfg": QuantizerAttributeConfig, "experts": ExpertsConfig,
               "backward": BackwardConfig, "autoswitch": AutoswitchConfig}.get(str(part))
        if nxt is None:
            break
        model = nxt
    return sorted(model.model_fields)


def to_config(config: QuantizeConfig | dict, source: str = "<dict config>") -> QuantizeConfig:
    """Validates a dict (or passes a :class:`QuantizeConfig` through).

    Raises:
        ConfigError: naming ``source``, the key path and the bad value.
    """
    if isinstance(config, QuantizeConfig):
        return config
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a mapping or QuantizeConfig, got {type(config).__name__}")
    try:
        return QuantizeConfig.model_validate(config)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source, config)) from None


def load_config(path: str | Path) -> QuantizeConfig:
    """Loads and validates a YAML config (resolving ``$import``); a bare name also finds the shipped presets.

    Raises:
        ConfigError: missing file, bad YAML, bad ``$import``, unknown key or bad value, naming the file and key.
    """
    p = Path(path)
    if not p.is_file() and not p.is_absolute() and preset_path(p.name).is_file() and len(p.parts) <= 2:
        p = preset_path(p.name)
    data = _resolve_imports(p)
    return to_config(data, source=str(p))
