"""Small real Megatron-Core MoE GPT models for the tests and the tools' CPU runs, on CPU (gloo) or GPU.

Typical use inside a rank started by :func:`modelopt_moe.launch.spawn`::

    import megatron_harness.models as mm

    mm.init_model_parallel(tp=2, ep=2, seed=1234)
    model = mm.build_moe_gpt(seed=1234)
    for batch in mm.text_batches(batch_size=2, seq_len=32, num_batches=4):
        loss = mm.lm_loss(model, batch)
    mm.destroy_model_parallel()

The parallel setup, the text batches and the measurements are the product's (re-exported here so a test rank needs
one import): :mod:`modelopt_moe.plugins.megatron.parallel`, :mod:`modelopt_moe.plugins.cli.text_data`,
:mod:`modelopt_moe.plugins.cli.evaluate`. What is defined here serves the tests alone.

Weights are initialised from the seed and each parameter's *global* name and index, independently of the
parallel layout: the same seed gives the same logical model at TP=1/EP=1, TP=2/EP=2 or any other layout, so
layouts can be compared without a checkpoint.

Experts are Megatron's ``SequentialMLP`` (``experts="sequential"``) or Megatron's ``TEGroupedMLP`` whose grouped
linears are :class:`MegatronGroupedLinear` (``experts="grouped"``): the project's ``GroupedLinear`` behind the
builder interface of Megatron's TE grouped linears, so the grouped-expert path runs without Transformer Engine (on
CPU too). Both kinds hold the same weights for the same seed and have the same checkpoint keys.

Tensor parallelism with MoE in training mode needs ``sequence_parallel=True`` (Megatron refuses MoE with TP > 1
otherwise), and Megatron's non-TE norm (``WrappedTorchNorm``) refuses sequence parallelism because its
parameters would not be marked for the tensor-parallel gradient all-reduce. We therefore build every norm with
:func:`sequence_parallel_norm`, a plain ``torch.nn.LayerNorm`` / ``RMSNorm`` whose parameters carry Megatron's
``sequence_parallel`` attribute, and put it into the layer spec: no Megatron code is patched.
:func:`build_moe_gpt` turns on sequence parallelism whenever TP > 1. Without Megatron's DDP wrapper, call
:func:`allreduce_sequence_parallel_grads` after ``backward()`` (what ``finalize_model_grads`` would do).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size

from modelopt_moe.plugins.cli.evaluate import (
    gather_logits,
    global_param_name,
    global_state,
    iter_params_with_global_names,
    lm_loss,
    loss_and_kl,
)
from modelopt_moe.plugins.cli.text_data import text_batches
from modelopt_moe.plugins.megatron.hf_model import split_gpt_overrides
from modelopt_moe.plugins.megatron.norms import sequence_parallel_norm
from modelopt_moe.plugins.megatron.parallel import destroy_model_parallel, init_model_parallel
from modelopt_moe.plugins.megatron.pipeline_state import layer_place
from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims
from modelopt_moe.quantization.conversion import QuantModuleRegistry
from modelopt_moe.quantization.nn import GroupedLinear

__all__ = [
    # the product's, re-exported
    "init_model_parallel",
    "destroy_model_parallel",
    "sequence_parallel_norm",
    "text_batches",
    "lm_loss",
    "gather_logits",
    "loss_and_kl",
    "iter_params_with_global_names",
    "global_state",
    # the tests'
    "parallel_layout",
    "build_moe_gpt",
    "allreduce_sequence_parallel_grads",
    "build_moe_layer",
    "MegatronGroupedLinear",
    "MegatronColumnParallelGroupedLinear",
    "MegatronRowParallelGroupedLinear",
    "grouped_mlp_spec",
]

_INIT_STD = 0.02


def parallel_layout() -> dict[str, int]:
    """This rank's place in the model-parallel layout: ``tp``, ``ep``, ``dp`` sizes and ``tp_rank``, ``ep_rank``."""
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
    }


# ---------------------------------------------------------------------------------------------------- grouped experts


