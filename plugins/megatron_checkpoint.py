"""Megatron-Core sharded state dicts of quantizer amaxes, and checkpoint save/load helpers.

Checkpoint keys and axes (``L`` = the layer axis Megatron's TransformerBlock prepends, ``E`` = global experts):

* dense (attention, shared experts) linear ``<prefix>{input,weight,output}_quantizer._amax``: the amax as stored,
  replicated over TP and DP (replica_id ``(0, tp_rank, dp_rank)``); a per-channel weight amax along the TP-sharded
  weight axis (column-parallel axis 0, row-parallel axis 1) is TP-sharded on that axis (replica_id
  ``(0, 0, dp_rank)``).
* experts: ONE key per (layer, GEMM, quantizer kind), the same for every amax layout and for ``SequentialMLP`` and
  ``TEGroupedMLP``: ``...mlp.experts.experts.linear_fc{1,2}.{kind}._amax`` (Megatron's expert weight keys are
  ``...mlp.experts.experts.linear_fc1.weight``), global shape ``[L, E]`` (per tensor) or ``[L, E, C]`` (per
  channel), this rank's experts at offset ``ep_rank * N_local``:

  - ``vectorized``: its ``[N_local(, C)]`` tensor, replica_id ``(0, etp_rank, edp_rank)``;
  - ``per_expert``: child ``i`` at global expert ``ep_rank * N_local + i`` (a prepended axis, like
    ``SequentialMLP``'s expert weights), same replica_id;
  - ``shared``: its value repeated for ALL ``E`` experts (every rank holds the whole ``[E]`` chunk, one writer:
    replica_id ``(0, etp_rank, ep_rank * edp_size + edp_rank)``); loading takes the max over all ``E`` experts.
    Calibration max-reduces a shared amax over EP, so every rank holds the same value: no collective at save.

  A per-channel weight amax along the expert-TP-sharded axis is sharded over expert-TP (then ``etp_rank`` leaves
  the replica_id). Per-channel activation amaxes are saved replicated.

Every amax is a ``ShardedTensorFactory``: it builds the ShardedTensor(s) above (checking the checkpoint's shape
when :func:`modelopt_moe.checkpoint.restore_sharded_modelopt_state` recorded it) and merges what was loaded back
into the module's own layout. A quantizer without an amax (not calibrated yet, or built on the meta device) gets a
zero placeholder of the right shape, so a fresh model loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import nn

from modelopt_moe.checkpoint.amax import (
    CheckpointMismatchError,
    canonical_amax,
    classify_checkpoint_amax,
    layout_is_saved,
    native_from_canonical,
    native_shape,
    per_expert_shape,
)
from modelopt_moe.checkpoint.sharded import (
    begin_checkpoint_dir,
    check_checkpoint_dir,
    checkpoint_hint,
    clear_checkpoint_hint,
    commit_checkpoint_dir,
    resolve_checkpoint_dir,
    restore_sharded_modelopt_state,
    save_sharded_modelopt_state,
)
from modelopt_moe.checkpoint.state import register_expert_parallel_size
from modelopt_moe.quantization.nn.grouped_linear import QUANTIZER_KINDS
from modelopt_moe.quantization.tensor_quantizer import PerExpertQuantizer, TensorQuantizer

__all__ = [
    "ExpertSharding",
    "parallel_linear_quantizers_sharded_state_dict",
    "expert_quantizers_sharded_state_dict",
    "sequential_mlp_quantizers_sharded_state_dict",
    "grouped_linear_quantizers_sharded_state_dict",
    "model_sharded_state_dict",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
]


@dataclass(frozen=True)
class ExpertSharding:
    """This rank's place in the expert grid (sizes and ranks of the EP, expert-TP and expert-DP groups)."""

    ep_rank: int
    ep_size: int
    etp_rank: int = 0
    etp_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1

    @classmethod
    def from_groups(cls, ep, etp, edp) -> ExpertSharding:
        return cls(get_pg_rank(ep), get_pg_size(ep), get_pg_rank(etp), get_pg_size(etp), get_pg_rank(edp),
                   get_pg_size(edp))

    @classmethod
    def from_parallel_state(cls) -> ExpertSharding:
        return cls.from_groups(parallel_state.get_expert_model_parallel_group(),
                               parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
                               parallel_state.get_expert_data_parallel_group(check_initialized=False))


