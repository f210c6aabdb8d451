"""NVIDIA Model Optimizer's quantization state, read without Model Optimizer (plain data, ``torch.load``).

Model Optimizer 0.47 stores ``mto.modelopt_state(model)`` as ``{"modelopt_state_dict": [(mode, {"config": ...,
"metadata": ...}), ...], "modelopt_version": "0.47.0"}``: the ``"quantize"`` mode's config is the
``QuantizeConfig`` the model was quantized with (every attribute written out) and its metadata's
``"quantizer_state"`` maps each quantizer's module name to its ``get_modelopt_state()`` (Megatron checkpoints keep
that per module in ``_extra_state`` instead, see ``modelopt_moe.plugins.megatron.modelopt_checkpoint``);
``"max_calibrate"`` records the calibration options. ``mto.save`` files hold ``{"modelopt_state": ...,
"model_state_dict": ...}``.

:func:`restore_model_optimizer_state` re-creates that quantization in a model of this package: the model is
converted with the saved rules, then every quantizer takes its saved settings (format, axis, blocks, range,
enablement, STE). Quantizers of Model Optimizer's per-expert modules (``local_experts.{i}.linear_fc1.*_quantizer``,
``weight_quantizer.{i}``) map onto this package's one expert quantizer per GEMM.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..quantization.config import ConfigError, ExpertsConfig, QuantizeConfig, to_config
from ..quantization.conversion import convert, is_quantized, named_quantizers, unwrap_model
from ..quantization.modelopt_compat import COMPAT_DOC, parse_modelopt_quantizer_state
from ..quantization.rollback import unchanged_on_error
from ..quantization.utils import warn_once
from .errors import CheckpointMismatchError
from .expert_quantizers import warn_if_down_proj_input_calibrated_otherwise
from .files import read_torch_file

__all__ = [
    "load_plain",
    "is_model_optimizer_state",
    "is_model_optimizer_checkpoint",
    "model_optimizer_config",
    "model_optimizer_expert_layouts",
    "our_quantizer_name",
    "restore_model_optimizer_state",
]

# Modes Model Optimizer records that leave nothing to restore beyond the "quantize" mode's state.
_PASSIVE_MODES = ("max_calibrate",)
_LOCAL_EXPERT = re.compile(
    r"^(?P<head>.*)\.local_experts\.(?P<i>\d+)\.(?P<gemm>linear_fc[12])\.(?P<kind>\w+_quantizer)$")
_GROUPED_EXPERT = re.compile(r"^(?P<head>.*\.(?P<kind>weight_quantizer))\.(?P<i>\d+)$")


def load_plain(path) -> Any:
    """``torch.load(path, weights_only=True)`` that also admits ``slice`` objects: Model Optimizer's quantizer states
    keep one (``_slices``, the padding cut of static blocks). Nothing else is unpickled.

    Raises:
        CorruptCheckpointError: the file is truncated or damaged (names it).
        CheckpointMismatchError: it holds another Python object (names its class).
    """
    return read_torch_file(path, allowed_globals=(slice,))


def is_model_optimizer_state(obj: Any) -> bool:
    """Whether ``obj`` is what Model Optimizer's ``mto.modelopt_state(model)`` returns."""
    return isinstance(obj, dict) and isinstance(obj.get("modelopt_state_dict"), list | tuple)


def is_model_optimizer_checkpoint(obj: Any) -> bool:
    """Whether ``obj`` is what Model Optimizer's ``mto.save`` writes."""
    return isinstance(obj, dict) and is_model_optimizer_state(obj.get("modelopt_state")) and \
        "model_state_dict" in obj


def model_optimizer_config(state: dict, source: str = "<modelopt_state>") -> tuple[QuantizeConfig, dict]:
    """The config a Model Optimizer state was quantized with, and its per-quantizer states (empty in Megatron
    checkpoints).

    Raises:
        CheckpointMismatchError: not a Model Optimizer state, not quantized, a mode other than quantization (e.g.
            sparsity, distillation), or a config this package cannot take (the message names the key and points to
            the table of differences).
    """
    if not is_model_optimizer_state(state):
        raise CheckpointMismatchError(f"{source}: not a Model Optimizer state (expected a dict with "
                                      f"'modelopt_state_dict'), found {type(state).__name__}")
    config, quantizer_state = None, {}
    for i, item in enumerate(state["modelopt_state_dict"]):
        mode, body = (item[0], item[1]) if isinstance(item, list | tuple) and len(item) == 2 else (None, None)
        if not isinstance(body, dict):
            raise CheckpointMismatchError(f"{source}: modelopt_state_dict[{i}] is not a (mode, state) pair")
        if mode == "quantize":
            config = body.get("config") or {}
            quantizer_state = (body.get("metadata") or {}).get("quantizer_state") or {}
        elif mode not in _PASSIVE_MODES:
            raise CheckpointMismatchError(
                f"{source}: Model Optimizer mode {mode!r} is not supported by modelopt_moe (quantization only); see "
                f"{COMPAT_DOC}#differences-from-model-optimizer")
    if config is None:
        raise CheckpointMismatchError(f"{source}: the Model Optimizer state has no 'quantize' mode (modes: "
                                      f"{[m[0] for m in state['modelopt_state_dict']]})")
    keys = {k: config[k] for k in ("quant_cfg", "algorithm", "effective_bits") if k in config}
    try:
        cfg = to_config(keys, source=f"{source} (Model Optimizer {state.get('modelopt_version', '?')} config)")
    except ConfigError as e:
        raise CheckpointMismatchError(str(e)) from None
    return cfg, quantizer_state