class MegatronGroupedLinear(GroupedLinear):
    """The project's :class:`~modelopt_moe.quantization.nn.GroupedLinear` behind the builder interface of Megatron's
    ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``: ``TEGroupedMLP`` experts without Transformer
    Engine, on CPU or GPU.

    Built by ``TEGroupedMLP`` as ``cls(num_local_experts, input_size, output_size, *, config, init_method, bias,
    skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection, name=None)``; ``forward(x, tokens_per_expert)``
    returns ``(out, None)``, or ``(out without bias, [bias_i])`` when ``skip_bias_add`` and ``bias`` (TE's
    ``return_bias``). Parameters are ``weight0..weight{N-1}`` (``bias0..``), marked like Megatron marks TE's grouped
    expert parameters (``allreduce = False`` under expert parallelism, so DDP puts them in the expert-data-parallel
    buffers and reduces them over expert DP; ``tensor_model_parallel`` / ``partition_dim`` by ``parallel_mode``).
    :meth:`sharded_state_dict` maps ``weight{i}`` to the global expert axis like TE's ``_sharded_state_dict_grouped``,
    so ``TEGroupedMLP.sharded_state_dict`` gives ``SequentialMLP``'s keys.

    Expert tensor parallelism must be 1 (the local GEMM does no TP communication; Megatron's token dispatcher would,
    but that path is not exercised here).

    Args:
        parallel_mode: ``"column"`` (fc1: weights split on the output axis) or ``"row"`` (fc2: input axis).
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str,
        config: TransformerConfig,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        tp_comm_buffer_name: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
    ):
        del tp_comm_buffer_name, name  # TE userbuffer name and module name: nothing to use them for here
        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode={parallel_mode!r}: expected 'column' or 'row'")
        if not is_expert:
            raise ValueError(f"{type(self).__name__} only builds expert layers (is_expert=True), like TEGroupedLinear")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        if get_pg_size(pg_collection.expt_tp) != 1:
            raise NotImplementedError(
                f"{type(self).__name__}: expert tensor parallelism {get_pg_size(pg_collection.expt_tp)} > 1 is not "
                "supported; build with expert_tensor_parallel_size=1"
            )
        device = torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() else (
            torch.device("cuda", torch.cuda.current_device()))
        super().__init__(num_gemms, input_size, output_size, bias=bias, dtype=config.params_dtype, device=device)
        self.config = config
        self.parallel_mode = parallel_mode
        self.skip_bias_add = skip_bias_add
        # TE's return_bias: the bias is returned (for TEGroupedMLP._apply_bias to scale by the router probs).
        self.te_return_bias = skip_bias_add and bias
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        self._register_load_state_dict_pre_hook(self._drop_expert_extra_states, with_module=True)
        if config.perform_initialization:
            with torch.no_grad():
                for w in self.expert_weights():
                    init_method(w)
        # Megatron's _set_expert_parameter_attributes for TE grouped linears (ETP == 1 here, so nothing is
        # actually split, but the attributes say which axis would be).
        use_expert_pgs = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        for pname, param in self.named_parameters(recurse=False):
            param.allreduce = not use_expert_pgs
            is_weight = pname.startswith("weight")
            partitioned = is_weight or parallel_mode == "column"
            param.tensor_model_parallel = partitioned
            if partitioned:
                param.partition_dim = 1 if parallel_mode == "row" else 0
                param.partition_stride = 1

    def expert_biases(self) -> list[torch.Tensor] | None:
        """Biases added inside the GEMM; none when they are returned instead (``skip_bias_add``)."""
        return None if self.te_return_bias else super().expert_biases()

    def megatron_output(self, out: torch.Tensor):
        """``(out, bias)`` as Megatron's grouped linears return it."""
        if self.te_return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out, None

    def forward(self, x: torch.Tensor, m_splits):
        return self.megatron_output(super().forward(x, m_splits))

    def get_extra_state(self) -> None:
        """No extra state (like Megatron's ColumnParallelLinear): an ``_extra_state`` entry, as TE layers have."""
        return None

    @staticmethod
    def _drop_expert_extra_states(module, state_dict, prefix, *args) -> None:
        """A distributed checkpoint gives one ``_extra_state{i}`` per expert (see :meth:`sharded_state_dict`); like
        TE's grouped linear, keep the first as ``_extra_state`` (all are None here)."""
        for i in range(1, module.num_gemms):
            state_dict.pop(f"{prefix}_extra_state{i}", None)

    def set_extra_state(self, state: Any) -> None:
        del state

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Each ``weight{i}`` (``bias{i}``) as a tensor of global expert ``ep_rank * N + i`` under ``<prefix>weight``
        (``bias``), the way TE's ``_sharded_state_dict_grouped`` does: ``TEGroupedMLP`` renames ``linear_fc1.`` to
        ``<mlp>.experts.linear_fc1.``, giving ``SequentialMLP``'s keys and axes."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        axis = 1 if self.parallel_mode == "row" else 0
        ep = self._pg_collection.ep
        num_global = get_pg_size(ep) * self.num_gemms
        offset = get_pg_rank(ep) * self.num_gemms
        edp_rank = get_pg_rank(self._pg_collection.expt_dp)
        out = {}
        for i in range(self.num_gemms):
            g = offset + i
            local = {"weight": getattr(self, f"weight{i}"), "_extra_state": self.get_extra_state()}
            tp_axis_map = {"weight": axis}
            if self.use_bias:
                local["bias"] = getattr(self, f"bias{i}")
                if self.parallel_mode == "column":
                    tp_axis_map["bias"] = 0
            if singleton_local_shards:
                expert_prefix, offsets = f"{g}.{prefix}", tuple(sharded_offsets)
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (len(sharded_offsets), g, num_global))
            sub = make_sharded_tensors_for_checkpoint(local, expert_prefix, tp_axis_map, offsets,
                                                      tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])
            for key, entry in sub.items():
                entry.replica_id = (*entry.replica_id[:2], edp_rank)  # replicated over expert DP only
                kind = key[len(expert_prefix):]
                if kind == "_extra_state":
                    out[f"{prefix}_extra_state{'' if i == 0 else i}"] = entry
                else:
                    out[f"{prefix}{kind}{i}"] = entry
        return out


