"""Quantization state as plain data, and single-file save/restore for plain PyTorch models.

The state is layout-independent: quantizers are named by their *rule name* (``...weight_quantizer``, never the
``per_expert`` child ``...weight_quantizer.3``), expert layouts are recorded but can be overridden at restore, and
expert amaxes in :func:`save` files are canonical (``[N, ...]``, see :mod:`.amax`). So a model saved with one expert
amax layout restores into another.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..quantization.config import BackwardConfig, ExpertsConfig, QuantizeConfig, QuantizerAttributeConfig
from ..quantization.conversion import convert, is_quantized, named_quantizers, rule_name
from .amax import (
    CheckpointMismatchError,
    canonical_amax,
    iter_expert_slots,
    layout_has_amax,
    layout_name,
    native_from_canonical,
    per_expert_shape,
)

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "modelopt_state",
    "restore_modelopt_state",
    "register_expert_parallel_size",
    "num_global_experts",
    "save",
    "restore",
]

STATE_FORMAT = "modelopt_moe.quantization_state"
STATE_VERSION = 1

# Plugins tell how many expert-parallel ranks share an owner's experts (Megatron: the EP group size).
_EP_SIZE_PROVIDERS: list[Callable[[nn.Module], int | None]] = []


def register_expert_parallel_size(fn: Callable[[nn.Module], int | None]) -> None:
    """Registers ``fn(owner_module) -> expert-parallel size | None`` (plugins do this)."""
    if fn not in _EP_SIZE_PROVIDERS:
        _EP_SIZE_PROVIDERS.append(fn)


def num_global_experts(owner: nn.Module, num_local: int) -> int:
    for fn in _EP_SIZE_PROVIDERS:
        size = fn(owner)
        if size:
            return num_local * size
    return num_local


def _rule_level_quantizers(model: nn.Module) -> dict[str, list]:
    out: dict[str, list] = {}
    for name, q, _ in named_quantizers(model):
        out.setdefault(rule_name(name), []).append(q)
    return out


def modelopt_state(model: nn.Module) -> dict:
    """Everything needed to re-create ``model``'s quantization in a freshly built model (plain data, no tensors).

    Returns:
        ``{"format", "version", "config" (the QuantizeConfig used, or None), "backward", "experts" (the layouts),
        "quantized_modules", "quantizers" (rule name -> cfg / enabled / ste), "expert_slots" (name -> layout,
        global expert count)}``.

    Raises:
        ValueError: ``model`` is not quantized.
    """
    modules = [name for name, m in model.named_modules() if is_quantized(m)]
    if not modules:
        raise ValueError(f"modelopt_state: {type(model).__name__} is not quantized (call mtq.quantize first)")
    quantizers = {}
    for name, qs in _rule_level_quantizers(model).items():
        quantizers[name] = {"cfg": qs[0].cfg.model_dump(), "enabled": any(q.is_enabled for q in qs),
                            "ste": qs[0].ste}
    slots = {}
    layouts = {}
    for s in iter_expert_slots(model):
        slots[s.name] = {"layout": layout_name(s.layout),
                         "num_global_experts": num_global_experts(s.owner, s.num_local)}
        if s.kind == "weight_quantizer":
            layouts.setdefault(s.kind, slots[s.name]["layout"])
        elif s.kind == "input_quantizer":  # an [N] input amax is the config's input_amax "per_expert"
            layouts.setdefault(s.kind, "shared" if slots[s.name]["layout"] == "shared" else "per_expert")
    backward = next((m.quant_backward.model_dump() for m in model.modules()
                     if is_quantized(m) and hasattr(m, "quant_backward")), BackwardConfig().model_dump())
    experts = ExpertsConfig(weight_amax=layouts.get("weight_quantizer", "vectorized"),
                            input_amax=layouts.get("input_quantizer", "shared")).model_dump()
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "config": getattr(model, "_modelopt_moe_config", None),
        "backward": backward,
        "experts": experts,
        "quantized_modules": modules,
        "quantizers": quantizers,
        "expert_slots": slots,
    }


def check_state_header(state, source: str) -> None:
    """Raises CheckpointMismatchError unless ``state`` is a quantization state of a version this code reads."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointMismatchError(f"{source}: not a modelopt_moe quantization state: expected format "
                                      f"{STATE_FORMAT!r}, found {found!r}")
    if state.get("version") != STATE_VERSION:
        raise CheckpointMismatchError(f"{source}: quantization state version: expected {STATE_VERSION}, found "
                                      f"{state.get('version')!r}")


def _restore_config(state: dict, experts) -> QuantizeConfig:
    if state.get("config") is not None:
        cfg = QuantizeConfig.model_validate(state["config"])
    else:  # no rules: every quantizer gets its saved settings below
        cfg = QuantizeConfig(backward=BackwardConfig(**state["backward"]))
    layouts = ExpertsConfig(**state["experts"])
    if experts is not None:
        layouts = experts if isinstance(experts, ExpertsConfig) else ExpertsConfig(**experts)
    return cfg.model_copy(update={"experts": layouts, "backward": BackwardConfig(**state["backward"])})


