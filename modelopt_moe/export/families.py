"""Hugging Face model families: their config (to and from the framework-free :class:`MoEArch`), tensor names and
Megatron table (:mod:`.mapping`).

Every exported tensor has a *canonical* name that says what it is, independent of any framework::

    embed_tokens, norm, lm_head
    layers.{L}.input_norm, layers.{L}.post_attn_norm
    layers.{L}.q_proj, .k_proj, .v_proj, .o_proj, .q_norm, .k_norm
    layers.{L}.q_a_proj, .q_a_norm, .q_b_proj, .kv_a_proj, .kv_a_norm, .kv_b_proj    (multi-latent attention)
    layers.{L}.mlp_gate, .mlp_up, .mlp_down                                          (a dense layer's MLP)
    layers.{L}.router, .router_bias, .shared_gate, .shared_up, .shared_down
    layers.{L}.experts.{E}.gate, .up, .down

A :class:`Family` maps canonical names to its Hugging Face tensor names (``layer_tensors``) and back, a Hugging Face
``config.json`` to an :class:`MoEArch` and back, and names its Megatron table (``megatron``). Families:

* ``qwen3_moe`` (``Qwen3MoeForCausalLM``): per-head RMSNorm on queries and keys, router ``mlp.gate``, experts
  ``mlp.experts.E.{gate,up,down}_proj``; every layer MoE (``decoder_sparse_step`` 1, no ``mlp_only_layers``).
* ``mixtral`` (``MixtralForCausalLM``): no query/key norm, router ``block_sparse_moe.gate``, experts
  ``block_sparse_moe.experts.E.{w1,w3,w2}`` (gate, up, down) as ``transformers`` saves them.
* ``deepseek_v3`` (``DeepseekV3ForCausalLM``, Kimi-K2): multi-latent attention, dense first layers, shared experts,
  the sigmoid router with ``e_score_correction_bias`` and group-limited top-k.
* ``gpt_oss`` (``GptOssForCausalLM``): biases on every linear, attention sinks, alternating sliding-window layers,
  clamped SwiGLU, YaRN; experts stored fused as 3-D tensors (canonical ``experts_gate_up``, ``experts_down`` and
  their biases, one tensor per layer).
* ``qwen3_5_moe`` (``Qwen3_5MoeForCausalLM``): Gated DeltaNet layers (``gdn_*``) among gated attention layers
  (``q_proj`` holds each head's query and output gate), RMSNorms scaling by ``1 + weight``, a gated shared expert
  (``shared_*``, ``shared_expert_gate``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ExportError
from .mapping import DEEPSEEK_V3, GLM4_MOE, GPT_OSS, LLAMA_MOE, PREDICATES, QWEN3_5_MOE, MegatronTable

__all__ = ["MoEArch", "Family", "FAMILIES", "UNMAPPED", "get_family", "family_for_architecture", "read_hf_config",
           "canonical_names", "canonical_shapes", "register_family"]


@dataclass(frozen=True)
class MoEArch:
    """A decoder-only MoE transformer: what both a Hugging Face config and a Megatron model must agree on.

    Attributes:
        family: ``qwen3_moe`` or ``mixtral``.
        head_dim: the attention head size (``kv_channels``).
        moe_ffn_hidden_size: each expert's FFN size (``moe_intermediate_size`` / Mixtral's ``intermediate_size``).
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
        norm_topk_prob: the top-k router probabilities are renormalised to sum to 1 (Mixtral always).
        dtype: the checkpoint's parameter dtype name (``bfloat16``).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    moe_ffn_hidden_size: int
    num_experts: int
    top_k: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    dtype: str = "bfloat16"
    # multi-latent attention (DeepSeek): head_dim is then the query/key head size without RoPE
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE variants: shared experts, dense first layers, the sigmoid router with expert bias and group-limited top-k
    shared_expert_ffn_hidden_size: int = 0
    first_dense_layers: int = 0
    dense_ffn_hidden_size: int = 0
    router_score_function: str = "softmax"
    router_expert_bias: bool = False
    router_num_groups: int = 0
    router_group_topk: int = 0
    routed_scaling_factor: float = 1.0
    # Llama-shaped attention variants (GLM-4.5): biases on q/k/v, RoPE on the first fraction of each head
    qkv_bias: bool = False
    rotary_percent: float = 1.0
    # YaRN rope scaling (DeepSeek's form: mscale and mscale_all_dim as Megatron applies them)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True  # YaRN's correction range rounded to whole dimensions (gpt-oss: not)
    # gpt-oss: biases on every linear (attention, router, experts), attention sinks, sliding-window layers
    # (window_layers[L] 1: layer L attends to the last sliding_window tokens), clamped SwiGLU (+1 on the linear half)
    linear_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()
    swiglu_limit: float = 0.0
    # Qwen3.5: Gated DeltaNet layers (linear_attention_layers[L] 1) among gated attention ones (the output multiplied
    # by sigmoid of a gate the query projection also gives), a shared expert scaled by a sigmoid gate, and RMSNorms
    # that scale by (1 + weight) (the Gated DeltaNet's output norm excepted)
    linear_attention_layers: tuple[int, ...] = ()
    linear_conv_kernel: int = 0
    linear_num_key_heads: int = 0
    linear_key_head_dim: int = 0
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
    attention_output_gate: bool = False
    shared_expert_gate: bool = False
    zero_centered_norms: bool = False


# MoEArch fields beyond Llama's attention with a softmax-routed MoE MLP, at their plain values: a family expresses
# only those it lists in `Family.features`.
_PLAIN = {f: MoEArch.__dataclass_fields__[f].default for f in (
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "shared_expert_ffn_hidden_size",
    "first_dense_layers", "dense_ffn_hidden_size", "router_score_function", "router_expert_bias",
    "router_num_groups", "router_group_topk", "routed_scaling_factor", "qkv_bias", "rotary_percent", "rope_type",
    "rope_factor", "rope_original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
    "rope_mscale_all_dim", "rope_truncate", "linear_bias", "attention_sinks", "sliding_window", "window_layers",
    "swiglu_limit", "linear_attention_layers", "linear_conv_kernel", "linear_num_key_heads", "linear_key_head_dim",
    "linear_num_value_heads", "linear_value_head_dim", "attention_output_gate", "shared_expert_gate",
    "zero_centered_norms")}
