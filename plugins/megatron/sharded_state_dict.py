"""Megatron-Core sharded state dicts of quantizer amaxes.

Checkpoint keys and axes (``L`` = the layer axis Megatron's TransformerBlock prepends, ``E`` = global experts):

* dense (attention, dense MLP) linear ``<prefix>{input,weight,output}_quantizer._amax``: the amax as stored,
  replicated over TP and DP (replica_id ``(0, tp_rank, dp_rank)``); a per-channel weight amax along the TP-sharded
  weight axis (column-parallel axis 0, row-parallel axis 1) is TP-sharded on that axis (replica_id
  ``(0, 0, dp_rank)``).
* experts: ONE key per (layer, GEMM, quantizer kind), the same for every amax layout and for ``SequentialMLP`` and
  ``TEGroupedMLP``: ``...mlp.experts.experts.linear_fc{1,2}.{kind}._amax`` (beside Megatron's expert weight keys
  ``...mlp.experts.experts.linear_fc1.weight``), global shape ``[L, E]`` (per tensor) or ``[L, E, C]`` (per
  channel); where each rank's amax goes is :mod:`modelopt_moe.checkpoint.expert_axis`'s rule.

Every amax entry is a ``ShardedTensorFactory``: it builds the ShardedTensor(s) and merges what was loaded back into
the quantizer's own state-dict entry. A quantizer without an amax yet (a fresh model, possibly built on the meta
device) gets a zero placeholder of the right shape, so a fresh model loads.

Load-time checks ride on Megatron's own ``metadata`` argument: ``model.sharded_state_dict(metadata=
checkpoint_load_metadata(ckpt_dir))`` compares every amax's global shape with the checkpoint's (a clear error naming
the key, the expected and the found shape or expert count) and loads checkpoints written before the global expert
axis existed (one amax per layer, for every expert; a rank-0 warning).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import nn

from modelopt_moe.checkpoint.errors import CheckpointMismatchError
from modelopt_moe.checkpoint.expert_axis import (
    channel_is_sharded,
    classify_checkpoint_amax,
    expert_amax_placement,
    loaded_expert_amax,
)
from modelopt_moe.checkpoint.sharded import checkpoint_amax_shapes
from modelopt_moe.quantization.expert_quantizer import ExpertGemm, ExpertGrid, ExpertQuantizer
from modelopt_moe.quantization.nn.experts import QUANTIZER_KINDS
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer
from modelopt_moe.quantization.utils import warn_once

__all__ = [
    "METADATA_KEY",
    "checkpoint_load_metadata",
    "parallel_linear_quantizers_sharded_state_dict",
    "per_layer_quantizers_sharded_state_dict",
    "expert_quantizers_sharded_state_dict",
]

METADATA_KEY = "modelopt_moe_checkpoint"  # our entry in Megatron's sharded-state-dict metadata


def checkpoint_load_metadata(ckpt_dir, metadata: dict | None = None) -> dict:
    """Megatron ``metadata`` for ``model.sharded_state_dict(metadata=...)`` when loading ``ckpt_dir``: it carries
    the checkpoint's amax shapes so that the amax entries check them (and load legacy checkpoints). No collective.

    Args:
        ckpt_dir: the checkpoint about to be loaded.
        metadata: Megatron metadata to extend (copied, not modified).
    """
    out = dict(metadata or {})
    out[METADATA_KEY] = {"ckpt_dir": str(ckpt_dir), "amax_shapes": checkpoint_amax_shapes(ckpt_dir)}
    return out


def _loading(metadata: dict | None) -> dict | None:
    return (metadata or {}).get(METADATA_KEY)


def _module_device(module: nn.Module) -> torch.device:
    """Where the module's parameters live (CPU for a meta-device model, which loads after ``to_empty``)."""
    p = next(module.parameters(), None)
    return torch.device("cpu") if p is None or p.device.type == "meta" else p.device