def restore_modelopt_state(model: nn.Module, state: dict, experts: ExpertsConfig | dict | None = None, *,
                           source: str = "<state>") -> nn.Module:
    """Re-creates the quantization of :func:`modelopt_state` in ``model`` (amaxes are loaded separately).

    An unquantized ``model`` (also one on the meta device) is converted with the saved config and every quantizer
    gets its saved format, enablement and STE. An already quantized ``model`` is only checked against the state.

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
    check_state_header(state, source)
    already = any(is_quantized(m) for m in model.modules())
    cfg = _restore_config(state, experts)
    if not already:
        convert(model, cfg)
    found = _rule_level_quantizers(model)
    saved = state["quantizers"]
    missing, extra = sorted(set(saved) - set(found)), sorted(set(found) - set(saved))
    if missing or extra:
        raise CheckpointMismatchError(
            f"{source}: quantizers do not fit the model: {len(missing)} only in the checkpoint {missing[:4]}, "
            f"{len(extra)} only in the model {extra[:4]}")
    for name, entry in saved.items():
        ckpt_cfg = QuantizerAttributeConfig(**entry["cfg"])
        for q in found[name]:
            if already:
                if q.is_enabled and entry["enabled"] and (q.fmt, q.axis) != (ckpt_cfg.format, ckpt_cfg.axis):
                    raise CheckpointMismatchError(
                        f"{name}: quantization format mismatch with {source}: the model expects format "
                        f"{q.fmt} axis={q.axis}, the checkpoint has format {ckpt_cfg.format} axis={ckpt_cfg.axis}")
                continue
            q.set_from_attribute_config(ckpt_cfg)
            q._enabled = entry["enabled"]
            q.ste = entry["ste"]
    for slot in iter_expert_slots(model):
        entry = state["expert_slots"].get(slot.name)
        if entry is None:
            raise CheckpointMismatchError(f"{slot.name}: expert quantizer not in {source}")
        expected = num_global_experts(slot.owner, slot.num_local)
        if entry["num_global_experts"] != expected:
            raise CheckpointMismatchError(
                f"{slot.name}._amax: expected {expected} experts in checkpoint {source}, found "
                f"{entry['num_global_experts']}")
    if not already:
        model._modelopt_moe_config = cfg.model_dump()
    return model


# ---------------------------------------------------------------------------------------------------------------
# Plain PyTorch: one file with the quantization state and a state dict whose expert amaxes are canonical.


def _canonical_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    for slot in iter_expert_slots(model):
        prefix = f"{slot.name}."
        for k in [k for k in sd if k.startswith(prefix) and k.endswith("_amax")]:
            del sd[k]
        if layout_has_amax(slot.layout):
            sd[f"{slot.name}._amax"] = canonical_amax(slot.layout, slot.num_local, per_expert_shape(slot.layout))
    return sd


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Saves ``model``'s quantization state and weights in one file (written to a temporary file, then renamed, so
    an interrupted save never leaves a truncated ``path``).

    Args:
        model: a quantized model.
        path: the file to write.
    """
    atomic_torch_save({"modelopt_moe_state": modelopt_state(model), "state_dict": _canonical_state_dict(model)},
                      Path(path))


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename: a crash leaves the old file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def restore(model: nn.Module, path: str | os.PathLike, experts: ExpertsConfig | dict | None = None,
            strict: bool = True) -> nn.Module:
    """Converts an unquantized ``model`` as saved by :func:`save` and loads the weights and amaxes.

    Args:
        model: the freshly built model (a meta-device model is loaded by assignment).
        path: a file written by :func:`save`.
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
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or "modelopt_moe_state" not in payload:
        raise CheckpointMismatchError(f"{path}: not a modelopt_moe checkpoint (no 'modelopt_moe_state' entry)")
    restore_modelopt_state(model, payload["modelopt_moe_state"], experts, source=str(path))
    sd = dict(payload["state_dict"])
    for slot in iter_expert_slots(model):
        canonical = sd.pop(f"{slot.name}._amax", None)
        if canonical is None:
            continue
        if canonical.shape[0] != slot.num_local:
            raise CheckpointMismatchError(f"{slot.name}._amax: expected {slot.num_local} experts in checkpoint "
                                          f"{path}, found {canonical.shape[0]}")
        ndim = 2 if slot.kind == "weight_quantizer" else None
        for rel, value in native_from_canonical(slot.layout, canonical, ndim).items():
            sd[f"{slot.name}.{rel}"] = value
    assign = any(p.is_meta for p in model.parameters())
    model.load_state_dict(sd, strict=strict, assign=assign)
    return model