class MegatronColumnParallelGroupedLinear(MegatronGroupedLinear):
    """:class:`MegatronGroupedLinear` as ``TEColumnParallelGroupedLinear`` (``TEGroupedMLP.linear_fc1``)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs: Any):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class MegatronRowParallelGroupedLinear(MegatronGroupedLinear):
    """:class:`MegatronGroupedLinear` as ``TERowParallelGroupedLinear`` (``TEGroupedMLP.linear_fc2``)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs: Any):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)


def register_quantized_grouped_linears() -> None:
    """Tells ``mtq.quantize`` how to quantize :class:`MegatronGroupedLinear`: as a Megatron grouped expert linear of
    the declared tensor-parallel axis (what a user does for their own grouped linear class)."""
    from modelopt_moe.plugins.megatron.modules import QuantMegatronColumnGroupedLinear, QuantMegatronRowGroupedLinear

    QuantModuleRegistry.register(MegatronColumnParallelGroupedLinear, QuantMegatronColumnGroupedLinear)
    QuantModuleRegistry.register(MegatronRowParallelGroupedLinear, QuantMegatronRowGroupedLinear)


def grouped_mlp_spec(transformer_engine: bool = False):
    """Megatron's ``TEGroupedMLP`` expert builder, with :class:`MegatronGroupedLinear` linears (no TE needed) or
    with Transformer Engine's (``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``, GPU only)."""
    if transformer_engine:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        fc1, fc2 = TEColumnParallelGroupedLinear, TERowParallelGroupedLinear
    else:
        register_quantized_grouped_linears()
        fc1, fc2 = MegatronColumnParallelGroupedLinear, MegatronRowParallelGroupedLinear
    return functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=fc1, linear_fc2=fc2))


@torch.no_grad()
def _init_layout_independent(model: torch.nn.Module, seed: int, num_layers: int, num_local_experts: int) -> None:
    """Initialise every non-norm parameter from (seed, global name), then keep this rank's shard of it.

    Matrices get N(0, 0.02) (output projections N(0, 0.02/sqrt(2*num_layers)), Megatron's scaled init), vectors
    (biases) zeros; norms keep torch's ones/zeros. The full tensor is drawn on every rank and sliced the way
    Megatron's CPU initialisation slices a master weight (``partition_dim``, ``partition_stride``), so every
    layout holds the same logical weights.
    """
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    offset = layer_place(model)[0] if pipelined else 0
    norm_params = {
        id(p) for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) for p in m.parameters()
    }
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            continue
        if param.dim() < 2:
            param.zero_()
            continue
        is_expert = not getattr(param, "allreduce", True)
        size, rank = (etp_size, etp_rank) if is_expert else (tp_size, tp_rank)
        shape = list(param.shape)
        dim = getattr(param, "partition_dim", 0)
        stride = getattr(param, "partition_stride", 1)
        sharded = getattr(param, "tensor_model_parallel", False) and size > 1
        if sharded:
            shape[dim] *= size
        canonical = global_param_name(name, num_local_experts, ep_rank)
        if offset:  # the stage's local layer index -> the global one (pipeline parallelism)
            canonical = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.",
                               canonical)
        std = _INIT_STD
        if canonical.endswith(("linear_proj.weight", "linear_fc2.weight")):
            std = _INIT_STD / (2.0 * num_layers) ** 0.5
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(canonical.encode()))
        full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        if sharded:
            # Megatron's layout: cut into size*stride chunks; rank r holds chunks r, r+size, ... (stride 2 = GLU).
            chunks = torch.chunk(full, size * stride, dim=dim)
            full = torch.cat(chunks[rank::size], dim=dim)
        param.copy_(full)