def _channel_sharded(q: TensorQuantizer, kind: str, sharded_axis: int) -> bool:
    """A per-channel WEIGHT amax along the TP-sharded weight axis holds this rank's channels only."""
    return kind == "weight_quantizer" and q.axis is not None and q.axis % 2 == sharded_axis


def _module_device(module: nn.Module) -> torch.device:
    """Where the module's parameters live (CPU for a meta-device model, which loads after ``to_empty``)."""
    p = next(module.parameters(), None)
    return torch.device("cpu") if p is None or p.device.type == "meta" else p.device


def _placeholder(shape, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32, device="cpu" if device is None or device.type == "meta" else device)


def _consume_hint(owner: nn.Module):
    # A recorded checkpoint applies to one load only; the first merge (after every factory built) forgets it.
    owner.__dict__.pop("_modelopt_moe_ckpt_hint", None)


# ---------------------------------------------------------------------------------------------------------------
# dense (tensor-parallel) linears


def parallel_linear_quantizers_sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets=(),
                                                  metadata: dict | None = None, *, sharded_axis: int) -> dict:
    """Sharded entries for the quantizers of a Megatron ``ColumnParallelLinear`` / ``RowParallelLinear``.

    Quantizers that are not sub-modules (the slots of ``SequentialMLP`` expert linears, whose amaxes the layer
    saves) are skipped.

    Args:
        module: the quantized linear (has ``weight``).
        prefix: its state-dict prefix.
        sharded_offsets: offsets prepended by the parents (Megatron's layer axis).
        metadata: Megatron's sharded-state-dict metadata (its ``dp_cp_group`` is used).
        sharded_axis: the weight axis split over TP (0 column-parallel, 1 row-parallel).

    Returns:
        ``{state-dict key: ShardedTensorFactory}``.
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    tp_group = getattr(module, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    dp_cp_group = metadata["dp_cp_group"]
    tp_rank, tp_size, dp_rank = get_pg_rank(tp_group), get_pg_size(tp_group), get_pg_rank(dp_cp_group)
    out = {}
    weight = module.weight
    for kind in QUANTIZER_KINDS:
        q = module._modules.get(kind)
        if not isinstance(q, TensorQuantizer) or not layout_is_saved(q):
            continue
        sharded = _channel_sharded(q, kind, sharded_axis)
        pe = per_expert_shape(q, tuple(weight.shape) if kind == "weight_quantizer" else None)
        shape = native_shape(q, pe, weight.dim() if kind == "weight_quantizer" else None)
        data = q.amax.detach() if q.amax is not None else _placeholder(shape, weight.device)
        tp_offsets = ((len(sharded_offsets) + q.axis % 2, tp_rank, tp_size),) if sharded else ()
        replica_id = (0, 0 if sharded else tp_rank, dp_rank)
        key = f"{prefix}{kind}._amax"
        out[key] = _dense_factory(module, key, data, tuple(sharded_offsets), tp_offsets, replica_id)
    return out


def _dense_factory(owner, key, data, offsets, tp_offsets, replica_id) -> ShardedTensorFactory:
    def build(key, data, replica_id, flattened_range):
        st = ShardedTensor.from_rank_offsets(key, data, *offsets, *tp_offsets, replica_id=replica_id,
                                             prepend_axis_num=len(offsets))
        hint = checkpoint_hint(owner)
        if hint is not None:
            found = hint.shapes.get(key)
            if found is None or tuple(found) != st.global_shape:
                raise CheckpointMismatchError(
                    f"{key}: amax shape mismatch in checkpoint {hint.ckpt_dir}: expected global shape "
                    f"{st.global_shape}, found {None if found is None else tuple(found)}")
        return st

    def merge(loaded):
        _consume_hint(owner)
        return loaded

    return ShardedTensorFactory(key, data, build, merge, replica_id)


# ---------------------------------------------------------------------------------------------------------------
# experts


def expert_quantizers_sharded_state_dict(container: nn.Module, prefix: str, sharded_offsets=(), *, num_local: int,
                                         sharding: ExpertSharding, sharded_axis: int,
                                         weight_shape: tuple[int, ...] | None, owner: nn.Module | None = None) -> dict:
    """Sharded entries of one expert GEMM's quantizers (``container.{input,weight,output}_quantizer`` in any
    layout) with the global expert axis.

    Reusable by any grouped expert linear (``SequentialMLP``'s layer-level containers, a wrapped Transformer Engine
    grouped linear): called with the prefix its parent gives the GEMM (``...linear_fc1.``), it emits
    ``{prefix}{kind}._amax`` (``{prefix}{kind}.{i}._amax`` for ``per_expert`` children) with checkpoint keys of the
    same names, which the caller's prefix replacement turns into the expert keys.

    Args:
        container: holds the three layouts.
        prefix: the GEMM's state-dict prefix.
        sharded_offsets: offsets prepended by the parents (the layer axis); the expert axis comes next.
        num_local: local experts.
        sharding: this rank's place in the expert grid.
        sharded_axis: the weight axis split over expert-TP (0 for fc1 / column-parallel, 1 for fc2 / row-parallel).
        weight_shape: one local expert weight's shape (for an uncalibrated per-channel weight amax).
        owner: the module whose recorded checkpoint (see ``restore_sharded_modelopt_state``) is checked.

    Returns:
        ``{state-dict key: ShardedTensorFactory}``.
    """
    owner = container if owner is None else owner
    offsets = tuple(sharded_offsets)
    ax = len(offsets)  # the expert axis
    num_global = sharding.ep_size * num_local
    out = {}
    for kind in QUANTIZER_KINDS:
        layout = getattr(container, kind, None)
        if not isinstance(layout, nn.Module) or not layout_is_saved(layout):
            continue
        q0 = layout[0] if isinstance(layout, PerExpertQuantizer) else layout
        sharded = _channel_sharded(q0, kind, sharded_axis)
        if sharded and sharding.etp_size > 1 and kind == "weight_quantizer" and sharded_axis == 0 and getattr(
                owner, "config", None) is not None and getattr(owner.config, "gated_linear_unit", False):
            raise NotImplementedError(f"{prefix}{kind}: a per-channel fc1 amax of a gated linear unit with expert "
                                      "tensor parallelism > 1 is not supported in checkpoints")
        pe = per_expert_shape(layout, weight_shape if kind == "weight_quantizer" else None)
        ndim = len(weight_shape) if kind == "weight_quantizer" and weight_shape is not None else None
        chan = ((ax + 1, sharding.etp_rank, sharding.etp_size),) if sharded and pe else ()
        etp_replica = 0 if sharded else sharding.etp_rank
        spec = _ExpertSpec(owner, layout, kind, offsets, num_local, num_global, sharding, pe, ndim, chan,
                           etp_replica)
        canonical = canonical_amax(layout, num_local, pe, device=_module_device(owner))
        key = f"{prefix}{kind}"
        if isinstance(layout, PerExpertQuantizer):
            for i in range(num_local):
                out[f"{key}.{i}._amax"] = spec.factory(f"{key}._amax", canonical[i], expert=i)
        else:
            out[f"{key}._amax"] = spec.factory(f"{key}._amax", canonical, expert=None)
    return out


@dataclass
class _ExpertSpec:
    owner: nn.Module
    layout: nn.Module
    kind: str
    offsets: tuple
    num_local: int
    num_global: int
    sharding: ExpertSharding
    pe: tuple
    ndim: int | None
    chan: tuple
    etp_replica: int

    @property
    def shared(self) -> bool:
        return isinstance(self.layout, TensorQuantizer) and not hasattr(self.layout, "num_experts")

    def _single_writer(self):
        s = self.sharding
        return (0, self.etp_replica, s.ep_rank * s.edp_size + s.edp_rank)

    def expected_global_shape(self) -> tuple[int, ...]:
        outer = tuple(fragm for _, _, fragm in sorted(self.offsets))
        pe = list(self.pe)
        if self.chan:
            pe[0] *= self.sharding.etp_size
        return (*outer, self.num_global, *pe)

    def factory(self, key: str, data: torch.Tensor, expert: int | None) -> ShardedTensorFactory:
        """``data``: this expert's ``[*pe]`` (per_expert child ``expert``) or all local experts' ``[N, *pe]``."""
        replica_id = self._single_writer() if self.shared else (0, self.etp_replica, self.sharding.edp_rank)
        mode = {"value": "match"}

        def build(key, data, replica_id, flattened_range):
            hint = checkpoint_hint(self.owner)
            if hint is not None:
                mode["value"] = classify_checkpoint_amax(key, self.expected_global_shape(), hint.shapes.get(key),
                                                         len(self.offsets), hint.ckpt_dir)
            ax = len(self.offsets)
            if mode["value"] == "legacy":
                hint.warn_legacy(key, hint.shapes[key])
                chan = tuple((a - 1, r, f) for a, r, f in self.chan)
                local = data if expert is not None else data[0]
                return ShardedTensor.from_rank_offsets(key, torch.zeros_like(local), *self.offsets, *chan,
                                                       replica_id=self._single_writer(), prepend_axis_num=ax)
            if self.shared:
                # the whole [E] chunk: saving repeats the value for every global expert, loading sees all of them
                full = data[:1].expand(self.num_global, *data.shape[1:]).contiguous()
                return ShardedTensor.from_rank_offsets(key, full, *self.offsets, *self.chan, replica_id=replica_id,
                                                       prepend_axis_num=ax)
            if expert is None:  # vectorized: the expert axis is the data's first axis
                return ShardedTensor.from_rank_offsets(
                    key, data, *self.offsets, (ax, self.sharding.ep_rank, self.sharding.ep_size), *self.chan,
                    replica_id=replica_id, prepend_axis_num=ax)
            g = self.sharding.ep_rank * self.num_local + expert  # per_expert child: a prepended expert axis
            return ShardedTensor.from_rank_offsets(key, data, *self.offsets, (ax, g, self.num_global),
                                                   *self.chan, replica_id=replica_id, prepend_axis_num=ax + 1)

        def merge(loaded: torch.Tensor) -> torch.Tensor:
            _consume_hint(self.owner)
            loaded = loaded.float()
            if mode["value"] == "legacy" or expert is not None:
                canonical = loaded.unsqueeze(0)  # one expert's amax (or the layer's, for every expert)
                if mode["value"] == "legacy" and not self.shared:
                    canonical = canonical.expand(self.num_local, *loaded.shape)
            else:
                canonical = loaded
            if expert is not None:
                q = self.layout[expert]
                return canonical[0].reshape(native_shape(q, self.pe, self.ndim)).clone()
            return native_from_canonical(self.layout, canonical, self.ndim)["_amax"]

        return ShardedTensorFactory(key, data, build, merge, replica_id)


def sequential_mlp_quantizers_sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets=(),
                                                 metadata: dict | None = None) -> dict:
    """Sharded entries of a quantized ``SequentialMLP``'s layer-level ``linear_fc1`` / ``linear_fc2`` quantizers,
    under the same checkpoint keys as ``TEGroupedMLP``'s (``{prefix}experts.linear_fc1.weight_quantizer._amax``)."""
    sharding = ExpertSharding.from_groups(module.ep_group, module.tp_group, module.dp_group)
    out = {}
    for gemm, axis in module._SHARDED_AXIS.items():
        weight_shape = None
        if len(module.local_experts):
            weight_shape = tuple(getattr(module.local_experts[0], gemm).weight.shape)
        sub = expert_quantizers_sharded_state_dict(
            getattr(module, gemm), f"{prefix}{gemm}.", sharded_offsets, num_local=module.num_local_experts,
            sharding=sharding, sharded_axis=axis, weight_shape=weight_shape, owner=module)
        replace_prefix_for_sharding(sub, f"{prefix}{gemm}.", f"{prefix}experts.{gemm}.")
        out.update(sub)
    return out