# the fields only gpt-oss expresses
_GPT_OSS_FIELDS = frozenset({"rope_truncate", "linear_bias", "attention_sinks", "sliding_window", "window_layers",
                             "swiglu_limit"})
# the fields only Qwen3.5 expresses
_QWEN3_5_FIELDS = frozenset({"linear_attention_layers", "linear_conv_kernel", "linear_num_key_heads",
                             "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
                             "attention_output_gate", "shared_expert_gate", "zero_centered_norms"})


def _yarn(cfg: dict, where: str) -> dict[str, Any]:
    """YaRN rope scaling as transformers applies it to multi-latent attention, in Megatron's terms (empty for plain
    RoPE); refuses what Megatron's ``YarnRotaryEmbedding`` does not compute the same way (names the key)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {}
    if rope_type != "yarn":
        raise ExportError(f"{where}: rope scaling {params} is not supported (plain RoPE or YaRN only)")
    for key, allowed in (("attention_factor", (None,)), ("truncate", (None, True, False)),
                         ("partial_rotary_factor", (None, 1.0))):
        if params.get(key) not in allowed:
            raise ExportError(f"{where}: rope_parameters.{key}={params[key]!r} is not supported (expected one of "
                              f"{list(allowed)})")
    original = int(_require(params, "original_max_position_embeddings", f"{where}: rope_parameters"))
    factor = params.get("factor") or int(_require(cfg, "max_position_embeddings", where)) / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then scales cos/sin by get_mscale(factor) alone
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(rope_type="yarn", rope_factor=float(factor), rope_original_max_position_embeddings=original,
                rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1),
                rope_mscale=float(mscale), rope_mscale_all_dim=float(mscale_all_dim),
                rope_truncate=params.get("truncate") is not False)


def read_hf_config(hf_dir_or_config: str | os.PathLike | dict) -> dict:
    """A Hugging Face ``config.json`` as a dict, from a directory, a file or a dict (copied).

    Raises:
        ExportError: no ``config.json``, or not JSON.
    """
    if isinstance(hf_dir_or_config, dict):
        return json.loads(json.dumps(hf_dir_or_config))
    path = Path(hf_dir_or_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ExportError(f"no Hugging Face config at {path} (expected a model directory with config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON: {e}") from None


def _rope(cfg: dict, where: str) -> float:
    """``rope_theta`` from a config with ``rope_parameters`` (transformers 5) or top-level ``rope_theta``."""
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5's name, and the one published configs use
        scaling = cfg.get(key) or {}
        field = "rope_type" if "rope_type" in scaling else "type"
        if scaling.get(field) not in (None, "default"):
            raise ExportError(f"{where}: {key}.{field}={scaling[field]!r} (rope scaling {scaling}) is not supported "
                              "by this family (plain RoPE only: expected 'default')")
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ExportError(f"{where}: no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
    return float(theta)


def _rope_theta(cfg: dict, where: str) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ExportError(f"{where}: no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
    return float(theta)


def _require(cfg: dict, key: str, where: str):
    if cfg.get(key) is None:
        raise ExportError(f"{where}: key {key!r} is missing")
    return cfg[key]


def _expect(cfg: dict, key: str, allowed: tuple, where: str, default=None) -> None:
    value = cfg.get(key, default)
    if value not in allowed:
        raise ExportError(f"{where}: {key}={value!r} is not supported (expected one of {list(allowed)})")


class Family:
    """A Hugging Face MoE family: its tensor names, its Megatron table and its config mapping, as class attributes.

    ``layer_tensors`` maps a layer's canonical names (``q_proj``, ``experts.{E}.gate``) to the Hugging Face tensor
    inside ``model.layers.{L}`` (``self_attn.q_proj.weight``), in checkpoint order; ``optional`` names the
    :data:`~.mapping.PREDICATES` some of them need; ``megatron`` is the Megatron-Core layout (:mod:`.mapping`).
    """

    name: str
    architecture: str
    model_type: str
    qk_norm: bool
    top_tensors: dict[str, str] = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                                   "lm_head": "lm_head.weight"}
    layer_tensors: dict[str, str]
    optional: dict[str, str] = {"q_norm": "qk_norm", "k_norm": "qk_norm"}
    megatron: MegatronTable = LLAMA_MOE
    features: frozenset[str] = frozenset()  # the MoEArch fields of `_PLAIN` this family expresses
    keep_fp32: frozenset[str] = frozenset()  # tensor kinds (canonical names' last part) the family stores in fp32

    def tensor_dtype(self, canonical: str, dtype):
        """The dtype a plain tensor is written in: the export's, or float32 where the family keeps it so."""
        import torch

        return torch.float32 if canonical.rsplit(".", 1)[-1] in self.keep_fp32 else dtype

    def check(self, arch: MoEArch, where: str) -> None:
        """Refuses an architecture with a feature this family cannot express (names the field and value).

        Raises:
            ExportError: the feature.
        """
        for field, plain in _PLAIN.items():
            value = getattr(arch, field)
            if field not in self.features and value != plain:
                raise ExportError(f"{where}: {field}={value!r} has no {self.architecture} equivalent (expected "
                                  f"{plain!r})")

    # --- names -----------------------------------------------------------------------------------------------------
    def layer_names(self, arch: MoEArch, layer: int) -> list[str]:
        """Layer ``layer``'s canonical names in checkpoint order (experts expanded)."""
        present = [c for c in self.layer_tensors
                   if c not in self.optional or PREDICATES[self.optional[c]](arch, layer)]
        names, experts = [], [c for c in present if "{E}" in c]
        for c in present:
            if "{E}" not in c:
                names.append(f"layers.{layer}.{c}")
            elif c == experts[0]:  # expert by expert, each expert's tensors together
                names += [f"layers.{layer}." + k.format(E=e) for e in range(arch.num_experts) for k in experts]
        return names

    def hf_tensor(self, canonical: str) -> str:
        """The Hugging Face tensor name of a canonical name (``layers.3.experts.5.gate`` ->
        ``model.layers.3.mlp.experts.5.gate_proj.weight``).

        Raises:
            ExportError: a canonical name this family does not have.
        """
        if canonical in self.top_tensors:
            return self.top_tensors[canonical]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", canonical)
        if m:
            rest = m.group(2)
            e = re.fullmatch(r"experts\.(\d+)\.(\w+)", rest)
            key = f"experts.{{E}}.{e.group(2)}" if e else rest
            if key in self.layer_tensors:
                hf = self.layer_tensors[key].format(E=e.group(1)) if e else self.layer_tensors[key]
                return f"model.layers.{m.group(1)}.{hf}"
        raise ExportError(f"{self.architecture}: no tensor for canonical name {canonical!r}")

    def hf_module(self, canonical: str) -> str:
        """The Hugging Face module of a canonical weight (its tensor name without ``.weight``)."""
        return self.hf_tensor(canonical).removesuffix(".weight")

    def canonical_tensor(self, hf_tensor: str) -> str | None:
        """Inverse of :meth:`hf_tensor` (None: not a tensor of this family)."""
        for canonical, name in self.top_tensors.items():
            if hf_tensor == name:
                return canonical
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_tensor)
        if not m:
            return None
        layer, rest = m.groups()
        for canonical, name in self.layer_tensors.items():
            if "{E}" in name:
                e = re.fullmatch(re.escape(name).replace(re.escape("{E}"), r"(\d+)"), rest)
                if e:
                    return f"layers.{layer}." + canonical.format(E=e.group(1))
            elif rest == name:
                return f"layers.{layer}.{canonical}"
        return None

    def canonical(self, hf_module: str) -> str | None:
        """The canonical name of a Hugging Face module's weight (None: not a tensor of this family)."""
        return self.canonical_tensor(hf_module + ".weight")

    def shapes(self, arch: MoEArch) -> dict[str, tuple[int, ...]]:
        """The full Hugging Face shape of each kind of tensor (the last component of its canonical name; linears
        ``[out, in]``)."""
        h, d, inter = arch.hidden_size, arch.head_dim, arch.moe_ffn_hidden_size
        return {"input_norm": (h,), "post_attn_norm": (h,), "q_proj": (arch.num_attention_heads * d, h),
                "k_proj": (arch.num_kv_heads * d, h), "v_proj": (arch.num_kv_heads * d, h),
                "o_proj": (h, arch.num_attention_heads * d), "q_norm": (d,), "k_norm": (d,),
                "router": (arch.num_experts, h), "gate": (inter, h), "up": (inter, h), "down": (h, inter),
                "embed_tokens": (arch.vocab_size, h), "norm": (h,), "lm_head": (arch.vocab_size, h)}

    # --- config ----------------------------------------------------------------------------------------------------
    def arch_from_hf(self, cfg: dict) -> MoEArch:
        """The :class:`MoEArch` of a Hugging Face config of this family.

        Raises:
            ExportError: a missing key or a feature this project does not map (names the key and value).
        """
        raise NotImplementedError

    def hf_config(self, arch: MoEArch, template: dict | None = None) -> dict:
        """A Hugging Face ``config.json`` dict for ``arch``: the template's other keys (token ids, ...) kept, the
        architecture keys set from ``arch``."""
        cfg = dict(template or {})
        cfg.pop("quantization_config", None)
        head_dim = arch.head_dim
        cfg.update({
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_kv_heads,
            "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": arch.max_position_embeddings,
            "rms_norm_eps": arch.norm_eps, "rope_theta": arch.rope_theta,
            "rope_parameters": {"rope_theta": arch.rope_theta, "rope_type": "default"},
            "num_experts_per_tok": arch.top_k, "tie_word_embeddings": arch.tie_word_embeddings,
            "router_aux_loss_coef": arch.router_aux_loss_coef, "dtype": arch.dtype, "torch_dtype": arch.dtype,
        })
        cfg.pop("rope_scaling", None)
        return cfg

    def _common(self, cfg: dict, where: str) -> dict[str, Any]:
        archs = cfg.get("architectures") or [self.architecture]
        if self.architecture not in archs:
            raise ExportError(f"{where}: architectures={archs}, expected {self.architecture}")
        _expect(cfg, "hidden_act", ("silu",), where, "silu")
        hidden, heads = int(_require(cfg, "hidden_size", where)), int(_require(cfg, "num_attention_heads", where))
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        return dict(
            vocab_size=int(_require(cfg, "vocab_size", where)), hidden_size=hidden,
            num_layers=int(_require(cfg, "num_hidden_layers", where)), num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            top_k=int(_require(cfg, "num_experts_per_tok", where)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=_rope(cfg, where),
            max_position_embeddings=int(_require(cfg, "max_position_embeddings", where)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)), dtype=str(dtype).replace("torch.", ""))