def model_optimizer_expert_layouts(cfg: QuantizeConfig) -> ExpertsConfig:
    """The expert amax layouts that hold what Model Optimizer calibrates: one weight amax per expert (its
    ``weight_quantizer.{i}`` / per-expert linears), or one for all with ``sync_expert_weight_amax``; one input amax
    for all experts (Model Optimizer syncs input amaxes over the local experts and the EP ranks)."""
    return ExpertsConfig(weight_amax="shared" if cfg.max_calib.sync_expert_weight_amax else "per_expert",
                         input_amax="shared")


def our_quantizer_name(name: str) -> tuple[str, int | None]:
    """A Model Optimizer quantizer name as ``(this package's quantizer name, expert index or None)``: a
    ``SequentialMLP`` expert's ``...local_experts.{i}.linear_fc1.input_quantizer`` is expert ``i`` of
    ``...linear_fc1.input_quantizer``; a grouped linear's ``...weight_quantizer.{i}`` is expert ``i`` of
    ``...weight_quantizer``; every other name is the same here."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return f"{m['head']}.{m['gemm']}.{m['kind']}", int(m["i"])
    m = _GROUPED_EXPERT.match(name)
    if m:
        return m["head"], int(m["i"])
    return name, None


def apply_quantizer_states(model: nn.Module, states: dict[str, dict], source: str,
                           strict: bool = True) -> list[str]:
    """Gives each quantizer of ``model`` its Model Optimizer state (settings only; amaxes load with the weights).
    The experts of one GEMM must agree (one expert quantizer holds them here). Returns the Model Optimizer
    quantizer names that have no counterpart here (e.g. normalization-layer input quantizers).

    Raises:
        CheckpointMismatchError: a state this package cannot take, experts of one GEMM with different settings, or
            (``strict``) one of this model's quantizers that the state does not name.
    """
    ours = {name: q for name, q, _ in named_quantizers(model)}
    applied: dict[str, tuple] = {}
    unknown = []
    for name, state in states.items():
        target, expert = our_quantizer_name(name)
        q = ours.get(target)
        if q is None:
            unknown.append(name)
            continue
        try:
            parsed = parse_modelopt_quantizer_state(state)
        except ValueError as e:
            raise CheckpointMismatchError(f"{source}: quantizer {name}: {e}") from None
        cfg, flags, _ = parsed
        settings = (cfg.model_dump(), flags["enabled"])
        if target in applied and applied[target][0] != settings:
            raise CheckpointMismatchError(
                f"{source}: quantizer {name} (expert {expert}) differs from another expert of {target}: every expert "
                f"of a GEMM shares one format here; see {COMPAT_DOC}#differences-from-model-optimizer")
        if target not in applied:
            try:
                q.set_from_modelopt_state(state, properties_only=True)
            except ValueError as e:
                raise CheckpointMismatchError(f"{source}: quantizer {name}: {e}") from None
            applied[target] = (settings, expert)
    missing = sorted(set(ours) - set(applied))
    if strict and missing:
        raise CheckpointMismatchError(f"{source}: {len(missing)} quantizers of the model are not in the Model "
                                      f"Optimizer state: {missing[:4]}")
    return sorted(unknown)


def restore_model_optimizer_state(model: nn.Module, state: dict, experts: ExpertsConfig | dict | None = None, *,
                                  source: str = "<modelopt_state>") -> nn.Module:
    """Re-creates a Model Optimizer quantization (``mto.modelopt_state(model)`` of Model Optimizer 0.47) in an
    unquantized ``model`` of the same architecture; load the weights and amaxes after (``load_state_dict``).

    Args:
        model: the freshly built model.
        state: Model Optimizer's state dict.
        experts: expert amax layouts (default: :func:`model_optimizer_expert_layouts`).
        source: where ``state`` came from (for messages).

    Returns:
        ``model``.

    Raises:
        CheckpointMismatchError: the state cannot be taken (see :func:`model_optimizer_config` and
            :func:`apply_quantizer_states`), or ``model`` is already quantized.
    """
    model = unwrap_model(model)
    cfg, quantizer_state = model_optimizer_config(state, source)
    if any(is_quantized(m) for m in model.modules()):
        raise CheckpointMismatchError(f"{source}: restore into an unquantized model (this one is already quantized)")
    layouts = experts if experts is not None else model_optimizer_expert_layouts(cfg)
    layouts = layouts if isinstance(layouts, ExpertsConfig) else ExpertsConfig(**layouts)
    with unchanged_on_error(model, "restore_model_optimizer_state"):
        convert(model, cfg.model_copy(update={"experts": layouts}))
        unknown = apply_quantizer_states(model, quantizer_state, source) if quantizer_state else []
    if unknown:
        warn_once(f"{source}: Model Optimizer quantizers with no counterpart in this model are ignored: "
                  f"{unknown[:6]}{' ...' if len(unknown) > 6 else ''} (see {COMPAT_DOC})")
    warn_if_down_proj_input_calibrated_otherwise(model, None, source)  # Model Optimizer calibrates prob * act
    return model
