"""Quantization state as plain data, and single-file save/restore for plain PyTorch models.

The state names every quantizer by its module path and records each quantizer's settings, the expert layouts and
each expert quantizer's global expert count; no tensors. Amaxes travel in the model's state dict (plain
:func:`save`) or sharded state dict (distributed checkpoints). In :func:`save` files every expert amax is stored as
its ``[N, ...]`` tensor under ``<quantizer>._amax``, whatever its layout, so a model saved with one expert amax
layout restores into another.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..quantization.config import BackwardConfig, ExpertsConfig, QuantizeConfig, QuantizerAttributeConfig
from ..quantization.config_schema import LEGACY_TE_FP8_KERNEL, legacy_kernel
from ..quantization.conversion import convert, is_quantized, named_quantizers, rule_name, unwrap_model
from ..quantization.nn.row_scale import DOWN_PROJ_INPUT
from ..quantization.rollback import unchanged_on_error
from ..quantization.weight_amax import set_weight_amax_update, update_weight_amax
from .errors import CheckpointMismatchError
from .expert_quantizers import (
    ExpertQuantizerEntry,
    iter_expert_quantizers,
    warn_if_down_proj_input_calibrated_otherwise,
)
from .files import atomic_torch_save
from .modelopt_format import (
    is_model_optimizer_checkpoint,
    is_model_optimizer_state,
    load_plain,
    restore_model_optimizer_state,
)

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "ExpertQuantizerEntry",
    "iter_expert_quantizers",
    "modelopt_state",
    "restore_modelopt_state",
    "restore_from_modelopt_state",
    "check_state_header",
    "warn_if_down_proj_input_calibrated_otherwise",
    "save",
    "restore",
]

STATE_FORMAT = "modelopt_moe.quantization_state"
STATE_VERSION = 3


def modelopt_state(model: nn.Module, calibration_tokens: dict | None = None) -> dict:
    """Everything needed to re-create ``model``'s quantization in a freshly built model (plain data, no tensors).

    ``calibration_tokens``: the calibration tokens of every expert, ``{input quantizer name: {global expert:
    tokens}}`` (:func:`~modelopt_moe.quantization.calib.tokens.expert_token_counts`, a collective, gathered by the
    caller), kept under ``"calibration_tokens"`` and given back to each expert, at any layout, by the restore.

    Returns:
        ``{"format", "version", "backward", "kernel" (as versions before ``gemm`` read it), "fake_quant_kernel",
        "gemm", "experts" (the amax layouts), "quantized_modules",
        "quantizers" (name -> cfg / enabled / ste), "expert_quantizers" (name -> layout, global expert count),
        "expert_down_proj_input" (what the expert down projections' input quantizers see: the activation before the
        router probability multiplies it; states without this key were calibrated on ``prob * act``)}``.

    Raises:
        ValueError: ``model`` is not quantized.
    """
    model = unwrap_model(model)
    modules = [(name, m) for name, m in model.named_modules() if is_quantized(m)]
    if not modules:
        raise ValueError(f"modelopt_state: {type(model).__name__} is not quantized (call mtq.quantize first)")
    quantizers = {name: {"cfg": q.cfg.model_dump(), "enabled": q.is_enabled, "ste": q.ste,
                         "amax_update": q.amax_update}
                  for name, q, _ in named_quantizers(model)}
    experts, layouts = {}, {}
    for e in iter_expert_quantizers(model):
        experts[e.name] = {"layout": e.quantizer.layout, "num_global_experts": e.num_global_experts}
        if e.kind == "weight_quantizer":
            layouts.setdefault("weight_amax", e.quantizer.layout)
        elif e.kind == "input_quantizer":
            layouts.setdefault("input_amax", "shared" if e.quantizer.layout == "shared" else "per_expert")
    first = modules[0][1]
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "backward": first.quant_backward.model_dump(),
        # "kernel" is what versions before the fake-quant kernel / GEMM split read (te_fp8 stood for both);
        # "fake_quant_kernel" and "gemm" are the two settings.
        "kernel": legacy_kernel(first.quant_kernel, first.quant_gemm),
        "fake_quant_kernel": first.quant_kernel,
        "gemm": first.quant_gemm,
        "weight_amax_update": _weight_amax_update(model),
        "input_amax_update": _amax_update(model, "input_quantizer"),
        "autoswitch": first.quant_autoswitch.model_dump() if getattr(first, "quant_autoswitch", None) else None,
        "experts": ExpertsConfig(**layouts).model_dump(),
        "quantized_modules": [name for name, _ in modules],
        "quantizers": quantizers,
        "expert_quantizers": experts,
        "expert_down_proj_input": DOWN_PROJ_INPUT,
        **({"calibration_tokens": calibration_tokens} if calibration_tokens else {}),
    }


def _upgrade_cfg_v2(cfg: dict) -> dict:
    """A version-1/2 quantizer cfg with the meaning it was saved with: int formats were symmetric (``narrow_range``
    did not exist; version 3 defaults to Model Optimizer's two's-complement range) and int blocks without a
    ``type`` took their amax from the data (version 3: static, Model Optimizer's default)."""
    cfg = dict(cfg)
    cfg.setdefault("narrow_range", True)
    bs = cfg.get("block_sizes")
    if isinstance(bs, dict) and "type" not in bs:
        cfg["block_sizes"] = {**bs, "type": "dynamic"}
    return cfg


def _weight_amax_update(model: nn.Module) -> str:
    """The model's ``weight_amax_update`` (that of its enabled weight quantizers; ``static`` when none is)."""
    return _amax_update(model, "weight_quantizer")


def _amax_update(model: nn.Module, kind: str) -> str:
    """The amax update of ``model``'s enabled quantizers of ``kind`` (``static`` when none is, or they differ)."""
    modes = {q.amax_update for name, q, _ in named_quantizers(model) if q.is_enabled and
             rule_name(name).endswith(kind)}
    return modes.pop() if len(modes) == 1 else "static"


def _upgrade(state: dict) -> dict:
    """Explicit remaps of older states to this version's shape: version 1 (quantizers named by rule, per-expert
    children folded; expert entries under ``expert_slots``) and versions 1-2 (int range and block type, see
    :func:`_upgrade_cfg_v2`)."""
    version = state.get("version")
    if version == STATE_VERSION:
        return state
    if version == 1:
        state = {**state, "kernel": (state.get("config") or {}).get("kernel", "auto"),
                 "expert_quantizers": state.get("expert_slots", {})}
    quantizers = {name: {**entry, "cfg": _upgrade_cfg_v2(entry["cfg"])}
                  for name, entry in state.get("quantizers", {}).items()}
    return {**state, "version": STATE_VERSION, "quantizers": quantizers}


def check_state_header(state, source: str) -> dict:
    """Returns ``state`` (upgraded to this version) or raises CheckpointMismatchError unless it is a quantization
    state of a version this code reads."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointMismatchError(f"{source}: not a modelopt_moe quantization state: expected format "
                                      f"{STATE_FORMAT!r}, found {found!r}")
    if state.get("version") not in (1, 2, STATE_VERSION):
        raise CheckpointMismatchError(f"{source}: quantization state version: expected {STATE_VERSION} (or 1, 2), "
                                      f"found {state.get('version')!r}")
    return _upgrade(state)


def _restore_config(state: dict, experts) -> QuantizeConfig:
    """The config a fresh model is converted with: no rules (every quantizer then gets its saved settings)."""
    layouts = ExpertsConfig(**state["experts"])
    if experts is not None:
        layouts = experts if isinstance(experts, ExpertsConfig) else ExpertsConfig(**experts)
    # States saved before weight_amax_update existed were static; autoswitch is optional.
    return QuantizeConfig(backward=BackwardConfig(**state["backward"]), **_compute_settings(state),
                          experts=layouts, weight_amax_update=state.get("weight_amax_update", "static"),
                          input_amax_update=state.get("input_amax_update", "static"),
                          autoswitch=state.get("autoswitch"))


def _compute_settings(state: dict) -> dict:
    """``kernel`` and ``gemm`` of a saved state; a state saved before they were two settings has one ``kernel``
    (``te_fp8`` meant real FP8 GEMMs with the ``auto`` fake quant)."""
    if "fake_quant_kernel" in state:
        return {"kernel": state["fake_quant_kernel"], "gemm": state.get("gemm", "fake_quant")}
    kernel = state.get("kernel", "auto")
    return {"kernel": "auto", "gemm": "te_fp8"} if kernel == LEGACY_TE_FP8_KERNEL else {"kernel": kernel}


def restore_modelopt_state(model: nn.Module, state: dict, experts: ExpertsConfig | dict | None = None, *,
                           source: str = "<state>") -> nn.Module:
    """Re-creates the quantization of :func:`modelopt_state` in ``model`` (amaxes are loaded separately).

    An unquantized ``model`` (also one on the meta device) is converted and every quantizer gets its saved format,
    enablement and STE. An already quantized ``model`` is only checked against the state.

    Args:
        model: the freshly built model (same architecture, any parallel layout).
        state: :func:`modelopt_state` output.
        experts: restore into these expert amax layouts instead of the saved ones.
        source: where ``state`` came from (for messages).

    Returns:
        ``model``.

    Raises:
        CheckpointMismatchError: the state's format/version, its quantizers, a quantizer's number format or an
            expert count does not fit the model; the message names the quantizer, the expected and the found value.
    """
    state = check_state_header(state, source)
    model = unwrap_model(model)
    with unchanged_on_error(model, "restore_modelopt_state"):  # converted, then checked: all or nothing
        return _restore_quantizers(model, state, experts, source)


def _restore_quantizers(model: nn.Module, state: dict, experts, source: str) -> nn.Module:
    already = any(is_quantized(m) for m in model.modules())
    if not already:
        convert(model, _restore_config(state, experts))
    found = {name: q for name, q, _ in named_quantizers(model)}
    owners = {name: module for name, _, module in named_quantizers(model)}
    saved = state["quantizers"]
    missing, extra = sorted(set(saved) - set(found)), sorted(set(found) - set(saved))
    if missing or extra:
        raise CheckpointMismatchError(
            f"{source}: quantizers do not fit the model: {len(missing)} only in the checkpoint {missing[:4]}, "
            f"{len(extra)} only in the model {extra[:4]}")
    for name, entry in saved.items():
        ckpt_cfg = QuantizerAttributeConfig(**entry["cfg"])
        q = found[name]
        if already:
            if q.is_enabled and entry["enabled"] and (q.fmt, q.axis) != (ckpt_cfg.format, ckpt_cfg.axis):
                raise CheckpointMismatchError(
                    f"{name}: quantization format mismatch with {source}: the model expects format "
                    f"{q.fmt} axis={q.axis}, the checkpoint has format {ckpt_cfg.format} axis={ckpt_cfg.axis}")
            continue
        q.set_from_attribute_config(ckpt_cfg)
        q.set_switches(enabled=entry["enabled"])
        q.ste = entry["ste"]
        set_weight_amax_update(name, q, owners[name], entry.get("amax_update", "static"))
    for e in iter_expert_quantizers(model):
        entry = state["expert_quantizers"].get(e.name)
        if entry is None:
            raise CheckpointMismatchError(f"{e.name}: expert quantizer not in {source}")
        if entry["num_global_experts"] != e.num_global_experts:
            raise CheckpointMismatchError(
                f"{e.name}._amax: expected {e.num_global_experts} experts in checkpoint {source}, found "
                f"{entry['num_global_experts']}")
    _restore_calibration_tokens(model, state.get("calibration_tokens") or {})
    warn_if_down_proj_input_calibrated_otherwise(model, state.get("expert_down_proj_input"), source)
    return model


def _restore_calibration_tokens(model: nn.Module, tokens: dict) -> None:
    """Gives each expert input quantizer the calibration tokens of its experts, by global expert index."""
    for e in iter_expert_quantizers(model):
        counts = tokens.get(e.name)
        if e.kind != "input_quantizer" or not counts:
            continue
        grid, n = e.owner.expert_grid(), e.gemm.num_local
        e.quantizer.calibrated_rows = torch.tensor([int(counts[grid.global_index(n, i)]) for i in range(n)],
                                                   dtype=torch.int64)


def restore_from_modelopt_state(model: nn.Module, modelopt_state: dict, experts: ExpertsConfig | dict | None = None,
                                *, source: str = "<modelopt_state>") -> nn.Module:
    """Model Optimizer's ``mto.restore_from_modelopt_state``: re-creates the quantization recorded in
    ``modelopt_state`` in ``model`` and returns it; load the weights and amaxes after (``load_state_dict``).

    Takes this package's :func:`modelopt_state` and Model Optimizer 0.47's ``mto.modelopt_state(model)``
    (``{"modelopt_state_dict": [...], "modelopt_version": ...}``), e.g. a file its ``torch.save`` wrote.

    Raises:
        CheckpointMismatchError: the state does not fit the model or holds what this package cannot restore.
    """
    if is_model_optimizer_state(modelopt_state):
        return restore_model_optimizer_state(model, modelopt_state, experts, source=source)
    return restore_modelopt_state(model, modelopt_state, experts, source=source)


# ---------------------------------------------------------------------------------------------------------------
# Plain PyTorch: one file with the quantization state and a state dict whose expert amaxes are [N, ...] tensors.


def _layout_free_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    for e in iter_expert_quantizers(model):
        if e.quantizer.layout == "per_expert":
            for i in range(e.quantizer.num_experts):
                sd.pop(f"{e.name}.{i}._amax", None)
            if e.quantizer.amax is not None:
                sd[f"{e.name}._amax"] = e.quantizer.amax.detach()
    return sd


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Saves ``model``'s quantization state and weights in one file (written to a temporary file, then renamed, so
    an interrupted save never leaves a truncated ``path``).

    Args:
        model: a quantized model.
        path: the file to write.

    Raises:
        IsADirectoryError: ``path`` is a directory (nothing is written).
    """
    if Path(path).is_dir():
        raise IsADirectoryError(f"save: {path} is a directory; give the path of the file to write")
    update_weight_amax(model)  # a dynamic amax as the next forward computes it from the saved weights
    atomic_torch_save({"modelopt_moe_state": modelopt_state(model), "state_dict": _layout_free_state_dict(model)},
                      Path(path))


def restore(model: nn.Module, path: str | os.PathLike, experts: ExpertsConfig | dict | None = None,
            strict: bool = True) -> nn.Module:
    """Converts an unquantized ``model`` as saved by :func:`save` and loads the weights and amaxes.

    Also reads the file Model Optimizer 0.47's ``mto.save(model, path)`` writes (``{"modelopt_state",
    "model_state_dict"}``).

    Args:
        model: the freshly built model (a meta-device model is loaded by assignment).
        path: a file written by :func:`save` (or Model Optimizer's ``mto.save``).
        experts: restore into these expert amax layouts instead of the saved ones.
        strict: passed to ``load_state_dict``.

    Returns:
        ``model``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: the file is truncated or damaged (names it; nothing is changed).
        CheckpointMismatchError: the file does not fit the model (see :func:`restore_modelopt_state`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"restore: no checkpoint file {path}")
    payload = load_plain(path)
    if not is_model_optimizer_checkpoint(payload) and (
            not isinstance(payload, dict) or "modelopt_moe_state" not in payload):
        raise CheckpointMismatchError(f"{path}: not a modelopt_moe checkpoint (no 'modelopt_moe_state' entry)")
    with unchanged_on_error(model, "restore"):
        if is_model_optimizer_checkpoint(payload):
            restore_model_optimizer_state(model, payload["modelopt_state"], experts, source=str(path))
            _load_checked(model, payload["model_state_dict"], strict, path)
            return model
        restore_modelopt_state(model, payload["modelopt_moe_state"], experts, source=str(path))
        _load_checked(model, _expert_rows_as_views(model, dict(payload["state_dict"]), path), strict, path)
    return model


def _expert_rows_as_views(model: nn.Module, sd: dict, path: Path) -> dict:
    """``sd`` with each ``per_expert`` quantizer's ``[N]`` amax split into its views' own keys."""
    for e in iter_expert_quantizers(model):
        key = f"{e.name}._amax"
        if key not in sd:
            continue
        if sd[key].shape[0] != e.gemm.num_local:
            raise CheckpointMismatchError(f"{key}: expected {e.gemm.num_local} experts in checkpoint {path}, found "
                                          f"{sd[key].shape[0]}")
        if e.quantizer.layout == "per_expert":  # the views' own keys
            for i, row in enumerate(sd.pop(key)):
                sd[f"{e.name}.{i}._amax"] = row
    return sd


def _load_checked(model: nn.Module, sd: dict, strict: bool, path: Path) -> None:
    """``load_state_dict`` once every key and shape is known to fit (torch's own load copies what fits before it
    reports what does not, which would leave the model half loaded). Quantizers take an ``_amax`` (and static block
    scales' ``_block_amax``) of any shape, also where they hold none yet."""
    own = model.state_dict()
    amax_keys = {f"{name}.{key}" for name, m in model.named_modules() if hasattr(type(m), "amax")
                 for key in ("_amax", "_block_amax")}
    missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own) - amax_keys)
    wrong = sorted(f"{k}: the model has {tuple(own[k].shape)}, the checkpoint {tuple(sd[k].shape)}"
                   for k in (own.keys() & sd.keys()) - amax_keys
                   if isinstance(sd[k], torch.Tensor) and own[k].shape != sd[k].shape)
    problems = [*wrong[:4]]
    if strict and missing:
        problems.append(f"{len(missing)} keys missing from the checkpoint, e.g. {missing[:3]}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} keys the model does not have, e.g. {unexpected[:3]}")
    if problems:
        raise CheckpointMismatchError(f"{path} does not fit the model: " + "; ".join(problems))
    model.load_state_dict(sd, strict=strict, assign=any(p.is_meta for p in model.parameters()))
