"""The Megatron <-> Hugging Face mapping of a family, as data: which Megatron parameter holds which canonical tensors,
and how its tensor-parallel shards gather into them.

A :class:`MegatronTable` lists every parameter of a Megatron-Core ``GPTModel`` by its path (strings only: the core
imports no Megatron), in three groups: before the layers (the embedding), per layer (``{L}`` the layer index) and after
them (final norm, output layer). Each :class:`Param` names the canonical tensors it holds (:mod:`.families`) and a
gather rule; one generic exporter and one generic importer (the Megatron adapter,
``modelopt_moe/plugins/megatron/hf_io.py``) walk the table, so a family whose Megatron layout is one already mapped
adds no code beside its Hugging Face names.

Gather rules (the parallel group is tensor-parallel, or expert-tensor-parallel for an expert's parameter):

* ``replicated``: every rank holds the whole tensor (norms, the router and its bias).
* ``column``: split along dim 0 (output rows: column-parallel linears, the vocab-parallel embedding).
* ``row``: split along dim 1 (input columns: row-parallel linears).
* ``qkv``: column-parallel fused attention input, rows ``[q heads; k; v]`` per query group -> ``q``, ``k``, ``v``.
* ``glu``: column-parallel gated fc1, each rank's rows ``[gate_r; up_r]`` -> ``gate``, ``up``.
* ``qkv_gate``: ``qkv`` with an output gate (Qwen3.5): rows ``[q heads; gate heads; k; v]`` per query group -> ``q``
  (Hugging Face's ``q_proj``: each head's query and gate rows, ``[q_h; gate_h]``), ``k``, ``v``.
* ``gdn_in``: a Gated DeltaNet's column-parallel input projection, each rank's rows ``[q_r; k_r; v_r; z_r; b_r; a_r]``
  -> ``qkv`` (``[q; k; v]``), ``z``, ``b``, ``a``.
* ``gdn_conv``: its depthwise convolution, each rank's channels ``[q_r; k_r; v_r]`` -> ``[q; k; v]``.
* ``stacked``: an expert's tensor, every expert's stacked into one tensor along a new dim 0, a weight transposed to
  ``[in, out]`` (Hugging Face's fused 3-D experts: gpt-oss's ``down_proj`` ``[E, I, H]``, its bias ``[E, H]``).
* ``stacked_glu``: the same for a gated fc1, gate and up interleaved along the output dim (gate the even, up the odd
  columns: gpt-oss's ``gate_up_proj`` ``[E, H, 2I]``, its bias ``[E, 2I]``).

A stacked parameter's canonical name has no ``{E}``: it is one tensor per layer. An expert parameter's path holds
``{i}`` (the rank's local expert) and its canonical names ``{E}`` (the global
expert: local expert ``i`` of expert-parallel rank ``r`` is ``r * N_local + i``); it gathers over expert-TP, then over
expert parallelism. Alternatives in ``path`` are tried in order, the first present wins (Transformer Engine fuses the
input norm into the QKV linear; grouped experts hold ``weight{i}`` where sequential ones hold ``local_experts.{i}``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RULES", "STACKED", "PREDICATES", "Param", "MegatronTable", "LLAMA_MOE", "DEEPSEEK_V3", "GLM4_MOE",
           "GPT_OSS", "QWEN3_5_MOE", "gdn_sections"]

RULES = {"replicated": 1, "column": 1, "row": 1, "qkv": 3, "glu": 2, "stacked": 1, "stacked_glu": 1, "qkv_gate": 3,
         "gdn_in": 4, "gdn_conv": 1}
STACKED = ("stacked", "stacked_glu")  # the rules that fuse every expert into one tensor

# when a parameter is present: a name, so that tables stay data (arch: MoEArch, L: layer index or None)
PREDICATES: dict[str, Callable] = {
    "qk_norm": lambda arch, L: arch.qk_norm,
    "untied": lambda arch, L: not arch.tie_word_embeddings,
    "q_lora": lambda arch, L: arch.q_lora_rank > 0,
    "no_q_lora": lambda arch, L: arch.q_lora_rank == 0,
    "dense": lambda arch, L: L is not None and L < arch.first_dense_layers,
    "moe": lambda arch, L: L is not None and L >= arch.first_dense_layers,
    "shared_experts": lambda arch, L: (L is not None and L >= arch.first_dense_layers
                                       and arch.shared_expert_ffn_hidden_size > 0),
    "qkv_bias": lambda arch, L: arch.qkv_bias,
    "expert_bias": lambda arch, L: L is not None and L >= arch.first_dense_layers and arch.router_expert_bias,
    "linear_bias": lambda arch, L: arch.linear_bias,
    "sinks": lambda arch, L: arch.attention_sinks,
    "linear_attention": lambda arch, L: L is not None and bool(arch.linear_attention_layers)
    and arch.linear_attention_layers[L] == 1,
    "full_attention": lambda arch, L: L is not None and not (arch.linear_attention_layers
                                                             and arch.linear_attention_layers[L] == 1),
    "shared_expert_gate": lambda arch, L: L is not None and arch.shared_expert_gate,
}


def gdn_sections(arch, rule: str) -> tuple[int, ...]:
    """The full sizes of a Gated DeltaNet parameter's sections along dim 0 (each split over TP): ``gdn_in``'s q, k, v,
    z, b, a; ``gdn_conv``'s q, k, v."""
    qk = arch.linear_num_key_heads * arch.linear_key_head_dim
    v = arch.linear_num_value_heads * arch.linear_value_head_dim
    if rule == "gdn_conv":
        return (qk, qk, v)
    return (qk, qk, v, v, arch.linear_num_value_heads, arch.linear_num_value_heads)