# The attention block and norms: the same tensor names in both families (Llama's).
_ATTENTION = {"input_norm": "input_layernorm.weight",
              **{p: f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}}


class Qwen3MoeFamily(Family):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    qk_norm = True
    layer_tensors = {**_ATTENTION, "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
                     "post_attn_norm": "post_attention_layernorm.weight", "router": "mlp.gate.weight",
                     **{f"experts.{{E}}.{k}": f"mlp.experts.{{E}}.{k}_proj.weight" for k in ("gate", "up", "down")}}

    def arch_from_hf(self, cfg: dict) -> MoEArch:
        where = f"{self.architecture} config"
        common = self._common(cfg, where)
        _expect(cfg, "attention_bias", (False,), where, False)
        _expect(cfg, "use_sliding_window", (False,), where, False)
        _expect(cfg, "decoder_sparse_step", (1,), where, 1)
        if cfg.get("mlp_only_layers"):
            raise ExportError(f"{where}: mlp_only_layers={cfg['mlp_only_layers']} (dense MLP layers) is not "
                              "supported; every layer must be MoE")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if experts is None:
            raise ExportError(f"{where}: key 'num_experts' (or 'num_local_experts') is missing")
        return MoEArch(family=self.name, num_experts=int(experts),
                       moe_ffn_hidden_size=int(_require(cfg, "moe_intermediate_size", where)), qk_norm=True,
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), **common)

    def hf_config(self, arch: MoEArch, template: dict | None = None) -> dict:
        cfg = super().hf_config(arch, template)
        cfg.pop("num_local_experts", None)  # transformers 5 writes it; readers with transformers 4 know num_experts
        cfg.update({"num_experts": arch.num_experts, "moe_intermediate_size": arch.moe_ffn_hidden_size,
                    "intermediate_size": cfg.get("intermediate_size") or arch.moe_ffn_hidden_size,
                    "norm_topk_prob": arch.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "attention_bias": False, "use_sliding_window": False, "sliding_window": None})
        return cfg