def _is_saved(q: TensorQuantizer) -> bool:
    """Whether a checkpoint carries this quantizer's amax: it is enabled or holds an amax (e.g. after fold_weight).
    The same answer on every rank (enabled flags come from the config; calibration gives every rank an amax)."""
    return q.is_enabled or q.amax is not None


def _block_amax_data(q: TensorQuantizer, local_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The local block amaxes to save, or zeros of their shape for a fresh model about to load."""
    if q.block_amax is not None:
        return q.block_amax.detach()
    return torch.zeros(local_shape, device=device)


# ---------------------------------------------------------------------------------------------------------------
# dense (tensor-parallel) linears


def parallel_linear_quantizers_sharded_state_dict(module: nn.Module, prefix: str, sharded_offsets=(),
                                                  metadata: dict | None = None) -> dict:
    """Sharded entries for the quantizers of a quantized Megatron ``ColumnParallelLinear`` / ``RowParallelLinear``.

    Args:
        module: the quantized linear (has ``weight`` and ``sharded_axis``, the weight axis split over TP).
        prefix: its state-dict prefix.
        sharded_offsets: offsets prepended by the parents (Megatron's layer axis).
        metadata: Megatron's sharded-state-dict metadata (its ``dp_cp_group``, and our load-time checks).

    Returns:
        ``{state-dict key: ShardedTensorFactory}``.
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    loading = _loading(metadata)
    tp_group = getattr(module, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    tp_rank, tp_size, dp_rank = get_pg_rank(tp_group), get_pg_size(tp_group), get_pg_rank(metadata["dp_cp_group"])
    offsets = tuple(sharded_offsets)
    weight = module.weight
    out = {}
    for kind in QUANTIZER_KINDS:
        q = module._modules.get(kind)
        if not isinstance(q, TensorQuantizer) or not _is_saved(q):
            continue
        if q.static_block_scales and kind == "weight_quantizer":
            # [rows, K // 16] splits with the weight, on the weight's TP axis (blocks never straddle a shard).
            key = f"{prefix}{kind}._block_amax"
            data = _block_amax_data(q, (weight.shape[0], weight.shape[1] // 16), _module_device(module))
            out[key] = _dense_amax_entry(key, data, offsets, ((len(offsets) + module.sharded_axis, tp_rank, tp_size),),
                                         (0, 0, dp_rank), loading)
        sharded = channel_is_sharded(q, kind, module.sharded_axis)
        if q.static_block_size is not None:
            # [rows * blocks, 1] interleaves this rank's blocks with the other TP ranks' along the split weight.
            if tp_size > 1:
                raise NotImplementedError(f"{prefix}{kind}: static int blocks on a tensor-parallel linear (TP="
                                          f"{tp_size}) are not supported in checkpoints; use block_sizes.type: "
                                          "dynamic or TP=1")
            if q.amax is None and kind != "weight_quantizer":
                raise NotImplementedError(f"{prefix}{kind}: an uncalibrated static-block activation amax has no "
                                          "known shape; calibrate before saving or loading")
        if q.amax is not None:
            data = q.amax.detach()
        elif q.static_block_size is not None:
            k = weight.shape[-1]
            data = torch.zeros((weight.numel() // k * -(-k // q.static_block_size), 1), device=_module_device(module))
        elif q.axis is None:
            data = torch.zeros((), device=_module_device(module))
        else:  # a fresh per-channel quantizer: the amax shape follows the weight's channels
            shape = [1] * weight.dim()
            shape[q.axis % weight.dim()] = weight.shape[q.axis]
            data = torch.zeros(shape, device=_module_device(module))
        tp_offsets = ((len(offsets) + q.axis % 2, tp_rank, tp_size),) if sharded else ()
        replica_id = (0, 0 if sharded else tp_rank, dp_rank)
        key = f"{prefix}{kind}._amax"
        out[key] = _dense_amax_entry(key, data, offsets, tp_offsets, replica_id, loading)
    return out


def _check_global_shape(key: str, st: ShardedTensor, loading: dict | None) -> None:
    """Loading: the checkpoint's global shape of ``key`` is ``st``'s, or a CheckpointMismatchError naming both."""
    if loading is None:
        return
    found = loading["amax_shapes"].get(key)
    if found is None or tuple(found) != st.global_shape:
        raise CheckpointMismatchError(
            f"{key}: amax shape mismatch in checkpoint {loading['ckpt_dir']}: expected global shape "
            f"{st.global_shape}, found {None if found is None else tuple(found)}")


def _dense_amax_entry(key: str, data: torch.Tensor, offsets: tuple, tp_offsets: tuple, replica_id: tuple,
                      loading: dict | None) -> ShardedTensorFactory:
    """One dense amax entry: the ShardedTensor at ``offsets`` (+ a TP split), checked against the checkpoint's
    global shape when loading."""

    def build(key, data, replica_id, flattened_range):
        st = ShardedTensor.from_rank_offsets(key, data, *offsets, *tp_offsets, replica_id=replica_id,
                                             prepend_axis_num=len(offsets))
        _check_global_shape(key, st, loading)
        return st

    return ShardedTensorFactory(key, data, build, lambda loaded: loaded, replica_id)


def per_layer_quantizers_sharded_state_dict(module: nn.Module, kinds: tuple[str, ...], prefix: str,
                                            sharded_offsets=(), metadata: dict | None = None) -> dict:
    """Sharded entries of quantizers whose amax is one scalar per layer, the same on every TP and DP rank (the KV
    cache's ``k_bmm_quantizer`` / ``v_bmm_quantizer`` of a core attention, max-reduced over TP and DP): keys
    ``<prefix><kind>._amax`` of global shape ``[L]`` under Megatron's layer axis, replica_id ``(0, tp_rank,
    dp_rank)``, so they load at any TP / EP.

    Raises:
        NotImplementedError: an amax that is not a scalar (per channel or per static block: heads are split over TP).
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    loading = _loading(metadata)
    tp_group = getattr(module, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    replica_id = (0, get_pg_rank(tp_group), get_pg_rank(metadata["dp_cp_group"]))
    out = {}
    for kind in kinds:
        q = module._modules.get(kind)
        if not isinstance(q, TensorQuantizer) or not _is_saved(q):
            continue
        if q.amax is not None and q.amax.numel() != 1:
            raise NotImplementedError(f"{prefix}{kind}: amax of shape {tuple(q.amax.shape)}; checkpoints carry one "
                                      "amax per layer for this quantizer (axis: null)")
        data = q.amax.detach() if q.amax is not None else torch.zeros((), device=_module_device(module))
        key = f"{prefix}{kind}._amax"
        out[key] = _dense_amax_entry(key, data, tuple(sharded_offsets), (), replica_id, loading)
    return out


# ---------------------------------------------------------------------------------------------------------------
# experts


def expert_quantizers_sharded_state_dict(owner: nn.Module, gemm: ExpertGemm, grid: ExpertGrid, prefix: str,
                                         ckpt_prefix: str, sharded_offsets=(), metadata: dict | None = None) -> dict:
    """Sharded entries of one expert GEMM's quantizers (``gemm.quantizers.{input,weight,output}_quantizer``, any
    layout) on the global expert axis.

    Args:
        owner: the quantized module (for its device and config).
        gemm: the expert GEMM (its quantizers, local expert count, sharded weight axis, weight shape).
        grid: this rank's place in the expert grid.
        prefix: the state-dict prefix of the quantizers (``...linear_fc1.``): the keys ``load_state_dict`` expects.
        ckpt_prefix: the checkpoint key prefix (``...experts.linear_fc1.``, the same for ``SequentialMLP`` and
            ``TEGroupedMLP``).
        sharded_offsets: offsets prepended by the parents (the layer axis); the expert axis comes next.
        metadata: Megatron's metadata (our load-time checks).

    Returns:
        ``{state-dict key: ShardedTensorFactory}``.
    """
    offsets = tuple(sharded_offsets)
    out = {}
    for kind in QUANTIZER_KINDS:
        q: ExpertQuantizer = getattr(gemm.quantizers, kind)
        if not _is_saved(q):
            continue
        if q.static_block_scales and kind == "weight_quantizer":
            out.update(_expert_block_amax_entry(owner, q, gemm, grid, prefix, ckpt_prefix, offsets, metadata))
        place = expert_amax_placement(q, kind, gemm, grid, len(offsets))
        if place.channel_split and place.channel_split[1] > 1 and kind == "weight_quantizer" and \
                gemm.sharded_axis == 0 and getattr(getattr(owner, "config", None), "gated_linear_unit", False):
            raise NotImplementedError(f"{prefix}{kind}: a per-channel fc1 amax of a gated linear unit with expert "
                                      "tensor parallelism > 1 is not supported in checkpoints")
        spec = _ExpertEntry(q, place, offsets, f"{ckpt_prefix}{kind}._amax", _loading(metadata))
        data = place.local_data(q, _module_device(owner))
        if q.layout == "per_expert":  # one entry per view, under the view's own key
            for i in range(place.num_local):
                out[f"{prefix}{kind}.{i}._amax"] = spec.factory(data[i], expert=i)
        else:
            out[f"{prefix}{kind}._amax"] = spec.factory(data, expert=None)
    return out


def _expert_block_amax_entry(owner: nn.Module, q: ExpertQuantizer, gemm: ExpertGemm, grid: ExpertGrid, prefix: str,
                             ckpt_prefix: str, offsets: tuple, metadata: dict | None) -> dict:
    """Static block scales of expert weights: ``[L, E, rows, K // 16]`` under the global expert axis, every expert its
    own blocks whatever the amax layout (a block belongs to one expert's weight).

    With expert tensor parallelism the table splits with the weight over the expert-TP ranks, on the weight's own
    axis: fc1 (column-parallel) by rows, fc2 (row-parallel) by K in whole blocks of 16 (each rank's K is a multiple
    of 16, so no block straddles two ranks). A gated fc1 holds this rank's gate rows then its up rows: each half is
    its own fragment, as Megatron splits the gated weight itself (the global table is all gate rows, then all up
    rows), so any expert-TP loads any other.
    """
    rows, k = gemm.weight_shape
    data = _block_amax_data(q, (gemm.num_local, rows, k // 16), _module_device(owner))
    key = f"{ckpt_prefix}weight_quantizer._block_amax"
    loading = _loading(metadata)
    ax = len(offsets)
    expert_axis = (ax, grid.ep_rank, grid.ep_size)
    if grid.etp_size == 1:
        return {f"{prefix}weight_quantizer._block_amax": _dense_amax_entry(
            key, data, offsets, (expert_axis,), (0, grid.etp_rank, grid.edp_rank), loading)}
    replica_id = (0, 0, grid.edp_rank)  # every expert-TP rank writes its own part
    gated = gemm.sharded_axis == 0 and getattr(getattr(owner, "config", None), "gated_linear_unit", False)
    if not gated:
        split = (ax + 1 + gemm.sharded_axis, grid.etp_rank, grid.etp_size)
        return {f"{prefix}weight_quantizer._block_amax": _dense_amax_entry(
            key, data, offsets, (expert_axis, split), replica_id, loading)}
    return {f"{prefix}weight_quantizer._block_amax": _gated_block_amax_entry(key, data, offsets, expert_axis, grid,
                                                                             replica_id, loading)}


def _gated_block_amax_entry(key: str, data: torch.Tensor, offsets: tuple, expert_axis: tuple, grid: ExpertGrid,
                            replica_id: tuple, loading: dict | None) -> ShardedTensorFactory:
    """A gated fc1's ``[N, rows, K // 16]`` at expert-TP > 1: the gate half at fragment ``etp_rank`` and the up half
    at ``etp_rank + etp_size`` of ``2 * etp_size`` along the rows (Megatron's split of the gated weight)."""
    row_axis = len(offsets) + 1

    def build(key, data, replica_id, flattened_range):
        if data.shape[1] % 2:
            raise ValueError(f"{key}: a gated fc1 block amax needs an even number of rows, got {tuple(data.shape)}")
        parts = []
        for i, half in enumerate(torch.chunk(data, 2, dim=1)):
            split = (row_axis, grid.etp_rank + i * grid.etp_size, 2 * grid.etp_size)
            st = ShardedTensor.from_rank_offsets(key, half.contiguous(), *offsets, expert_axis, split,
                                                 replica_id=replica_id, prepend_axis_num=len(offsets))
            _check_global_shape(key, st, loading)
            parts.append(st)
        return parts

    def merge(loaded: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(loaded, dim=1)

    return ShardedTensorFactory(key, data, build, merge, replica_id)


class _ExpertEntry:
    """Builds and merges the sharded tensors of one expert quantizer's amax."""

    def __init__(self, q: ExpertQuantizer, place, offsets: tuple, key: str, loading: dict | None):
        self.q, self.place, self.offsets, self.key, self.loading = q, place, offsets, key, loading
        ax = len(offsets)
        self.chan = ((ax + 1, *place.channel_split),) if place.channel_split else ()
        self.legacy = False

    def _check(self, key: str) -> None:
        """Compares the global shape with the checkpoint's under the FINAL key (the parents rename keys after this
        entry is made; Megatron builds the factory with the renamed key)."""
        if self.loading is None:
            return
        outer = tuple(f for _, _, f in sorted(self.offsets))
        found = self.loading["amax_shapes"].get(key)
        kind = classify_checkpoint_amax(key, self.place.global_shape(outer), found, len(self.offsets),
                                        self.loading["ckpt_dir"])
        self.legacy = kind == "legacy"
        if self.legacy:
            warn_once(f"{key}: checkpoint {self.loading['ckpt_dir']} stores one amax per layer (global shape "
                      f"{found}, no expert axis; saved by an older version); every expert gets that amax")

    def factory(self, data: torch.Tensor, expert: int | None) -> ShardedTensorFactory:
        """``data``: expert ``expert``'s ``[*pe]`` (a per_expert view) or every local expert's ``[N or E, *pe]``."""
        place, ax = self.place, len(self.offsets)

        def build(key, data, replica_id, flattened_range):
            self._check(key)
            if self.legacy:  # the layer's one amax, without the expert axis; one writer (never saved again)
                chan = tuple((a - 1, r, f) for a, r, f in self.chan)
                local = data if expert is not None else data[0]
                return ShardedTensor.from_rank_offsets(key, torch.zeros_like(local), *self.offsets, *chan,
                                                       replica_id=place.single_writer_id, prepend_axis_num=ax)
            if place.whole:  # shared: the whole [E] chunk
                return ShardedTensor.from_rank_offsets(key, data, *self.offsets, *self.chan, replica_id=replica_id,
                                                       prepend_axis_num=ax)
            if expert is None:  # vectorized: the expert axis is the data's first axis
                return ShardedTensor.from_rank_offsets(
                    key, data, *self.offsets, (ax, place.first_expert // place.num_local,
                                           place.num_global // place.num_local),
                *self.chan, replica_id=replica_id, prepend_axis_num=ax)
            return ShardedTensor.from_rank_offsets(  # a per_expert view: a prepended expert axis
                key, data, *self.offsets, (ax, place.first_expert + expert, place.num_global), *self.chan,
                replica_id=replica_id, prepend_axis_num=ax + 1)

        def merge(loaded: torch.Tensor) -> torch.Tensor:
            loaded = loaded.float()
            if self.legacy:  # the layer's one amax for every expert
                return loaded if expert is not None else loaded.unsqueeze(0).expand(place.num_local,
                                                                                   *loaded.shape).contiguous()
            if expert is not None:
                return loaded
            return loaded_expert_amax(self.q, place, loaded)

        return ShardedTensorFactory(self.key, data, build, merge, place.replica_id)