@dataclass(frozen=True)
class Param:
    """One Megatron parameter: where it is, the canonical tensors it holds, how its shards gather.

    Attributes:
        path: its path in the model (``decoder.layers.{L}.self_attention.linear_qkv.weight``), or alternatives, the
            first present wins.
        rule: the gather rule (:data:`RULES`).
        canonical: the canonical names it holds (``layers.{L}.q_proj``, ...): three for ``qkv``, two for ``glu``.
        linear: exported as a linear (a weight with quantizers) rather than a plain tensor.
        quantized: its quantizers are exported (False: the router, never quantized).
        holder: the module holding its quantizers (default: the parameter's module; experts: the expert block's
            GEMM, where the layer's expert quantizers live).
        when: the name of a predicate (:data:`PREDICATES`): the parameter exists only where it holds.
    """

    path: str | tuple[str, ...]
    rule: str
    canonical: str | tuple[str, ...]
    linear: bool = False
    quantized: bool = True
    holder: str | None = None
    when: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "path", (self.path,) if isinstance(self.path, str) else tuple(self.path))
        canonical = (self.canonical,) if isinstance(self.canonical, str) else tuple(self.canonical)
        object.__setattr__(self, "canonical", canonical)
        if self.rule not in RULES:
            raise ValueError(f"{self.path[0]}: rule {self.rule!r}, expected one of {sorted(RULES)}")
        if len(canonical) != RULES[self.rule]:
            raise ValueError(f"{self.path[0]}: rule {self.rule!r} holds {RULES[self.rule]} canonical tensors, "
                             f"the table names {len(canonical)}: {canonical}")
        if self.when is not None and self.when not in PREDICATES:
            raise ValueError(f"{self.path[0]}: when={self.when!r}, expected one of {sorted(PREDICATES)}")

    @property
    def expert(self) -> bool:
        """Whether this is an expert's parameter (one per local expert, gathered over expert-TP and EP)."""
        return "{i}" in self.path[0]

    def present(self, arch, layer: int | None = None) -> bool:
        """Whether ``arch`` has this parameter (in layer ``layer``)."""
        return self.when is None or bool(PREDICATES[self.when](arch, layer))