def grouped_linear_quantizers_sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets=(),
                                                 metadata: dict | None = None, *, sharded_axis: int,
                                                 sharding: ExpertSharding | None = None) -> dict:
    """Sharded amax entries of a quantized grouped expert linear (Megatron ``TEColumnParallelGroupedLinear`` /
    ``TERowParallelGroupedLinear`` or :class:`GroupedLinear`): ``num_gemms`` local experts, ``weight0`` shaped
    weights, quantizers ``input_quantizer`` / ``weight_quantizer`` / ``output_quantizer`` in any layout.

    Call it from the wrapper's ``sharded_state_dict(prefix, sharded_offsets, metadata)`` and add the result to
    Megatron's entries; ``TEGroupedMLP`` then renames ``linear_fc1.`` to ``<mlp>.experts.linear_fc1.``, giving the
    same keys and axes as ``SequentialMLP``'s, so checkpoints move between the two.

    Args:
        module: the quantized grouped linear.
        prefix: its state-dict prefix (``linear_fc1.`` inside ``TEGroupedMLP``).
        sharded_offsets: offsets from the parents.
        metadata: Megatron's sharded-state-dict metadata (unused; for signature symmetry).
        sharded_axis: 0 for column-parallel (fc1), 1 for row-parallel (fc2).
        sharding: the expert grid (default: from the module's ``_pg_collection`` if any, else parallel_state).
    """
    if sharding is None:
        pgc = getattr(module, "_pg_collection", None)
        if pgc is not None and getattr(pgc, "ep", None) is not None:
            sharding = ExpertSharding.from_groups(pgc.ep, getattr(pgc, "expt_tp", None), getattr(pgc, "expt_dp", None))
        else:
            sharding = ExpertSharding.from_parallel_state()
    weight = getattr(module, "weight0", None)
    return expert_quantizers_sharded_state_dict(
        module, prefix, sharded_offsets, num_local=int(module.num_gemms), sharding=sharding,
        sharded_axis=sharded_axis, weight_shape=None if weight is None else tuple(weight.shape), owner=module)