def build_moe_gpt(
    num_layers: int = 2,
    hidden: int = 64,
    ffn_hidden: int = 128,
    num_experts: int = 4,
    vocab_size: int = 256,
    seq_len: int = 32,
    moe_router_topk: int = 2,
    params_dtype: torch.dtype = torch.float32,
    *,
    seed: int = 1234,
    experts: str = "sequential",
    vp_stage: int | None = None,
    **overrides: Any,
) -> GPTModel:
    """Build a small GPT whose every MLP is an MoE layer with ``SequentialMLP`` or grouped (non-TE) experts.

    Uses the current model-parallel layout (:func:`init_model_parallel` first): the embedding, attention and
    output layer are split over TP, the experts over EP (``num_experts / ep`` local experts per rank), with the
    allgather token dispatcher, RoPE, causal attention and sequence parallelism when TP > 1. Weights depend only on
    ``seed`` (see the module docstring), never on the layout. The model is on CPU without CUDA, on the current
    GPU otherwise, and in training mode.

    Args:
        num_layers: Transformer layers (all MoE).
        hidden: Hidden size; a multiple of 4 * TP (4 attention heads of hidden/4).
        ffn_hidden: Each expert's FFN hidden size.
        num_experts: Global number of experts; a multiple of EP.
        vocab_size: Vocabulary size (256 fits the byte-level :func:`text_batches`); a multiple of TP.
        seq_len: Maximum sequence length; a multiple of TP (sequence parallelism).
        moe_router_topk: Experts per token.
        params_dtype: Parameter dtype.
        seed: Weight seed.
        experts: ``"sequential"`` (Megatron's ``SequentialMLP`` of ``ColumnParallelLinear`` /
            ``RowParallelLinear``), ``"grouped"`` (Megatron's ``TEGroupedMLP`` with :class:`MegatronGroupedLinear`
            linears, ``moe_grouped_gemm=True``) or ``"te"`` (``TEGroupedMLP`` with Transformer Engine's grouped
            linears; GPU). All hold the same weights for the same seed.
        vp_stage: With virtual pipeline stages (``init_model_parallel(..., vpp=...)``): which of this stage's model
            chunks to build (build one per ``vp_stage`` in ``range(vpp)``; the list is the model).
        **overrides: Any ``TransformerConfig`` field (e.g. ``gated_linear_unit=True``, ``normalization="RMSNorm"``)
            or ``GPTModel`` argument (e.g. ``position_embedding_type="learned_absolute"``).

    Returns:
        The ``GPTModel``.

    Raises:
        TypeError: An override is neither a TransformerConfig field nor a GPTModel argument.
        ValueError: ``experts`` is not ``"sequential"``, ``"grouped"`` or ``"te"``.
    """
    if experts not in ("sequential", "grouped", "te"):
        raise ValueError(f"experts={experts!r}: expected 'sequential', 'grouped' or 'te'")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_moe_gpt: call init_model_parallel(tp, ep) first")
    apply_cpu_shims()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if (vp_stage is None) != (vpp == 1):
        raise ValueError(f"vp_stage={vp_stage} with {vpp} virtual pipeline stages: pass one of range({vpp}) exactly "
                         "when init_model_parallel was given vpp > 1")
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the expert-parallel size {ep}")
    cfg_over, model_over = split_gpt_overrides(overrides, "build_moe_gpt")
    on_gpu = torch.cuda.is_available()
    cfg_kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn_hidden,
        num_attention_heads=4,
        num_moe_experts=num_experts,
        moe_ffn_hidden_size=ffn_hidden,
        moe_router_topk=moe_router_topk,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=experts != "sequential",
        moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        # Megatron requires it for MoE with TP > 1 in training; our norms support it (sequence_parallel_norm).
        sequence_parallel=tp > 1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        use_cpu_initialization=not on_gpu,
        # _init_layout_independent sets every weight; Megatron's own init would only be overwritten.
        perform_initialization=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    if pp > 1:  # the layers split evenly over the stages; tensors between stages in the parameters' dtype
        cfg_kwargs.update(pipeline_model_parallel_size=pp, pipeline_dtype=params_dtype)
    if vpp > 1:
        cfg_kwargs.update(virtual_pipeline_model_parallel_size=vpp)
    cfg_kwargs.update(cfg_over)
    config = TransformerConfig(**cfg_kwargs)

    layer = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization=config.normalization
    )
    layer.submodules.input_layernorm = sequence_parallel_norm
    layer.submodules.pre_mlp_layernorm = sequence_parallel_norm
    if experts != "sequential":
        moe = layer.submodules.mlp  # functools.partial(MoELayer, submodules=MoESubmodules(...))
        moe_submodules = dataclasses.replace(moe.keywords["submodules"],
                                             experts=grouped_mlp_spec(transformer_engine=experts == "te"))
        layer.submodules.mlp = functools.partial(moe.func, *moe.args, **{**moe.keywords, "submodules": moe_submodules})
    block = TransformerBlockSubmodules(layer_specs=[layer] * (num_layers // (pp * vpp)),
                                       layer_norm=sequence_parallel_norm)
    model_kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        position_embedding_type="rope",
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
    )
    if vpp > 1:
        model_kwargs["vp_stage"] = vp_stage
    model_kwargs.update(model_over)
    model = GPTModel(config=config, transformer_layer_spec=block, **model_kwargs)
    if on_gpu:
        model = model.cuda()
    _init_layout_independent(model, seed, num_layers, num_experts // ep)
    return model


def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sum the gradients of sequence-parallel parameters (norms, router) over the tensor-parallel group.

    What Megatron's ``finalize_model_grads`` does for them when the model is wrapped in Megatron's DDP; call it
    after ``backward()`` on every rank when training without that wrapper. A no-op when TP == 1. The set of such
    parameters is the same on every TP rank, so the collectives match.
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.requires_grad:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=group)
            p.grad = grad


