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

An expert parameter's path holds ``{i}`` (the rank's local expert) and its canonical names ``{E}`` (the global
expert: local expert ``i`` of expert-parallel rank ``r`` is ``r * N_local + i``); it gathers over expert-TP, then over
expert parallelism. Alternatives in ``path`` are tried in order, the first present wins (Transformer Engine fuses the
input norm into the QKV linear; grouped experts hold ``weight{i}`` where sequential ones hold ``local_experts.{i}``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RULES", "PREDICATES", "Param", "MegatronTable", "LLAMA_MOE", "DEEPSEEK_V3", "GLM4_MOE"]

RULES = {"replicated": 1, "column": 1, "row": 1, "qkv": 3, "glu": 2}  # rule -> canonical tensors it holds

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
}


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