def _sequential_mlp_ep_size(module: nn.Module) -> int | None:
    ep = getattr(module, "ep_group", None)
    if ep is not None and hasattr(module, "local_experts"):
        return get_pg_size(ep)
    pgc = getattr(module, "_pg_collection", None)
    if pgc is not None and getattr(pgc, "ep", None) is not None and hasattr(module, "num_gemms"):
        return get_pg_size(pgc.ep)
    return None


register_expert_parallel_size(_sequential_mlp_ep_size)


# ---------------------------------------------------------------------------------------------------------------
# whole checkpoints


def _models(model_list) -> list[nn.Module]:
    return list(model_list) if isinstance(model_list, (list, tuple)) else [model_list]


def model_sharded_state_dict(model_list) -> dict:
    """``{"model": ...}`` (one chunk) or ``{"model0": ..., "model1": ...}``, as Megatron's training loop saves."""
    models = _models(model_list)
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def save_sharded_checkpoint(model_list, ckpt_dir: str | os.PathLike,
                            extra_sharded_state: Callable[[], dict] | None = None) -> None:
    """Saves weights, amaxes and quantization state so that an interrupted save leaves ``ckpt_dir`` as it was.

    Every rank writes into ``<ckpt_dir>.tmp`` (Megatron's ``dist_checkpointing.save``, which validates the sharding
    of every tensor); then rank 0 writes the quantization state and the completion marker and moves the directory
    into place. Collectives: two barriers and Megatron's own, the same on every rank; none of ours runs inside
    Megatron's save.

    Args:
        model_list: a model or a list of model chunks.
        ckpt_dir: the checkpoint directory (replaced if it exists).
        extra_sharded_state: optional ``() -> dict`` of more sharded entries (e.g. an optimizer's).
    """
    models = _models(model_list)
    clear_checkpoint_hint(models)  # a save is never shaped after a previously loaded checkpoint
    tmp = begin_checkpoint_dir(ckpt_dir)
    dist.barrier()
    state = model_sharded_state_dict(models)
    if extra_sharded_state is not None:
        state.update(extra_sharded_state())
    dist_checkpointing.save(state, str(tmp), validate_access_integrity=True)
    save_sharded_modelopt_state(models, tmp)
    commit_checkpoint_dir(tmp, ckpt_dir)
    dist.barrier()