class MixtralFamily(Family):
    name = "mixtral"
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    qk_norm = False
    layer_tensors = {**_ATTENTION, "post_attn_norm": "post_attention_layernorm.weight",
                     "router": "block_sparse_moe.gate.weight",
                     **{f"experts.{{E}}.{k}": f"block_sparse_moe.experts.{{E}}.{w}.weight"
                        for k, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}}

    def arch_from_hf(self, cfg: dict) -> MoEArch:
        where = f"{self.architecture} config"
        common = self._common(cfg, where)
        if cfg.get("sliding_window") not in (None, 0) and cfg["sliding_window"] < common["max_position_embeddings"]:
            raise ExportError(f"{where}: sliding_window={cfg['sliding_window']} is not supported (full attention "
                              "only)")
        if float(cfg.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise ExportError(f"{where}: router_jitter_noise={cfg['router_jitter_noise']} is not supported")
        return MoEArch(family=self.name, num_experts=int(_require(cfg, "num_local_experts", where)),
                       moe_ffn_hidden_size=int(_require(cfg, "intermediate_size", where)), qk_norm=False,
                       norm_topk_prob=True, **common)

    def hf_config(self, arch: MoEArch, template: dict | None = None) -> dict:
        if arch.qk_norm or not arch.norm_topk_prob:
            raise ExportError(f"{self.architecture} has no query/key norm and always renormalises the top-k router "
                              f"probabilities; the model has qk_norm={arch.qk_norm}, "
                              f"norm_topk_prob={arch.norm_topk_prob}")
        cfg = super().hf_config(arch, template)
        cfg.update({"num_local_experts": arch.num_experts, "intermediate_size": arch.moe_ffn_hidden_size,
                    "sliding_window": None, "router_jitter_noise": 0.0})
        if arch.head_dim == arch.hidden_size // arch.num_attention_heads:
            cfg["head_dim"] = None
        return cfg


def _sigmoid_moe(cfg: dict, where: str, common: dict) -> dict[str, Any]:
    """The MoE fields of DeepSeek-V3's layout (GLM-4.5's too): dense first layers, shared experts, the sigmoid router
    with ``e_score_correction_bias`` and group-limited top-k; refuses MTP layers and what Megatron routes otherwise."""
    _expect(cfg, "norm_topk_prob", (True,), where, True)  # Megatron's sigmoid router always renormalises
    _expect(cfg, "topk_method", ("noaux_tc",), where, "noaux_tc")
    _expect(cfg, "scoring_func", ("sigmoid",), where, "sigmoid")
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0
    if mtp:
        raise ExportError(f"{where}: num_nextn_predict_layers={mtp} (multi-token prediction layers) is not supported "
                          "(expected 0)")
    experts, top_k = int(_require(cfg, "n_routed_experts", where)), common["top_k"]
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if experts % groups or group_topk > groups:
        raise ExportError(f"{where}: n_group={groups}, topk_group={group_topk} do not divide n_routed_experts="
                          f"{experts} into groups")
    if groups > 1 and top_k != 2 * group_topk:  # each group is scored by its top 2 experts (Megatron: top k/g)
        raise ExportError(f"{where}: num_experts_per_tok={top_k} with topk_group={group_topk} is not supported "
                          f"(Megatron scores a group by its top num_experts_per_tok/topk_group experts, "
                          f"transformers by its top 2: expected num_experts_per_tok=2*topk_group)")
    shared = int(cfg.get("n_shared_experts") or 0)
    moe_inter = int(_require(cfg, "moe_intermediate_size", where))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if not 0 <= first_dense < common["num_layers"]:
        raise ExportError(f"{where}: first_k_dense_replace={first_dense}: expected 0 .. num_hidden_layers - 1")
    return dict(num_experts=experts, moe_ffn_hidden_size=moe_inter, norm_topk_prob=True,
                shared_expert_ffn_hidden_size=moe_inter * shared, first_dense_layers=first_dense,
                dense_ffn_hidden_size=int(_require(cfg, "intermediate_size", where)) if first_dense else 0,
                router_score_function="sigmoid", router_expert_bias=True,
                router_num_groups=groups if groups > 1 else 0, router_group_topk=group_topk if groups > 1 else 0,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def _sigmoid_moe_config(arch: MoEArch, architecture: str) -> dict[str, Any]:
    """Inverse of :func:`_sigmoid_moe`: the config keys of the MoE layout."""
    if arch.router_score_function != "sigmoid" or not arch.router_expert_bias:
        raise ExportError(f"{architecture} has a sigmoid router with expert bias; the model has "
                          f"router_score_function={arch.router_score_function!r}, "
                          f"router_expert_bias={arch.router_expert_bias}")
    shared = arch.shared_expert_ffn_hidden_size // arch.moe_ffn_hidden_size
    if shared * arch.moe_ffn_hidden_size != arch.shared_expert_ffn_hidden_size:
        raise ExportError(f"{architecture}: shared experts of size {arch.shared_expert_ffn_hidden_size} are not a "
                          f"multiple of moe_intermediate_size={arch.moe_ffn_hidden_size}")
    return {"n_routed_experts": arch.num_experts, "moe_intermediate_size": arch.moe_ffn_hidden_size,
            "n_shared_experts": shared, "first_k_dense_replace": arch.first_dense_layers,
            "intermediate_size": arch.dense_ffn_hidden_size or arch.moe_ffn_hidden_size,
            "n_group": arch.router_num_groups or 1, "topk_group": arch.router_group_topk or 1,
            "routed_scaling_factor": arch.routed_scaling_factor, "norm_topk_prob": True,
            "num_nextn_predict_layers": 0}


# DeepSeek-V3's MLP side (GLM-4.5's too): a dense layer's MLP, the router and its bias, shared and routed experts.
_SIGMOID_MOE_TENSORS = {
    "mlp_gate": "mlp.gate_proj.weight", "mlp_up": "mlp.up_proj.weight", "mlp_down": "mlp.down_proj.weight",
    "router": "mlp.gate.weight", "router_bias": "mlp.gate.e_score_correction_bias",
    "shared_gate": "mlp.shared_experts.gate_proj.weight", "shared_up": "mlp.shared_experts.up_proj.weight",
    "shared_down": "mlp.shared_experts.down_proj.weight",
    **{f"experts.{{E}}.{k}": f"mlp.experts.{{E}}.{k}_proj.weight" for k in ("gate", "up", "down")},
}
_SIGMOID_MOE_OPTIONAL = {
    **{k: "dense" for k in ("mlp_gate", "mlp_up", "mlp_down")},
    **{k: "moe" for k in ("router", "experts.{E}.gate", "experts.{E}.up", "experts.{E}.down")},
    "router_bias": "expert_bias", **{k: "shared_experts" for k in ("shared_gate", "shared_up", "shared_down")}}


def _sigmoid_moe_shapes(arch: MoEArch) -> dict[str, tuple[int, ...]]:
    h, shared, dense = arch.hidden_size, arch.shared_expert_ffn_hidden_size, arch.dense_ffn_hidden_size
    return {"mlp_gate": (dense, h), "mlp_up": (dense, h), "mlp_down": (h, dense), "router_bias": (arch.num_experts,),
            "shared_gate": (shared, h), "shared_up": (shared, h), "shared_down": (h, shared)}


class DeepseekV3Family(Family):
    """DeepSeek-V3 / R1 and Kimi-K2: multi-latent attention, the first ``first_k_dense_replace`` layers dense, the
    others MoE with shared experts and a sigmoid router with ``e_score_correction_bias`` and group-limited top-k."""

    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    qk_norm = False
    layer_tensors = {
        "input_norm": "input_layernorm.weight",
        "q_proj": "self_attn.q_proj.weight",
        "q_a_proj": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
        "q_b_proj": "self_attn.q_b_proj.weight",
        "kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight", "kv_a_norm": "self_attn.kv_a_layernorm.weight",
        "kv_b_proj": "self_attn.kv_b_proj.weight", "o_proj": "self_attn.o_proj.weight",
        "post_attn_norm": "post_attention_layernorm.weight", **_SIGMOID_MOE_TENSORS,
    }
    optional = {"q_proj": "no_q_lora", "q_a_proj": "q_lora", "q_a_norm": "q_lora", "q_b_proj": "q_lora",
                **_SIGMOID_MOE_OPTIONAL}
    megatron = DEEPSEEK_V3
    features = frozenset(_PLAIN) - _GPT_OSS_FIELDS - _QWEN3_5_FIELDS

    def shapes(self, arch: MoEArch) -> dict[str, tuple[int, ...]]:
        h, n = arch.hidden_size, arch.num_attention_heads
        qk, rope, v = arch.head_dim + arch.qk_rope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        return {**super().shapes(arch), **_sigmoid_moe_shapes(arch), "q_proj": (n * qk, h),
                "q_a_proj": (arch.q_lora_rank, h),
                "q_a_norm": (arch.q_lora_rank,), "q_b_proj": (n * qk, arch.q_lora_rank),
                "kv_a_proj": (arch.kv_lora_rank + rope, h), "kv_a_norm": (arch.kv_lora_rank,),
                "kv_b_proj": (n * (arch.head_dim + v), arch.kv_lora_rank), "o_proj": (h, n * v)}

    def _common(self, cfg: dict, where: str) -> dict[str, Any]:
        yarn = _yarn(cfg, where)
        plain = {**cfg, "rope_parameters": {"rope_theta": _rope_theta(cfg, where), "rope_type": "default"}}
        plain.pop("rope_scaling", None)
        return {**super()._common(plain, where), **yarn}

    def arch_from_hf(self, cfg: dict) -> MoEArch:
        where = f"{self.architecture} config"
        common = self._common(cfg, where)
        _expect(cfg, "attention_bias", (False,), where, False)
        _expect(cfg, "rope_interleave", (True,), where, True)  # Megatron's MLA applies RoPE to interleaved pairs
        _expect(cfg, "norm_topk_prob", (True,), where, True)  # Megatron's sigmoid router always renormalises
        _expect(cfg, "topk_method", ("noaux_tc",), where, "noaux_tc")
        _expect(cfg, "scoring_func", ("sigmoid",), where, "sigmoid")
        heads = common["num_attention_heads"]
        if common["num_kv_heads"] != heads:
            raise ExportError(f"{where}: num_key_value_heads={common['num_kv_heads']} is not supported (multi-latent "
                              f"attention expands keys and values per head: expected num_attention_heads={heads})")
        moe = _sigmoid_moe(cfg, where, common)
        common.update(head_dim=int(_require(cfg, "qk_nope_head_dim", where)))
        return MoEArch(
            family=self.name, qk_norm=False, kv_lora_rank=int(_require(cfg, "kv_lora_rank", where)),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_head_dim=int(_require(cfg, "qk_rope_head_dim", where)),
            v_head_dim=int(_require(cfg, "v_head_dim", where)), **moe, **common)

    def hf_config(self, arch: MoEArch, template: dict | None = None) -> dict:
        if arch.kv_lora_rank <= 0:
            raise ExportError(f"{self.architecture} has multi-latent attention; the model has kv_lora_rank=0")
        cfg = {**super().hf_config(arch, template), **_sigmoid_moe_config(arch, self.architecture)}
        cfg.update({"head_dim": arch.qk_rope_head_dim, "qk_nope_head_dim": arch.head_dim,
                    "qk_rope_head_dim": arch.qk_rope_head_dim, "qk_head_dim": arch.head_dim + arch.qk_rope_head_dim,
                    "v_head_dim": arch.v_head_dim, "kv_lora_rank": arch.kv_lora_rank,
                    "q_lora_rank": arch.q_lora_rank or None, "rope_interleave": True, "attention_bias": False})
        cfg.pop("num_mtp_layers", None)
        if arch.rope_type == "yarn":
            cfg["rope_parameters"] = {
                "rope_theta": arch.rope_theta, "rope_type": "yarn", "factor": arch.rope_factor,
                "original_max_position_embeddings": arch.rope_original_max_position_embeddings,
                "beta_fast": arch.rope_beta_fast, "beta_slow": arch.rope_beta_slow, "mscale": arch.rope_mscale,
                "mscale_all_dim": arch.rope_mscale_all_dim}
        return cfg


class Glm4MoeFamily(Family):
    """GLM-4.5 / 4.6 / 4.7 MoE: Llama's attention with q/k/v biases, optional per-head q/k norm and partial RoPE, and
    DeepSeek-V3's MoE side (dense first layers, shared experts, the sigmoid router with its bias kept in fp32)."""

    name = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    model_type = "glm4_moe"
    qk_norm = None  # optional (use_qk_norm): the model says
    layer_tensors = {**_ATTENTION, **{f"{p}_bias": f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")},
                     "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
                     "post_attn_norm": "post_attention_layernorm.weight", **_SIGMOID_MOE_TENSORS}
    optional = {"q_norm": "qk_norm", "k_norm": "qk_norm", **{f"{p}_bias": "qkv_bias" for p in ("q_proj", "k_proj",
                                                                                                  "v_proj")},
                **_SIGMOID_MOE_OPTIONAL}
    megatron = GLM4_MOE
    features = frozenset(_PLAIN) - _GPT_OSS_FIELDS - _QWEN3_5_FIELDS - {
        "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "rope_type", "rope_factor",
        "rope_original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
        "rope_mscale_all_dim"}
    keep_fp32 = frozenset({"router_bias"})  # transformers keeps e_score_correction_bias in fp32

    def shapes(self, arch: MoEArch) -> dict[str, tuple[int, ...]]:
        d = arch.head_dim
        return {**super().shapes(arch), **_sigmoid_moe_shapes(arch), "q_proj_bias": (arch.num_attention_heads * d,),
                "k_proj_bias": (arch.num_kv_heads * d,), "v_proj_bias": (arch.num_kv_heads * d,)}

    def arch_from_hf(self, cfg: dict) -> MoEArch:
        where = f"{self.architecture} config"
        common = self._common(cfg, where)
        params = cfg.get("rope_parameters") or {}
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        return MoEArch(family=self.name, qk_norm=bool(cfg.get("use_qk_norm", False)),
                       qkv_bias=bool(cfg.get("attention_bias", False)), rotary_percent=partial,
                       **_sigmoid_moe(cfg, where, common), **common)

    def hf_config(self, arch: MoEArch, template: dict | None = None) -> dict:
        cfg = {**super().hf_config(arch, template), **_sigmoid_moe_config(arch, self.architecture)}
        cfg["rope_parameters"]["partial_rotary_factor"] = arch.rotary_percent
        cfg.update({"use_qk_norm": arch.qk_norm, "attention_bias": arch.qkv_bias,
                    "partial_rotary_factor": arch.rotary_percent})
        cfg.pop("num_mtp_layers", None)
        return cfg


class GptOssFamily(Family):
    """gpt-oss: Llama's attention with biases and a learnable sink per head, alternating sliding-window and full
    layers, YaRN; a softmax router with bias over experts with biases and a clamped SwiGLU (``swiglu_limit``, the
    linear half offset by 1, the gate ``x * sigmoid(1.702 x)``), stored fused as 3-D tensors (``gate_up_proj``
    ``[E, H, 2I]`` with gate and up interleaved, ``down_proj`` ``[E, I, H]``)."""

    name = "gpt_oss"
    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    qk_norm = False
    layer_tensors = {
        "input_norm": "input_layernorm.weight",
        **{k: f"self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
           for k, w in ((p, "weight"), (f"{p}_bias", "bias"))},
        "sinks": "self_attn.sinks", "post_attn_norm": "post_attention_layernorm.weight",
        "router": "mlp.router.weight", "router_bias": "mlp.router.bias",
        "experts_gate_up": "mlp.experts.gate_up_proj", "experts_gate_up_bias": "mlp.experts.gate_up_proj_bias",
        "experts_down": "mlp.experts.down_proj", "experts_down_bias": "mlp.experts.down_proj_bias",
    }
    optional = {**{f"{p}_bias": "linear_bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                "router_bias": "linear_bias", "experts_gate_up_bias": "linear_bias",
                "experts_down_bias": "linear_bias", "sinks": "sinks"}
    megatron = GPT_OSS
    features = frozenset({"qkv_bias", "rope_type", "rope_factor", "rope_original_max_position_embeddings",
                          "rope_beta_fast", "rope_beta_slow", "rope_truncate"}) | _GPT_OSS_FIELDS
    _ALPHA = 1.702  # Megatron's quick_gelu: x * sigmoid(1.702 x)

    def shapes(self, arch: MoEArch) -> dict[str, tuple[int, ...]]:
        h, d, e, inter = arch.hidden_size, arch.head_dim, arch.num_experts, arch.moe_ffn_hidden_size
        return {**super().shapes(arch), "q_proj_bias": (arch.num_attention_heads * d,),
                "k_proj_bias": (arch.num_kv_heads * d,), "v_proj_bias": (arch.num_kv_heads * d,), "o_proj_bias": (h,),
                "sinks": (arch.num_attention_heads,), "router_bias": (e,), "experts_gate_up": (e, h, 2 * inter),
                "experts_gate_up_bias": (e, 2 * inter), "experts_down": (e, inter, h), "experts_down_bias": (e, h)}

    def _common(self, cfg: dict, where: str) -> dict[str, Any]:
        yarn = _yarn(cfg, where)
        plain = {**cfg, "rope_parameters": {"rope_theta": _rope_theta(cfg, where), "rope_type": "default"}}
        plain.pop("rope_scaling", None)
        return {**super()._common(plain, where), **yarn}

    def arch_from_hf(self, cfg: dict) -> MoEArch:
        where = f"{self.architecture} config"
        common = self._common(cfg, where)
        if float(cfg.get("swiglu_alpha", self._ALPHA)) != self._ALPHA:
            raise ExportError(f"{where}: swiglu_alpha={cfg['swiglu_alpha']} is not supported (Megatron's clamped "
                              f"GLU gates with quick_gelu: expected {self._ALPHA})")
        limit = float(_require(cfg, "swiglu_limit", where))
        if limit <= 0:
            raise ExportError(f"{where}: swiglu_limit={limit}: expected a positive clamp value")
        n = common["num_layers"]
        layer_types = list(cfg.get("layer_types") or ["full_attention"] * n)
        bad = [t for t in layer_types if t not in ("sliding_attention", "full_attention")]
        if len(layer_types) != n or bad:
            raise ExportError(f"{where}: layer_types={layer_types}: expected {n} of 'sliding_attention' / "
                              "'full_attention'")
        windows = tuple(int(t == "sliding_attention") for t in layer_types)
        window = int(cfg.get("sliding_window") or 0) if any(windows) else 0
        if any(windows) and window <= 0:
            raise ExportError(f"{where}: sliding_window={cfg.get('sliding_window')!r} with sliding_attention layers: "
                              "expected a positive window")
        bias = bool(cfg.get("attention_bias", False))
        return MoEArch(
            family=self.name, num_experts=int(_require(cfg, "num_local_experts", where)),
            moe_ffn_hidden_size=int(_require(cfg, "intermediate_size", where)), qk_norm=False, norm_topk_prob=True,
            qkv_bias=bias, linear_bias=bias, attention_sinks=True, sliding_window=window,
            window_layers=windows if window else (), swiglu_limit=limit, **common)

    def hf_config(self, arch: MoEArch, template: dict | None = None) -> dict:
        if not arch.attention_sinks or arch.swiglu_limit <= 0 or arch.qkv_bias != arch.linear_bias:
            raise ExportError(f"{self.architecture} has attention sinks, a clamped SwiGLU and biases on every linear "
                              f"or none; the model has attention_sinks={arch.attention_sinks}, swiglu_limit="
                              f"{arch.swiglu_limit}, qkv_bias={arch.qkv_bias}, linear_bias={arch.linear_bias}")
        cfg = super().hf_config(arch, template)
        cfg.update({"num_local_experts": arch.num_experts, "intermediate_size": arch.moe_ffn_hidden_size,
                    "attention_bias": arch.linear_bias, "swiglu_limit": arch.swiglu_limit,
                    "swiglu_alpha": self._ALPHA, "sliding_window": arch.sliding_window or None,
                    "layer_types": [("sliding_attention" if arch.window_layers and arch.window_layers[L] else
                                     "full_attention") for L in range(arch.num_layers)]})
        if arch.rope_type == "yarn":
            cfg["rope_parameters"] = {
                "rope_theta": arch.rope_theta, "rope_type": "yarn", "factor": arch.rope_factor,
                "original_max_position_embeddings": arch.rope_original_max_position_embeddings,
                "beta_fast": arch.rope_beta_fast, "beta_slow": arch.rope_beta_slow, "truncate": arch.rope_truncate}
        return cfg


class Qwen35MoeFamily(Family):
    """Qwen3.5 MoE (text): Gated DeltaNet layers (``layer_types`` ``linear_attention``) among gated attention layers
    (``q_proj`` gives each head's query and output gate, ``[q_h; gate_h]``), per-head q/k norm, RoPE on the first
    ``partial_rotary_factor`` of each head, RMSNorms that scale by ``1 + weight`` (the Gated DeltaNet's gated output
    norm by ``weight``); every layer MoE with a softmax router (top-k renormalised) and a shared expert scaled by
    ``sigmoid(shared_expert_gate(x))``; experts per expert on disk."""

    name = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForCausalLM"
    model_type = "qwen3_5_moe_text"
    qk_norm = True
    layer_tensors = {
        "input_norm": "input_layernorm.weight",
        **{p: f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
        **{f"gdn_{k}": f"linear_attn.{w}" for k, w in (
            ("in_qkv", "in_proj_qkv.weight"), ("in_z", "in_proj_z.weight"), ("in_b", "in_proj_b.weight"),
            ("in_a", "in_proj_a.weight"), ("conv", "conv1d.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
            ("norm", "norm.weight"), ("out", "out_proj.weight"))},
        "post_attn_norm": "post_attention_layernorm.weight", "router": "mlp.gate.weight",
        **{f"experts.{{E}}.{k}": f"mlp.experts.{{E}}.{k}_proj.weight" for k in ("gate", "up", "down")},
        **{f"shared_{k}": f"mlp.shared_expert.{k}_proj.weight" for k in ("gate", "up", "down")},
        "shared_expert_gate": "mlp.shared_expert_gate.weight",
    }
    optional = {**{p: "full_attention" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
                **{f"gdn_{k}": "linear_attention" for k in ("in_qkv", "in_z", "in_b", "in_a", "conv", "dt_bias",
                                                             "A_log", "norm", "out")},
                **{f"shared_{k}": "shared_experts" for k in ("gate", "up", "down")},
                "shared_expert_gate": "shared_expert_gate"}
    megatron = QWEN3_5_MOE
    features = frozenset({"shared_expert_ffn_hidden_size", "rotary_percent"}) | _QWEN3_5_FIELDS

    def shapes(self, arch: MoEArch) -> dict[str, tuple[int, ...]]:
        h, d, n = arch.hidden_size, arch.head_dim, arch.num_attention_heads
        qk = arch.linear_num_key_heads * arch.linear_key_head_dim
        hv, v = arch.linear_num_value_heads, arch.linear_num_value_heads * arch.linear_value_head_dim
        shared = arch.shared_expert_ffn_hidden_size
        return {**super().shapes(arch), "q_proj": (2 * n * d, h), "gdn_in_qkv": (2 * qk + v, h), "gdn_in_z": (v, h),
                "gdn_in_b": (hv, h), "gdn_in_a": (hv, h), "gdn_conv": (2 * qk + v, 1, arch.linear_conv_kernel),
                "gdn_dt_bias": (hv,), "gdn_A_log": (hv,), "gdn_norm": (arch.linear_value_head_dim,),
                "gdn_out": (h, v), "shared_gate": (shared, h), "shared_up": (shared, h), "shared_down": (h, shared),
                "shared_expert_gate": (1, h)}

    def arch_from_hf(self, cfg: dict) -> MoEArch:
        where = f"{self.architecture} config"
        params = cfg.get("rope_parameters") or {}
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)) or 1.0)
        # Text tokens have the same three MRoPE position ids: plain RoPE on the rotary part, whatever mrope_section
        common = self._common({**cfg, "rope_parameters": {k: v for k, v in params.items() if not k.startswith(
            "mrope")}}, where)
        _expect(cfg, "attention_bias", (False,), where, False)
        n = common["num_layers"]
        types = list(cfg.get("layer_types") or [])
        if len(types) != n or any(t not in ("linear_attention", "full_attention") for t in types):
            raise ExportError(f"{where}: layer_types={types}: expected {n} of 'linear_attention' / 'full_attention'")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return MoEArch(
            family=self.name, num_experts=int(_require(cfg, "num_experts", where)),
            moe_ffn_hidden_size=int(_require(cfg, "moe_intermediate_size", where)), qk_norm=True,
            norm_topk_prob=True, shared_expert_ffn_hidden_size=shared, shared_expert_gate=shared > 0,
            rotary_percent=partial, linear_attention_layers=tuple(int(t == "linear_attention") for t in types),
            linear_conv_kernel=int(_require(cfg, "linear_conv_kernel_dim", where)),
            linear_num_key_heads=int(_require(cfg, "linear_num_key_heads", where)),
            linear_key_head_dim=int(_require(cfg, "linear_key_head_dim", where)),
            linear_num_value_heads=int(_require(cfg, "linear_num_value_heads", where)),
            linear_value_head_dim=int(_require(cfg, "linear_value_head_dim", where)),
            attention_output_gate=True, zero_centered_norms=True, **common)

    def hf_config(self, arch: MoEArch, template: dict | None = None) -> dict:
        if not (arch.attention_output_gate and arch.zero_centered_norms and arch.qk_norm and arch.norm_topk_prob
                and arch.shared_expert_gate == (arch.shared_expert_ffn_hidden_size > 0)):
            raise ExportError(f"{self.architecture} has gated attention with q/k norm, (1 + weight) RMSNorms, a "
                              "renormalised top-k and a gated shared expert; the model has attention_output_gate="
                              f"{arch.attention_output_gate}, zero_centered_norms={arch.zero_centered_norms}, "
                              f"qk_norm={arch.qk_norm}, norm_topk_prob={arch.norm_topk_prob}, shared_expert_gate="
                              f"{arch.shared_expert_gate}")
        cfg = super().hf_config(arch, template)
        rope = {k: v for k, v in ((template or {}).get("rope_parameters") or {}).items() if k.startswith("mrope")}
        cfg["rope_parameters"].update(partial_rotary_factor=arch.rotary_percent, **rope)
        for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "intermediate_size",
                    "num_local_experts"):
            cfg.pop(key, None)
        cfg.update({"num_experts": arch.num_experts, "moe_intermediate_size": arch.moe_ffn_hidden_size,
                    "shared_expert_intermediate_size": arch.shared_expert_ffn_hidden_size, "attention_bias": False,
                    "layer_types": ["linear_attention" if t else "full_attention"
                                    for t in arch.linear_attention_layers],
                    "linear_conv_kernel_dim": arch.linear_conv_kernel,
                    "linear_num_key_heads": arch.linear_num_key_heads, "linear_key_head_dim": arch.linear_key_head_dim,
                    "linear_num_value_heads": arch.linear_num_value_heads,
                    "linear_value_head_dim": arch.linear_value_head_dim})
        return cfg


FAMILIES: dict[str, Family] = {f.name: f for f in (Qwen3MoeFamily(), MixtralFamily(), DeepseekV3Family(),
                                                   Glm4MoeFamily(), GptOssFamily(), Qwen35MoeFamily())}
_ARCHITECTURES = {f.architecture: f for f in FAMILIES.values()}


# Architectures known and not mapped, with the reason.
_QWEN3_5_MOE_VL = (
    "the published Qwen3.5 MoE checkpoints (Qwen3_5MoeForConditionalGeneration) hold a vision tower, name the text "
    "model's tensors model.language_model.* and carry multi-token-prediction weights (mtp.*); only the text model "
    "Qwen3_5MoeForCausalLM (model.layers.*, no mtp.*) is mapped: save its text model with transformers' "
    "Qwen3_5MoeForCausalLM first")
UNMAPPED: dict[str, str] = {"Qwen3_5MoeForConditionalGeneration": _QWEN3_5_MOE_VL}


def register_family(family: Family) -> Family:
    """Adds ``family`` (an instance of a :class:`Family` subclass) to the families import and export know, by its
    ``name`` and ``architecture``; returns it. A family of the same name or architecture is replaced.

    Raises:
        ExportError: a family without name, architecture, model type or tensor table.
    """
    for attr in ("name", "architecture", "model_type", "layer_tensors"):
        if not getattr(family, attr, None):
            raise ExportError(f"register_family: {type(family).__name__} has no {attr}")
    FAMILIES[family.name] = family
    _ARCHITECTURES[family.architecture] = family
    return family


def get_family(name: str) -> Family:
    """The family named ``name`` (``qwen3_moe``, ``mixtral``) or by its architecture (``Qwen3MoeForCausalLM``).

    Raises:
        ExportError: an unsupported family.
    """
    if name in FAMILIES:
        return FAMILIES[name]
    if name in _ARCHITECTURES:
        return _ARCHITECTURES[name]
    raise ExportError(f"family={name!r} is not supported; expected one of {sorted(FAMILIES)} "
                      f"(or {sorted(_ARCHITECTURES)})")


def family_for_architecture(cfg: dict) -> Family:
    """The family of a Hugging Face config (by ``architectures``, else ``model_type``).

    Raises:
        ExportError: an architecture no family covers (one known and not mapped, in ``UNMAPPED``, says why).
    """
    for arch in cfg.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    for arch in cfg.get("architectures") or []:
        if arch in UNMAPPED:
            raise ExportError(f"Hugging Face architectures={cfg.get('architectures')} (model_type="
                              f"{cfg.get('model_type')!r}) is not supported: {UNMAPPED[arch]}")
    if cfg.get("model_type") in FAMILIES:
        return FAMILIES[cfg["model_type"]]
    raise ExportError(f"Hugging Face architectures={cfg.get('architectures')} (model_type="
                      f"{cfg.get('model_type')!r}) is not supported; supported: {sorted(_ARCHITECTURES)}")


def canonical_names(arch: MoEArch) -> list[str]:
    """Every canonical tensor name of ``arch``, in checkpoint order (``lm_head`` absent with tied embeddings)."""
    fam = get_family(arch.family)
    names = ["embed_tokens"]
    for layer in range(arch.num_layers):
        names += fam.layer_names(arch, layer)
    names.append("norm")
    if not arch.tie_word_embeddings:
        names.append("lm_head")
    return names


def canonical_shapes(arch: MoEArch) -> dict[str, tuple[int, ...]]:
    """The full (unsharded) Hugging Face shape of every canonical tensor of ``arch`` (linears ``[out, in]``)."""
    shapes = get_family(arch.family).shapes(arch)
    return {name: shapes[name.rsplit(".", 1)[-1]] for name in canonical_names(arch)}
