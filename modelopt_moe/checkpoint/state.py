"""Quantization state as plain data, and single-file save/restore for plain PyTorch models.

The state names every quantizer by its module path and records each quantizer's settings, the expert layouts and
each expert quantizer's global expert count; no tensors. Amaxes travel in the model's state dict (plain
:func:`save`) or sharded state dict (distributed checkpoints). In :func:`save` files every expert amax is stored as
its ``[N, ...]`` tensor under ``<quantizer>._amax``, whatever its layout, so a model saved with one expert amax
layout restores into another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..quantization.config import BackwardConfig, ExpertsConfig, QuantizeConfig, QuantizerAttributeConfig
from ..quantization.conversion import convert, is_quantized, named_quantizers, rule_name, unwrap_model
from ..quantization.expert_quantizer import ExpertGemm, ExpertQuantizer
from ..quantization.nn.experts import QUANTIZER_KINDS
from ..quantization.nn.row_scale import DOWN_PROJ_INPUT
from ..quantization.utils import warn_once
from ..quantization.weight_amax import set_weight_amax_update, update_weight_amax
from .errors import CheckpointMismatchError
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


@dataclass
class ExpertQuantizerEntry:
    """One expert quantizer of a model: its full name, kind, the quantizer, its GEMM and the owning module."""

    name: str
    kind: str
    quantizer: ExpertQuantizer
    gemm: ExpertGemm
    owner: nn.Module

    @property
    def num_global_experts(self) -> int:
        return self.owner.expert_grid().ep_size * self.gemm.num_local


def iter_expert_quantizers(model: nn.Module) -> Iterator[ExpertQuantizerEntry]:
    """Every expert quantizer of ``model`` (inside any wrappers), in module order."""
    for mod_name, module in unwrap_model(model).named_modules():
        if not is_quantized(module):
            continue
        for gemm in module.expert_gemms():
            base = ".".join(p for p in (mod_name, gemm.name) if p)
            for kind in QUANTIZER_KINDS:
                q = getattr(gemm.quantizers, kind)
                yield ExpertQuantizerEntry(f"{base}.{kind}" if base else kind, kind, q, gemm, module)


def modelopt_state(model: nn.Module) -> dict:
    """Everything needed to re-create ``model``'s quantization in a freshly built model (plain data, no tensors).

    Returns:
        ``{"format", "version", "backward", "kernel", "experts" (the amax layouts), "quantized_modules",
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
        "kernel": first.quant_kernel,
        "weight_amax_update": _weight_amax_update(model),
        "autoswitch": first.quant_autoswitch.model_dump() if getattr(first, "quant_autoswitch", None) else None,
        "experts": ExpertsConfig(**layouts).model_dump(),
        "quantized_modules": [name for name, _ in modules],
        "quantizers": quantizers,
        "expert_quantizers": experts,
        "expert_down_proj_input": DOWN_PROJ_INPUT,
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
    modes = {q.amax_update for name, q, _ in named_quantizers(model) if q.is_enabled and
             rule_name(name).endswith("weight_quantizer")}
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
    return QuantizeConfig(backward=BackwardConfig(**state["backward"]), kernel=state.get("kernel", "auto"),
                          experts=layouts, weight_amax_update=state.get("weight_amax_update", "static"),
                          autoswitch=state.get("autoswitch"))


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
        q._enabled = entry["enabled"]
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
    warn_if_down_proj_input_calibrated_otherwise(model, state.get("expert_down_proj_input"), source)
    return model


def warn_if_down_proj_input_calibrated_otherwise(model: nn.Module, saved: str | None, source: str) -> list[str]:
    """Warns once (rank 0), naming them, when the model's enabled expert down-projection input quantizers load an
    amax calibrated on something else than what they now quantize: a checkpoint whose state does not record
    ``expert_down_proj_input`` (``saved`` None: modelopt_moe before it quantized that input ahead of the router
    probability, or Model Optimizer) holds amaxes of ``prob * act``. Returns the quantizers' names."""
    if saved == DOWN_PROJ_INPUT:
        return []
    names = [e.name for e in iter_expert_quantizers(model)
             if e.kind == "input_quantizer" and e.gemm.sharded_axis == 1 and e.quantizer.is_enabled]
    if names:
        warn_once(
            f"{source}: this checkpoint's expert down-projection (linear_fc2) input amaxes were calibrated on the "
            "activation times the router probability (Megatron's order, what checkpoints without "
            "'expert_down_proj_input' in their quantization state hold); the quantizers now see the activation "
            "itself, as serving engines do, so these amaxes are too small and clip. Recalibrate after loading: "
            "mtq.calibrate(model, forward_loop=...) (weights and the other amaxes are unaffected). Quantizers:\n  "
            + "\n  ".join(names))
    return names


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
    """
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
        CheckpointMismatchError: the file does not fit the model (see :func:`restore_modelopt_state`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"restore: no checkpoint file {path}")
    payload = load_plain(path)
    if is_model_optimizer_checkpoint(payload):
        restore_model_optimizer_state(model, payload["modelopt_state"], experts, source=str(path))
        assign = any(p.is_meta for p in model.parameters())
        model.load_state_dict(payload["model_state_dict"], strict=strict, assign=assign)
        return model
    if not isinstance(payload, dict) or "modelopt_moe_state" not in payload:
        raise CheckpointMismatchError(f"{path}: not a modelopt_moe checkpoint (no 'modelopt_moe_state' entry)")
    restore_modelopt_state(model, payload["modelopt_moe_state"], experts, source=str(path))
    sd = dict(payload["state_dict"])
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
    assign = any(p.is_meta for p in model.parameters())
    model.load_state_dict(sd, strict=strict, assign=assign)
    return model