def load_sharded_checkpoint(model_list, ckpt_dir: str | os.PathLike, experts=None, strict: bool = True) -> None:
    """Restores the quantization state into (fresh or quantized) model chunks, then loads weights and amaxes.

    Args:
        model_list: a model or a list of model chunks, in any TP/EP layout.
        ckpt_dir: a checkpoint written by :func:`save_sharded_checkpoint` (or by ``dist_checkpointing.save`` plus
            ``save_sharded_modelopt_state``).
        experts: restore into these expert amax layouts (an ``ExpertsConfig`` or dict) instead of the saved ones.
        strict: passed to ``load_state_dict``.

    Raises:
        IncompleteCheckpointError: a partial checkpoint (names the directory and what is missing).
        CheckpointMismatchError: expert count, format or amax shape does not fit (names key, expected, found).
    """
    models = _models(model_list)
    path = resolve_checkpoint_dir(ckpt_dir)
    check_checkpoint_dir(path)
    try:
        restore_sharded_modelopt_state(models, path, experts)
        state = model_sharded_state_dict(models)
        loaded = dist_checkpointing.load(state, str(path))
    finally:
        clear_checkpoint_hint(models)
    if len(models) == 1:
        models[0].load_state_dict(loaded["model"], strict=strict)
    else:
        for i, m in enumerate(models):
            m.load_state_dict(loaded[f"model{i}"], strict=strict)