@dataclass(frozen=True)
class MegatronTable:
    """A Megatron ``GPTModel``'s parameters by group: embedding, each layer, final.

    Attributes:
        experts: the path of a layer's expert block (its local expert count), ``{L}`` the layer.
    """

    embedding: tuple[Param, ...]
    layer: tuple[Param, ...]
    final: tuple[Param, ...]
    experts: str = "decoder.layers.{L}.mlp.experts"

    def params(self, arch, layer: int | None = None) -> list[Param]:
        """The group's parameters present in ``arch``: the embedding's (``layer="embedding"``), layer ``layer``'s,
        or the final ones (``layer="final"``)."""
        group = {"embedding": self.embedding, "final": self.final}.get(layer, self.layer)
        return [p for p in group if p.present(arch, layer if isinstance(layer, int) else None)]


_LAYER = "decoder.layers.{L}."
_EXPERTS = _LAYER + "mlp.experts."

_ATTN = _LAYER + "self_attention."

# Llama's attention in Megatron-Core: fused QKV, optional per-head q/k norm; the input norm fused into TE's QKV linear.
_LLAMA_ATTENTION = (
    Param((_ATTN + "linear_qkv.layer_norm_weight", _LAYER + "input_layernorm.weight"), "replicated",
          "layers.{L}.input_norm"),
    Param(_ATTN + "linear_qkv.weight", "qkv", ("layers.{L}.q_proj", "layers.{L}.k_proj", "layers.{L}.v_proj"),
          linear=True),
    Param(_ATTN + "linear_qkv.bias", "qkv", ("layers.{L}.q_proj_bias", "layers.{L}.k_proj_bias",
                                             "layers.{L}.v_proj_bias"), when="qkv_bias"),
    Param(_ATTN + "linear_proj.weight", "row", "layers.{L}.o_proj", linear=True),
    Param(_ATTN + "q_layernorm.weight", "replicated", "layers.{L}.q_norm", when="qk_norm"),
    Param(_ATTN + "k_layernorm.weight", "replicated", "layers.{L}.k_norm", when="qk_norm"),
)

# Routed experts, sequential (local_experts.{i}) or grouped (weight{i}); their quantizers on the expert block's GEMMs.
_EXPERTS_MLP = (
    Param((_EXPERTS + "local_experts.{i}.linear_fc1.weight", _EXPERTS + "linear_fc1.weight{i}"), "glu",
          ("layers.{L}.experts.{E}.gate", "layers.{L}.experts.{E}.up"), linear=True,
          holder=_EXPERTS + "linear_fc1", when="moe"),
    Param((_EXPERTS + "local_experts.{i}.linear_fc2.weight", _EXPERTS + "linear_fc2.weight{i}"), "row",
          "layers.{L}.experts.{E}.down", linear=True, holder=_EXPERTS + "linear_fc2", when="moe"),
)

_EMBEDDING = (Param("embedding.word_embeddings.weight", "column", "embed_tokens"),)
_FINAL = (
    Param("decoder.final_layernorm.weight", "replicated", "norm"),
    Param("output_layer.weight", "column", "lm_head", linear=True, when="untied"),
)

# Megatron-Core's GPT MoE layer with Llama's attention (Qwen3-MoE, Mixtral): a softmax router without bias,
# SiLU-gated experts without biases.
LLAMA_MOE = MegatronTable(
    embedding=_EMBEDDING,
    layer=(
        *_LLAMA_ATTENTION,
        Param(_LAYER + "pre_mlp_layernorm.weight", "replicated", "layers.{L}.post_attn_norm"),
        Param(_LAYER + "mlp.router.weight", "replicated", "layers.{L}.router", linear=True, quantized=False),
        *_EXPERTS_MLP,
    ),
    final=_FINAL,
)