def build_moe_layer(
    *,
    transformer_engine: bool,
    num_experts: int = 8,
    hidden: int = 256,
    ffn_hidden: int = 512,
    moe_router_topk: int = 2,
    params_dtype: torch.dtype = torch.bfloat16,
    seed: int = 1234,
    **overrides: Any,
) -> torch.nn.Module:
    """One Megatron ``MoELayer`` (router, token dispatcher, experts) in the current parallel layout, on the GPU.

    ``transformer_engine=True`` builds ``TEGroupedMLP`` experts (``moe_grouped_gemm=True``, TE's
    ``GroupedLinear``), ``False`` builds ``SequentialMLP`` experts. Weights depend only on ``seed`` and each
    expert's *global* index (the router weight on ``seed`` alone), so both kinds and every EP layout hold the same
    logical layer. Needs a GPU (TE does not run on CPU).

    Args:
        transformer_engine: TE grouped experts or Megatron's sequential experts.
        num_experts: Global number of experts (a multiple of EP).
        hidden: Hidden size.
        ffn_hidden: Each expert's FFN size.
        moe_router_topk: Experts per token.
        params_dtype: Parameter dtype (bf16 sets ``bf16=True``).
        seed: Weight seed.
        **overrides: ``TransformerConfig`` fields.
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    ep = parallel_state.get_expert_model_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cfg = dict(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn_hidden, num_attention_heads=4,
        num_moe_experts=num_experts, moe_ffn_hidden_size=ffn_hidden, moe_router_topk=moe_router_topk,
        moe_grouped_gemm=transformer_engine,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, add_bias_linear=False,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1, sequence_parallel=tp > 1,
    )
    cfg.update(overrides)
    spec = get_moe_module_spec(use_te=transformer_engine, num_experts=num_experts, moe_grouped_gemm=transformer_engine)
    layer = spec(config=TransformerConfig(**cfg), pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda()
    n_local, ep_rank = num_experts // ep, parallel_state.get_expert_model_parallel_rank()
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(seed)
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=gen) * _INIT_STD)
        for i in range(n_local):
            g = ep_rank * n_local + i
            for gemm in ("linear_fc1", "linear_fc2"):
                if transformer_engine:
                    w = getattr(getattr(layer.experts, gemm), f"weight{i}")
                else:
                    w = getattr(layer.experts.local_experts[i], gemm).weight
                gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}.{gemm}.{g}".encode()))
                # a distinct magnitude per expert, so a wrong expert index shows in every comparison
                w.copy_(torch.randn(w.shape, generator=gen) * _INIT_STD * (1.0 + 0.25 * g))
    return layer
