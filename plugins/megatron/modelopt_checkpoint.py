"""Megatron distributed checkpoints written by NVIDIA Model Optimizer 0.47, loaded into this package's models.

Model Optimizer's Megatron flow saves ``dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)`` (Megatron-LM
nests it under ``"model"``; the tensor keys are the same) and ``save_sharded_modelopt_state([model], ckpt_dir)``,
which writes ``ckpt_dir/modelopt_state/`` (its quantization config). What its quantized modules put in the sharded
state dict:

* every Megatron module's config has ``hetereogenous_dist_checkpoint = True``, so keys name each layer
  (``decoder.layers.0.``...) instead of stacking layers on an axis;
* ``SequentialMLP`` experts are saved with ``singleton_local_shards``: ``...mlp.experts.experts.{g}.linear_fc1.``
  with the GLOBAL expert index ``g``;
* each quantized linear writes ``{input,weight,output}_quantizer._amax`` beside its weight (a per-tensor amax as
  ``[1]``, a per-channel one as ``[C, 1]``, split over TP like the weight's channels) and its quantizers' settings
  in ``_extra_state`` (``{"modelopt_quantizer_state": {name: get_modelopt_state()}}``).

:func:`load_modelopt_checkpoint` builds the same keys from the model (Megatron's own ``sharded_state_dict`` with
those two switches) so Megatron's ``dist_checkpointing.load`` reshards weights and amaxes to any TP / EP, converts
the model with the saved config, gives each quantizer its saved settings and every amax its saved value, bit for
bit. Model Optimizer's per-expert quantizers become one expert quantizer per GEMM here (amax ``[N]``, layout
``per_expert``: the same ``weight_quantizer.{i}`` names in ``state_dict``).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.transformer.moe.experts import SequentialMLP

from modelopt_moe.checkpoint.errors import CheckpointMismatchError, IncompleteCheckpointError
from modelopt_moe.checkpoint.modelopt_format import model_optimizer_config, model_optimizer_expert_layouts
from modelopt_moe.quantization.config import ExpertsConfig
from modelopt_moe.quantization.conversion import convert, is_quantized, unwrap_model
from modelopt_moe.quantization.expert_quantizer import ExpertQuantizer
from modelopt_moe.quantization.modelopt_compat import COMPAT_DOC, parse_modelopt_quantizer_state
from modelopt_moe.quantization.nn.experts import QUANTIZER_KINDS
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer
from modelopt_moe.quantization.utils import warn_once

__all__ = ["MODELOPT_STATE_DIR", "is_modelopt_checkpoint", "load_modelopt_checkpoint"]

MODELOPT_STATE_DIR = "modelopt_state"  # Model Optimizer's save_sharded_modelopt_state subdirectory
_GLOBAL_EXPERT = re.compile(r"\.experts\.experts\.\d+\.")


def _any_expert(key: str) -> str:
    """A checkpoint key with its global expert index wildcarded (an amax of another EP rank's expert is used)."""
    return _GLOBAL_EXPERT.sub(".experts.experts.*.", key)


def is_modelopt_checkpoint(ckpt_dir: str | os.PathLike) -> bool:
    """Whether ``ckpt_dir`` is a Megatron checkpoint with Model Optimizer's quantization state."""
    return (Path(ckpt_dir) / MODELOPT_STATE_DIR / ".metadata").is_file() and (Path(ckpt_dir) / ".metadata").is_file()


@contextlib.contextmanager
def _modelopt_key_layout(model: torch.nn.Module):
    """Megatron keys as Model Optimizer wrote them: one key per layer (its ``hetereogenous_dist_checkpoint``)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config") and
               hasattr(m.config, "hetereogenous_dist_checkpoint")}
    saved = {k: c.hetereogenous_dist_checkpoint for k, c in configs.items()}
    try:
        for c in configs.values():
            c.hetereogenous_dist_checkpoint = True
        yield
    finally:
        for k, c in configs.items():
            c.hetereogenous_dist_checkpoint = saved[k]


def _checkpoint_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class _AmaxTarget:
    """One checkpoint amax and where it goes: a quantizer (``expert`` None) or expert ``expert`` of one."""

    def __init__(self, key: str, quantizer: TensorQuantizer, expert: int | None, local_shape: tuple[int, ...],
                 tp: tuple[int, int] | None, replica_id: int):
        self.key, self.quantizer, self.expert, self.local_shape, self.tp = key, quantizer, expert, local_shape, tp
        self.replica_id = replica_id

    def sharded_tensor(self) -> ShardedTensor:
        data = torch.zeros(self.local_shape, dtype=torch.float32)
        offsets = ((0, *self.tp),) if self.tp else ()
        return ShardedTensor.from_rank_offsets(self.key, data, *offsets, replica_id=self.replica_id)


def _amax_shape(q: TensorQuantizer, weight_shape: tuple[int, ...], kind: str) -> tuple[int, ...] | None:
    """The local amax shape Model Optimizer saves for a quantizer: ``[1]`` per tensor, ``[C, 1]`` per output
    channel of the weight; None for a quantizer with no amax (dynamic)."""
    if q.is_dynamic or not q.needs_amax and q.static_block_size is None:
        return None
    if q.static_block_size is not None:
        raise CheckpointMismatchError(f"{kind}: static int blocks in a Megatron checkpoint of Model Optimizer are "
                                      f"not supported; see {COMPAT_DOC}#differences-from-model-optimizer")
    if q.axis is None:
        return (1,)
    if kind == "weight_quantizer" and q.axis in (0, -2):
        return (weight_shape[0], 1)
    raise CheckpointMismatchError(f"{kind}: a per-channel amax with axis={q.axis} in a Megatron checkpoint of Model "
                                  "Optimizer is not supported (output channels of weights only)")


def _targets(model: torch.nn.Module, sd: dict) -> tuple[list[_AmaxTarget], dict[str, tuple]]:
    """Every amax this model needs from the checkpoint, and ``{extra-state dict key: (module, expert gemm or None,
    expert index)}`` of the quantized modules' ``_extra_state`` entries."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    # Replica ids that make exactly one main replica per tensor piece (Megatron validates the pattern at load too):
    # an expert's amax is held by its EP rank's expert-data-parallel ranks; a dense one by every rank, or, split
    # over TP, by the ranks of one TP rank (TP is the fastest-varying rank dimension in Megatron's order).
    rank = torch.distributed.get_rank()
    edp_rank = parallel_state.get_expert_data_parallel_rank()
    targets, extras = [], {}
    for name, module in model.named_modules():
        if not is_quantized(module):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, SequentialMLP):
            for gemm in module.expert_gemms():
                for i in range(gemm.num_local):
                    local = f"{prefix}local_experts.{i}.{gemm.name}."
                    ckpt_prefix = sd[f"{local}weight"].key[: -len("weight")]
                    extras[f"{local}_extra_state"] = (module, gemm, i)
                    for kind in QUANTIZER_KINDS:
                        q: ExpertQuantizer = getattr(gemm.quantizers, kind)
                        if not q.is_enabled:
                            continue
                        shape = _amax_shape(q, gemm.weight_shape, kind)
                        if shape is not None:
                            targets.append(_AmaxTarget(f"{ckpt_prefix}{kind}._amax", q, i, shape, None, edp_rank))
            continue
        if "weight_quantizer" not in module._modules or f"{prefix}weight" not in sd:
            continue  # an expert's linear (its SequentialMLP loads it), or a module without a sharded weight
        ckpt_prefix = sd[f"{prefix}weight"].key[: -len("weight")]
        if f"{prefix}_extra_state" in sd:
            extras[f"{prefix}_extra_state"] = (module, None, None)
        for kind in QUANTIZER_KINDS:
            q = module._modules[kind]
            if not q.is_enabled:
                continue
            shape = _amax_shape(q, tuple(module.weight.shape), kind)
            if shape is None:
                continue
            # A per-output-channel weight amax of a column-parallel linear is split over TP like the weight rows.
            tp = (tp_rank, tp_size) if len(shape) == 2 and module.sharded_axis == 0 and tp_size > 1 else None
            targets.append(_AmaxTarget(f"{ckpt_prefix}{kind}._amax", q, None, shape, tp,
                                       rank // tp_size if tp else rank))
    return targets, extras


def _apply_extra_states(extras: dict[str, tuple], loaded: dict, source: str) -> None:
    """Each quantizer takes the settings Model Optimizer saved for it (the experts of one GEMM must agree)."""
    seen: dict[int, tuple] = {}
    for key, (module, gemm, expert) in extras.items():
        state = loaded.get(key)
        qstates = (state or {}).get("modelopt_quantizer_state") if isinstance(state, dict) else None
        if not qstates:
            continue
        holder = gemm.quantizers if gemm is not None else module
        for kind, qstate in qstates.items():
            q = getattr(holder, kind, None) if kind in QUANTIZER_KINDS else None
            if q is None:
                raise CheckpointMismatchError(f"{source}: {key}: quantizer {kind!r} has no counterpart here")
            try:
                cfg, flags, _ = parse_modelopt_quantizer_state(qstate)
            except ValueError as e:
                raise CheckpointMismatchError(f"{source}: {key}: {kind}: {e}") from None
            settings = (cfg.model_dump(), flags["enabled"])
            if id(q) in seen:
                if seen[id(q)][0] != settings:
                    raise CheckpointMismatchError(
                        f"{source}: {key}: {kind} of expert {expert} differs from expert {seen[id(q)][1]}: every "
                        f"expert of a GEMM shares one format here; see {COMPAT_DOC}#differences-from-model-optimizer")
                continue
            seen[id(q)] = (settings, expert)
            q.set_from_modelopt_state(qstate, properties_only=True)
            q.set_switches(if_calib=False, if_quant=True)


def load_modelopt_checkpoint(model, ckpt_dir: str | os.PathLike, *, experts: ExpertsConfig | dict | None = None,
                             strict: bool = True) -> dict:
    """Loads a Megatron checkpoint that Model Optimizer 0.47 saved (``dist_checkpointing.save`` +
    ``save_sharded_modelopt_state``) into a freshly built model of this package, at any TP / EP layout.

    Converts the model with the saved quantization config (expert layouts: one weight amax per expert, the input
    amax shared, as Model Optimizer calibrates them; or ``experts``), gives every quantizer the settings saved in
    its module's ``_extra_state``, then loads the weights and every amax (bit for bit). Call on every rank
    (Megatron's load is collective). Optimizer state is not read.

    Args:
        model: the model (one chunk; Model Optimizer saves no virtual pipeline stages), unquantized or already
            converted; Megatron's DDP / ``Float16Module`` wrappers are fine.
        ckpt_dir: the checkpoint directory (with ``modelopt_state/`` inside).
        experts: expert amax layouts to load into.
        strict: every weight of the model must be in the checkpoint.

    Returns:
        ``{"modelopt_version", "loaded_amaxes" (count), "ignored_amaxes" (checkpoint amaxes of quantizers this
        package does not have, e.g. normalization-layer inputs; a rank-0 warning names them)}``.

    Raises:
        IncompleteCheckpointError: not a complete Model Optimizer checkpoint (names what is missing).
        CheckpointMismatchError: a config, quantizer state or amax shape this model or package cannot take (names
            the key, the expected and the found value).
    """
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    if len(chunks) != 1:
        raise CheckpointMismatchError("load_modelopt_checkpoint: Model Optimizer saves one model chunk (no virtual "
                                      f"pipeline stages), got {len(chunks)}")
    model = unwrap_model(chunks[0])
    path = Path(ckpt_dir)
    if not is_modelopt_checkpoint(path):
        raise IncompleteCheckpointError(f"{path}: not a Model Optimizer Megatron checkpoint (expected {path}/.metadata "
                                        f"and {path}/{MODELOPT_STATE_DIR}/.metadata)")
    source = str(path / MODELOPT_STATE_DIR)
    state = dist_checkpointing.load_common_state_dict(source)
    cfg, _ = model_optimizer_config(state, source)
    if not any(is_quantized(m) for m in model.modules()):
        layouts = experts if experts is not None else model_optimizer_expert_layouts(cfg)
        layouts = layouts if isinstance(layouts, ExpertsConfig) else ExpertsConfig(**layouts)
        convert(model, cfg.model_copy(update={"experts": layouts}))
    with _modelopt_key_layout(model):
        sd = model.sharded_state_dict(metadata={"singleton_local_shards": True})
    # Settings first: they decide which quantizers hold an amax.
    targets, extras = _targets(model, sd)
    loaded_extra = dist_checkpointing.load({k: sd[k] for k in extras if isinstance(sd[k], ShardedObject)}, str(path))
    _apply_extra_states(extras, loaded_extra, source)
    targets, _ = _targets(model, sd)
    shapes = _checkpoint_tensors(path)
    for t in targets:
        found = shapes.get(t.key)
        expected = tuple(t.sharded_tensor().global_shape)
        if found != expected:
            raise CheckpointMismatchError(f"{t.key}: amax shape mismatch in checkpoint {path}: expected global shape "
                                          f"{expected}, found {found}")
    weights = {k: v for k, v in sd.items() if "_quantizer." not in k and not k.endswith("_extra_state")}
    amax_entries = {f"__amax__/{t.key}": t.sharded_tensor() for t in targets}
    loaded = dist_checkpointing.load({**weights, **amax_entries}, str(path))
    result = model.load_state_dict({k: loaded[k] for k in weights}, strict=False)
    missing = [k for k in result.missing_keys if "_quantizer." not in k and not k.endswith("_extra_state")]
    if strict and (missing or result.unexpected_keys):
        raise CheckpointMismatchError(f"{path}: weights do not fit the model: missing {missing[:4]}, unexpected "
                                      f"{result.unexpected_keys[:4]}")
    per_expert: dict[int, tuple[ExpertQuantizer, dict[int, torch.Tensor]]] = {}
    for t in targets:
        value = loaded[f"__amax__/{t.key}"].float()
        if t.expert is None:
            t.quantizer.amax = value.reshape(()) if t.quantizer.axis is None else value
        else:
            per_expert.setdefault(id(t.quantizer), (t.quantizer, {}))[1][t.expert] = value.reshape(-1)
    for q, rows in per_expert.values():
        stacked = torch.stack([rows[i] for i in range(q.num_experts)])
        q.amax = stacked.reshape(-1) if q.axis is None else stacked
    used = {_any_expert(t.key) for t in targets}
    ignored = sorted(k for k in shapes if k.endswith("_quantizer._amax") and _any_expert(k) not in used)
    if ignored:
        warn_once(f"{path}: Model Optimizer quantized modules that modelopt_moe does not (e.g. normalization-layer "
                  f"inputs); their amaxes are not loaded: {ignored[:4]}{' ...' if len(ignored) > 4 else ''} "
                  f"({len(ignored)}; see {COMPAT_DOC}#differences-from-model-optimizer)")
    return {"modelopt_version": state.get("modelopt_version"), "loaded_amaxes": len(targets),
            "ignored_amaxes": ignored}