# DeepSeek-V3's MLP side (GLM-4.5's too): the first layers dense (their post-attention norm fused into TE's fc1), the
# others MoE with a sigmoid router and its expert bias, shared experts and routed ones.
_SIGMOID_MOE_MLP = (
    Param((_LAYER + "mlp.linear_fc1.layer_norm_weight", _LAYER + "pre_mlp_layernorm.weight"), "replicated",
          "layers.{L}.post_attn_norm", when="dense"),
    Param(_LAYER + "pre_mlp_layernorm.weight", "replicated", "layers.{L}.post_attn_norm", when="moe"),
    Param(_LAYER + "mlp.linear_fc1.weight", "glu", ("layers.{L}.mlp_gate", "layers.{L}.mlp_up"), linear=True,
          when="dense"),
    Param(_LAYER + "mlp.linear_fc2.weight", "row", "layers.{L}.mlp_down", linear=True, when="dense"),
    Param(_LAYER + "mlp.router.weight", "replicated", "layers.{L}.router", linear=True, quantized=False,
          when="moe"),
    Param(_LAYER + "mlp.router.expert_bias", "replicated", "layers.{L}.router_bias", when="expert_bias"),
    Param(_LAYER + "mlp.shared_experts.linear_fc1.weight", "glu",
          ("layers.{L}.shared_gate", "layers.{L}.shared_up"), linear=True, when="shared_experts"),
    Param(_LAYER + "mlp.shared_experts.linear_fc2.weight", "row", "layers.{L}.shared_down", linear=True,
          when="shared_experts"),
    *_EXPERTS_MLP,
)

# DeepSeek-V3's layer in Megatron-Core: multi-latent attention (the down projections column-parallel in Megatron's own
# modules, duplicated in Transformer Engine's, whose up projections hold the latent norms) and the sigmoid MoE side.
DEEPSEEK_V3 = MegatronTable(
    embedding=_EMBEDDING,
    layer=(
        Param(_LAYER + "input_layernorm.weight", "replicated", "layers.{L}.input_norm"),
        Param(_ATTN + "linear_q_proj.weight", "column", "layers.{L}.q_proj", linear=True, when="no_q_lora"),
        Param(_ATTN + "linear_q_down_proj.weight", "column", "layers.{L}.q_a_proj", linear=True, when="q_lora"),
        Param((_ATTN + "linear_q_up_proj.layer_norm_weight", _ATTN + "q_layernorm.weight"), "replicated",
              "layers.{L}.q_a_norm", when="q_lora"),
        Param(_ATTN + "linear_q_up_proj.weight", "column", "layers.{L}.q_b_proj", linear=True, when="q_lora"),
        Param(_ATTN + "linear_kv_down_proj.weight", "column", "layers.{L}.kv_a_proj", linear=True),
        Param((_ATTN + "linear_kv_up_proj.layer_norm_weight", _ATTN + "kv_layernorm.weight"), "replicated",
              "layers.{L}.kv_a_norm"),
        Param(_ATTN + "linear_kv_up_proj.weight", "column", "layers.{L}.kv_b_proj", linear=True),
        Param(_ATTN + "linear_proj.weight", "row", "layers.{L}.o_proj", linear=True),
        *_SIGMOID_MOE_MLP,
    ),
    final=_FINAL,
)

# GLM-4.5's layer: Llama's attention (q/k/v biases split per query group like the weight) and DeepSeek-V3's MLP side.
GLM4_MOE = MegatronTable(embedding=_EMBEDDING, layer=(*_LLAMA_ATTENTION, *_SIGMOID_MOE_MLP), final=_FINAL)

# gpt-oss's layer: Llama's attention with biases on q/k/v and o_proj and a learnable sink per head (Megatron's softmax
# offset, split over TP with the heads); a softmax router with bias; experts with biases, stored fused as 3-D tensors.
GPT_OSS = MegatronTable(
    embedding=_EMBEDDING,
    layer=(
        *_LLAMA_ATTENTION,
        Param(_ATTN + "linear_proj.bias", "replicated", "layers.{L}.o_proj_bias", when="linear_bias"),
        Param(_ATTN + "core_attention.softmax_offset", "column", "layers.{L}.sinks", when="sinks"),
        Param(_LAYER + "pre_mlp_layernorm.weight", "replicated", "layers.{L}.post_attn_norm"),
        Param(_LAYER + "mlp.router.weight", "replicated", "layers.{L}.router", linear=True, quantized=False),
        Param(_LAYER + "mlp.router.bias", "replicated", "layers.{L}.router_bias", when="linear_bias"),
        Param((_EXPERTS + "local_experts.{i}.linear_fc1.weight", _EXPERTS + "linear_fc1.weight{i}"),
              "stacked_glu", "layers.{L}.experts_gate_up", holder=_EXPERTS + "linear_fc1"),
        Param((_EXPERTS + "local_experts.{i}.linear_fc1.bias", _EXPERTS + "linear_fc1.bias{i}"),
              "stacked_glu", "layers.{L}.experts_gate_up_bias", when="linear_bias"),
        Param((_EXPERTS + "local_experts.{i}.linear_fc2.weight", _EXPERTS + "linear_fc2.weight{i}"),
              "stacked", "layers.{L}.experts_down", holder=_EXPERTS + "linear_fc2"),
        Param((_EXPERTS + "local_experts.{i}.linear_fc2.bias", _EXPERTS + "linear_fc2.bias{i}"),
              "stacked", "layers.{L}.experts_down_bias", when="linear_bias"),
    ),
    final=_FINAL,
)

# Qwen3.5's layer: gated attention (query and output gate in one projection, q/k norm) or a Gated DeltaNet
# (Megatron-Core's GatedDeltaNet: one input projection, a depthwise convolution, the decay's A_log and dt_bias, a gated
# output norm), then a softmax router, experts and a shared expert scaled by its sigmoid gate.
QWEN3_5_MOE = MegatronTable(
    embedding=_EMBEDDING,
    layer=(
        Param(_LAYER + "input_layernorm.weight", "replicated", "layers.{L}.input_norm"),
        Param(_ATTN + "linear_qkv.weight", "qkv_gate", ("layers.{L}.q_proj", "layers.{L}.k_proj", "layers.{L}.v_proj"),
              linear=True, when="full_attention"),
        Param(_ATTN + "linear_proj.weight", "row", "layers.{L}.o_proj", linear=True, when="full_attention"),
        Param(_ATTN + "q_layernorm.weight", "replicated", "layers.{L}.q_norm", when="full_attention"),
        Param(_ATTN + "k_layernorm.weight", "replicated", "layers.{L}.k_norm", when="full_attention"),
        Param(_ATTN + "in_proj.weight", "gdn_in", ("layers.{L}.gdn_in_qkv", "layers.{L}.gdn_in_z",
                                                   "layers.{L}.gdn_in_b", "layers.{L}.gdn_in_a"),
              linear=True, when="linear_attention"),
        Param(_ATTN + "conv1d.weight", "gdn_conv", "layers.{L}.gdn_conv", when="linear_attention"),
        Param(_ATTN + "dt_bias", "column", "layers.{L}.gdn_dt_bias", when="linear_attention"),
        Param(_ATTN + "A_log", "column", "layers.{L}.gdn_A_log", when="linear_attention"),
        Param(_ATTN + "out_norm.weight", "replicated", "layers.{L}.gdn_norm", when="linear_attention"),
        Param(_ATTN + "out_proj.weight", "row", "layers.{L}.gdn_out", linear=True, when="linear_attention"),
        Param(_LAYER + "pre_mlp_layernorm.weight", "replicated", "layers.{L}.post_attn_norm"),
        Param(_LAYER + "mlp.router.weight", "replicated", "layers.{L}.router", linear=True, quantized=False),
        Param(_LAYER + "mlp.shared_experts.linear_fc1.weight", "glu",
              ("layers.{L}.shared_gate", "layers.{L}.shared_up"), linear=True, when="shared_experts"),
        Param(_LAYER + "mlp.shared_experts.linear_fc2.weight", "row", "layers.{L}.shared_down", linear=True,
              when="shared_experts"),
        Param(_LAYER + "mlp.shared_experts.gate_weight", "replicated", "layers.{L}.shared_expert_gate", linear=True,
              quantized=False, when="shared_expert_gate"),
        *_EXPERTS_MLP,
    ),
    final=_FINAL,
)
