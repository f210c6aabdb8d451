"""Megatron-Core GPT models from Hugging Face configs, and the architecture of a Megatron model (both directions of
the config mapping that export and import need).

:func:`build_megatron_model` builds the ``GPTModel`` of a supported family's config at the current parallel state
(``megatron.core.parallel_state``: TP, EP, expert-TP, PP: each stage builds its layers); :func:`megatron_arch` reads the
:class:`~modelopt_moe.export.MoEArch` back from a built model, refusing what a Hugging Face family cannot express.

The mapping (Hugging Face -> ``TransformerConfig``): ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads`` -> ``num_query_groups``, ``head_dim`` -> ``kv_channels``, ``rms_norm_eps`` ->
``layernorm_epsilon`` (RMSNorm), SiLU-gated experts (``gated_linear_unit``, ``activation_func=silu``, no biases),
``moe_intermediate_size`` (Mixtral: ``intermediate_size``) -> ``moe_ffn_hidden_size``, ``num_experts`` ->
``num_moe_experts``, ``num_experts_per_tok`` -> ``moe_router_topk`` with softmax routing (``norm_topk_prob``: top-k
then softmax, Megatron's default, equals softmax then renormalising the top k; without it ``moe_router_pre_softmax``),
Qwen3's q/k norm -> ``qk_layernorm``, ``router_aux_loss_coef`` -> ``moe_aux_loss_coeff``; ``GPTModel``: RoPE with
``rotary_base = rope_theta``, ``max_sequence_length = max_position_embeddings``, ``share_embeddings_and_output_weights
= tie_word_embeddings``. DeepSeek-V3 and GLM-4.5 add (:func:`_variant_config`): multi-latent attention
(``MLATransformerConfig``: ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``,
``v_head_dim``, YaRN), q/k/v biases (``add_qkv_bias``), partial RoPE (``rotary_percent``), dense first layers
(``moe_layer_freq``, one layer spec per layer), shared experts (``moe_shared_expert_intermediate_size``) and the
sigmoid router with expert bias, groups and scaling (``moe_router_*``). gpt-oss adds biases on every linear
(``add_bias_linear``), learnable attention sinks (``softmax_type="learnable"``), sliding-window layers
(``window_size``, ``window_attn_skip_freq``), the clamped SwiGLU (``quick_gelu``, ``glu_linear_offset=1``,
``activation_func_clamp_value``) and YaRN outside MLA (``position_embedding_type="yarn"``, :func:`_set_yarn`).
Qwen3.5 adds Megatron-Core's Gated DeltaNet layers (``experimental_attention_variant="gated_delta_net"``,
``linear_attention_freq``; built in the local spec by :mod:`.gated_delta_net`), the attention's output gate
(``attention_output_gate``), the shared expert's gate (``moe_shared_expert_gate``) and norms scaling by ``1 + weight``
(``layernorm_zero_centered_gamma``; :class:`~.norms.ZeroCenteredRMSNorm` in the local spec).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import is_layer_window_attention

from modelopt_moe.export.errors import ExportError
from modelopt_moe.export.families import MoEArch, family_for_architecture, get_family, read_hf_config
from modelopt_moe.plugins.megatron_cpu import cpu_sliding_window_mask, megatron_training_shims
from modelopt_moe.quantization.conversion import unwrap_model

from .expert_biases import expert_biases_trainable
from .mla_attention import LatentDotProductAttention
from .norms import sequence_parallel_norm, zero_centered_norm
from .pipeline_state import virtual_pipeline_size

__all__ = ["build_megatron_model", "megatron_arch", "split_gpt_overrides", "SPECS"]

SPECS = ("local", "te")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def split_gpt_overrides(overrides: dict[str, Any], caller: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Routes each override to ``TransformerConfig`` or ``GPTModel`` by name.

    Raises:
        TypeError: a name that is neither (names ``caller``).
    """
    config_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model_params = set(inspect.signature(GPTModel.__init__).parameters) - {"self", "config", "transformer_layer_spec"}
    cfg, mdl = {}, {}
    for key, value in overrides.items():
        if key in config_fields:
            cfg[key] = value
        elif key in model_params:
            mdl[key] = value
        else:
            raise TypeError(f"{caller}: unknown override {key!r} (neither a TransformerConfig field nor a "
                            f"GPTModel argument)")
    return cfg, mdl


def _dense(arch: MoEArch, layer: int) -> bool:
    return layer < arch.first_dense_layers


def _linear_attention(arch: MoEArch, layer: int) -> bool:
    return bool(arch.linear_attention_layers) and arch.linear_attention_layers[layer] == 1


def _norm(arch: MoEArch):
    """The norm builder: sequence-parallel RMSNorm, scaling by ``1 + weight`` where the family's norms do."""
    return zero_centered_norm if arch.zero_centered_norms else sequence_parallel_norm


def _local_layer(arch: MoEArch, dense: bool, linear: bool = False):
    """Megatron's local layer spec with norms that support sequence parallelism (q/k and latent norms included); under
    multi-latent attention, a core attention that takes differing query/key and value head sizes; a Gated DeltaNet
    in place of the attention of a linear-attention layer."""
    mla = arch.kv_lora_rank > 0
    norm = _norm(arch)
    layer = get_gpt_layer_local_spec(num_experts=None if dense else arch.num_experts, moe_grouped_gemm=False,
                                     qk_layernorm=arch.qk_norm or mla, multi_latent_attention=mla,
                                     normalization="RMSNorm")
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    attn = layer.submodules.self_attention.submodules
    if linear:
        from .gated_delta_net import gated_delta_net_spec

        layer.submodules.self_attention = gated_delta_net_spec()
    elif mla:
        attn.core_attention = LatentDotProductAttention
        attn.q_layernorm = norm
        attn.kv_layernorm = norm
    elif arch.qk_norm:
        attn.q_layernorm = norm
        attn.k_layernorm = norm
    return layer


def _local_layer_spec(arch: MoEArch):
    kinds = {(_dense(arch, L), _linear_attention(arch, L)) for L in range(arch.num_layers)}
    specs = {kind: _local_layer(arch, *kind) for kind in kinds}
    return TransformerBlockSubmodules(
        layer_specs=[specs[_dense(arch, L), _linear_attention(arch, L)] for L in range(arch.num_layers)],
        layer_norm=_norm(arch))


def _te_layer_spec(arch: MoEArch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    mla = arch.kv_lora_rank > 0

    def layer(dense: bool):
        return get_gpt_layer_with_transformer_engine_spec(num_experts=None if dense else arch.num_experts,
                                                          moe_grouped_gemm=True, qk_layernorm=arch.qk_norm or mla,
                                                          multi_latent_attention=mla)

    if not arch.first_dense_layers:
        return layer(False)
    from megatron.core.extensions.transformer_engine import TENorm

    specs = {dense: layer(dense) for dense in (False, True)}
    return TransformerBlockSubmodules(layer_specs=[specs[_dense(arch, L)] for L in range(arch.num_layers)],
                                      layer_norm=TENorm)


def _variant_config(arch: MoEArch) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of multi-latent attention, shared experts, dense first layers and the
    sigmoid router with expert bias and group-limited top-k (empty for a plain Llama-shaped MoE)."""
    kw: dict[str, Any] = {}
    if arch.kv_lora_rank:
        kw.update(multi_latent_attention=True, q_lora_rank=arch.q_lora_rank or None, kv_lora_rank=arch.kv_lora_rank,
                  qk_head_dim=arch.head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim,
                  rope_type="rope", rotary_base=arch.rope_theta, qk_layernorm=True,
                  num_query_groups=arch.num_attention_heads)
        if arch.rope_type == "yarn":
            kw.update(rope_type="yarn", rotary_scaling_factor=arch.rope_factor,
                      original_max_position_embeddings=arch.rope_original_max_position_embeddings,
                      beta_fast=arch.rope_beta_fast, beta_slow=arch.rope_beta_slow, mscale=arch.rope_mscale,
                      mscale_all_dim=arch.rope_mscale_all_dim)
    if arch.shared_expert_ffn_hidden_size:
        kw["moe_shared_expert_intermediate_size"] = arch.shared_expert_ffn_hidden_size
    if arch.first_dense_layers:
        kw.update(ffn_hidden_size=arch.dense_ffn_hidden_size,
                  moe_layer_freq=[0] * arch.first_dense_layers + [1] * (arch.num_layers - arch.first_dense_layers))
    if arch.router_score_function != "softmax":
        kw.update(moe_router_score_function=arch.router_score_function, moe_router_pre_softmax=False,
                  moe_router_dtype="fp32")  # transformers' router runs in fp32
    if arch.router_expert_bias:
        kw["moe_router_enable_expert_bias"] = True
    if arch.router_num_groups:
        kw.update(moe_router_num_groups=arch.router_num_groups, moe_router_group_topk=arch.router_group_topk)
    if arch.routed_scaling_factor != 1.0:
        kw["moe_router_topk_scaling_factor"] = arch.routed_scaling_factor
    if arch.linear_bias:
        kw.update(add_bias_linear=True, add_qkv_bias=True)
    if arch.attention_sinks:
        kw["softmax_type"] = "learnable"
    if arch.sliding_window:  # Megatron's window counts the keys before the query, transformers' the query too
        kw.update(window_size=(arch.sliding_window - 1, 0), window_attn_skip_freq=list(arch.window_layers))
    if arch.swiglu_limit:
        kw.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=arch.swiglu_limit)
    if arch.linear_attention_layers:
        kw.update(experimental_attention_variant="gated_delta_net",
                  linear_attention_freq=list(arch.linear_attention_layers),
                  linear_conv_kernel_dim=arch.linear_conv_kernel, linear_key_head_dim=arch.linear_key_head_dim,
                  linear_value_head_dim=arch.linear_value_head_dim, linear_num_key_heads=arch.linear_num_key_heads,
                  linear_num_value_heads=arch.linear_num_value_heads)
    if arch.attention_output_gate:
        kw["attention_output_gate"] = True
    if arch.shared_expert_gate:
        kw["moe_shared_expert_gate"] = True
    if arch.zero_centered_norms:
        kw["layernorm_zero_centered_gamma"] = True
    return kw


# YaRN outside multi-latent attention: GPTModel reads these attributes of the config (not dataclass fields)
_YARN_ATTRS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


def _set_yarn(config, arch: MoEArch) -> None:
    """YaRN for Llama's attention: the attention factor from the scaling factor alone (``mscale`` None), as
    transformers computes it without ``mscale`` / ``mscale_all_dim``."""
    values = (arch.rope_factor, arch.rope_original_max_position_embeddings, arch.rope_beta_fast, arch.rope_beta_slow,
              None, None, arch.rope_truncate)
    for attr, value in zip(_YARN_ATTRS, values, strict=True):
        setattr(config, attr, value)


def build_megatron_model(hf_dir_or_config, *, spec: str = "local", vp_stage: int | None = None,
                         **overrides: Any) -> GPTModel:
    """The Megatron-Core ``GPTModel`` of a Hugging Face config of a supported family, at the current parallel state.

    Megatron's model-parallel state must be initialised (:func:`modelopt_moe.plugins.megatron.init_model_parallel`,
    which also sets Megatron up for a machine without CUDA, or ``parallel_state.initialize_model_parallel`` after
    ``modelopt_moe.plugins.megatron_cpu.enable_cpu_megatron()``). Weights are
    Megatron's initialisation: load real ones with :func:`modelopt_moe.export.import_hf`.

    Args:
        hf_dir_or_config: a Hugging Face model directory, ``config.json`` or config dict.
        spec: ``local`` (Megatron-Core modules, ``SequentialMLP`` experts; CPU or GPU) or ``te`` (Transformer
            Engine layers, ``TEGroupedMLP`` experts; GPU).
        vp_stage: with virtual pipeline stages (``virtual_pipeline_model_parallel_size`` > 1), which of this stage's
            model chunks to build (build one per ``vp_stage`` in ``range(vpp)``: the list is the stage's model, as
            Megatron's interleaved schedule takes it, and :func:`~modelopt_moe.export.import_hf` loads a Hugging
            Face checkpoint into it); None without them.
        **overrides: ``TransformerConfig`` fields (e.g. ``params_dtype=torch.float32``,
            ``moe_token_dispatcher_type``) or ``GPTModel`` arguments.

    Returns:
        The model (CPU without CUDA, the current GPU otherwise), in training mode; with pipeline parallelism this
        rank's stage (its layers; the embedding on the first stage, the final norm and output layer on the last).
        ``SequentialMLP`` experts with biases (gpt-oss, local spec) train at every layout, expert-parallel size 1
        included (:mod:`~modelopt_moe.plugins.megatron.expert_biases`).

    Raises:
        ExportError: an unsupported architecture or feature, a ``spec`` other than local / te, a parallel layout
            the sizes do not divide, or a ``vp_stage`` that does not fit the virtual pipeline size.
        TypeError: an unknown override.
    """
    if spec not in SPECS:
        raise ExportError(f"spec={spec!r}: expected one of {SPECS}")
    if not parallel_state.model_parallel_is_initialized():
        raise ExportError("build_megatron_model: initialise Megatron's model parallel state first "
                          "(parallel_state.initialize_model_parallel)")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = virtual_pipeline_size()
    if (vp_stage is None) != (vpp == 1) or (vp_stage is not None and not 0 <= vp_stage < vpp):
        raise ExportError(f"build_megatron_model: vp_stage={vp_stage!r} with virtual_pipeline_model_parallel_size="
                          f"{vpp if vpp > 1 else None}: expected one of range({vpp}) with virtual pipeline stages, "
                          "None without them")
    cfg = read_hf_config(hf_dir_or_config)
    arch = family_for_architecture(cfg).arch_from_hf(cfg)
    if arch.num_layers % (pp * vpp):
        raise ExportError(f"build_megatron_model: num_hidden_layers={arch.num_layers} is not divisible by the "
                          f"pipeline parallel size {pp}" + (f" x {vpp} virtual stages" if vpp > 1 else "")
                          + " (expected the same number of layers on every stage)")
    if arch.kv_lora_rank and not arch.q_lora_rank:
        raise ExportError("build_megatron_model: q_lora_rank=None (multi-latent attention with a plain query "
                          "projection) is not supported: Megatron-Core's MLA with latent norms fuses a norm into "
                          "linear_q_proj, which the Hugging Face model does not have (expected a q_lora_rank)")
    if arch.linear_attention_layers and spec != "local":
        raise ExportError(f"build_megatron_model: spec={spec!r} for {arch.family} (Gated DeltaNet layers) is not "
                          "supported: Megatron-Core 0.19.2's Transformer Engine Gated DeltaNet spec builds its gated "
                          "output norm zero-centred like the model's other norms, where the Hugging Face model's is "
                          "not (expected spec='local')")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if arch.linear_bias and etp > 1:
        raise ExportError(f"build_megatron_model: expert tensor parallel size {etp} with expert biases "
                          f"({arch.family}: attention_bias=True) is not supported (layout TP {tp} x EP {ep} x "
                          f"expert-TP {etp}): Megatron-Core 0.19 keeps expert biases only with "
                          "expert_tensor_parallel_size=1 (expected 1; Megatron's default is the TP size)")
    sizes = [("vocab_size", tp, arch.vocab_size), ("num_key_value_heads", tp, arch.num_kv_heads),
             ("num_experts", ep, arch.num_experts), ("moe_intermediate_size", etp, arch.moe_ffn_hidden_size),
             ("q_lora_rank", tp, arch.q_lora_rank), ("kv_lora_rank + qk_rope_head_dim", tp,
                                                     arch.kv_lora_rank + arch.qk_rope_head_dim),
             ("shared experts' intermediate size", tp, arch.shared_expert_ffn_hidden_size),
             ("intermediate_size", tp, arch.dense_ffn_hidden_size),
             ("linear_num_key_heads", tp, arch.linear_num_key_heads),
             ("linear_num_value_heads", tp, arch.linear_num_value_heads)]
    for what, size, total in sizes:
        if total % size:
            raise ExportError(f"build_megatron_model: {what}={total} is not divisible by the parallel size {size}")
    cfg_over, model_over = split_gpt_overrides(overrides, "build_megatron_model")
    on_gpu = torch.cuda.is_available()
    params_dtype = cfg_over.pop("params_dtype", _DTYPES.get(arch.dtype, torch.bfloat16))
    config_kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.moe_ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, qk_layernorm=arch.qk_norm,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.top_k, moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob, moe_aux_loss_coeff=arch.router_aux_loss_coef,
        moe_grouped_gemm=spec == "te", moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1, params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not on_gpu, gradient_accumulation_fusion=False,
    )
    if pp > 1:  # the dtype of the activations sent between stages
        config_kwargs.update(pipeline_model_parallel_size=pp, pipeline_dtype=params_dtype)
    if vpp > 1:
        config_kwargs.update(virtual_pipeline_model_parallel_size=vpp)
    config_kwargs.update(_variant_config(arch))
    if arch.linear_attention_layers:
        from .gated_delta_net import torch_gated_delta_net

        if torch_gated_delta_net():  # no flash-linear-attention: Megatron's torch convolution and delta rule
            config_kwargs["deterministic_mode"] = True
    if not on_gpu and arch.sliding_window:
        cpu_sliding_window_mask()
    if not on_gpu:  # fused kernels that need CUDA
        config_kwargs.update(bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                             apply_rope_fusion=False, bias_activation_fusion=False)
    config_kwargs.update(cfg_over)
    config = (MLATransformerConfig if arch.kv_lora_rank else TransformerConfig)(**config_kwargs)
    yarn = arch.rope_type == "yarn" and not arch.kv_lora_rank
    if yarn:
        _set_yarn(config, arch)
    layer_spec = _local_layer_spec(arch) if spec == "local" else _te_layer_spec(arch)
    if pp > 1:  # this stage's (chunk's) layers (Megatron's block builds one layer per spec)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        layer_spec = dataclasses.replace(
            layer_spec,
            layer_specs=layer_spec.layer_specs[offset:offset + get_num_layers_to_build(config, vp_stage=vp_stage)])
    model_kwargs: dict[str, Any] = dict(
        vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="yarn" if yarn else "rope", rotary_percent=arch.rotary_percent,
        rotary_base=arch.rope_theta,
        share_embeddings_and_output_weights=arch.tie_word_embeddings, parallel_output=True,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
    )
    if vp_stage is not None:
        model_kwargs["vp_stage"] = vp_stage
    model_kwargs.update(model_over)
    # Tied embeddings across stages: Megatron moves the last stage's copy with .cuda() and all-reduces it from the
    # first stage's; without CUDA that needs the CPU shims of its training machinery.
    shims = megatron_training_shims() if pp > 1 and not on_gpu else contextlib.nullcontext()
    with shims:
        model = GPTModel(config=config, transformer_layer_spec=layer_spec, **model_kwargs)
    expert_biases_trainable(model)  # SequentialMLP expert biases at EP = expert-TP = 1 (gpt-oss, local spec)
    return model.cuda() if on_gpu else model


def _unsupported(what: str, value, expected) -> ExportError:
    return ExportError(f"Megatron model: {what}={value!r} has no Hugging Face equivalent in a supported family "
                       f"(expected {expected})")


def megatron_arch(model, family: str | None = None) -> MoEArch:
    """The architecture of a Megatron-Core ``GPTModel`` (possibly wrapped).

    Args:
        model: the model.
        family: the family to name (default: ``deepseek_v3`` with multi-latent attention, ``glm4_moe`` with a
            sigmoid router, ``qwen3_moe`` with query/key norm, ``mixtral`` otherwise).

    Raises:
        ExportError: not a GPTModel, or a feature no supported family has (names it).
    """
    m = unwrap_model(model)
    if not isinstance(m, GPTModel):
        raise ExportError(f"expected a Megatron-Core GPTModel, got {type(m).__name__}")
    c = m.config
    mla = bool(c.multi_latent_attention)
    checks = [
        ("normalization", c.normalization, ("RMSNorm",)),
        ("gated_linear_unit", c.gated_linear_unit, (True,)),
        ("add_bias_linear", c.add_bias_linear, (False, True)),
        ("softmax_type", c.softmax_type, ("vanilla", "learnable")),
        ("moe_router_score_function", c.moe_router_score_function, ("softmax", "sigmoid")),
        ("mtp_num_layers", c.mtp_num_layers, (None, 0)),
        ("rotary_interleaved", c.rotary_interleaved, (False,)),
        ("layernorm_zero_centered_gamma", c.layernorm_zero_centered_gamma, (False, True)),
        ("experimental_attention_variant", c.experimental_attention_variant, (None, "gated_delta_net")),
        ("position_embedding_type", m.position_embedding_type, ("rope", "yarn")),
        ("rope_scaling", m.rotary_scaling, (False,)),
    ]
    if mla:
        checks += [("rope_type", c.rope_type, ("rope", "yarn")),
                   ("qk_layernorm (the latent norms of MLA)", c.qk_layernorm, (True,))]
    for what, value, allowed in checks:
        if value not in allowed:
            raise _unsupported(what, value, " or ".join(map(repr, allowed)))
    if c.num_moe_experts is None:
        raise _unsupported("num_moe_experts", None, "an MoE model")
    if c.moe_apply_probs_on_input:
        raise ExportError("Megatron model: moe_apply_probs_on_input=True multiplies the router probability into the "
                          "experts' input (before linear_fc1); Qwen3-MoE, Mixtral and the serving engines (vLLM, "
                          "SGLang, TensorRT-LLM, transformers) multiply it into the expert output after down_proj, so "
                          "the exported model would compute something else (expected moe_apply_probs_on_input=False)")
    clamped = c.activation_func is quick_gelu and c.glu_linear_offset == 1.0 and c.activation_func_clamp_value
    if c.activation_func is not F.silu and not clamped:
        raise _unsupported("activation_func", getattr(c.activation_func, "__name__", c.activation_func),
                           "silu, or quick_gelu with glu_linear_offset=1 and activation_func_clamp_value (gpt-oss)")
    if c.activation_func is F.silu and (c.glu_linear_offset or c.activation_func_clamp_value is not None):
        raise _unsupported("glu_linear_offset / activation_func_clamp_value",
                           (c.glu_linear_offset, c.activation_func_clamp_value), "0.0 / None with silu")
    head_dim = c.qk_head_dim if mla else c.kv_channels
    scale = (head_dim + c.qk_pos_emb_head_dim) ** -0.5 if mla else head_dim ** -0.5
    if c.softmax_scale not in (None, scale):
        raise _unsupported("softmax_scale", c.softmax_scale, "1/sqrt(query head size)")
    first_dense = _first_dense_layers(c)
    sigmoid = c.moe_router_score_function == "sigmoid"
    gpt_oss = c.softmax_type == "learnable"
    gdn = c.experimental_attention_variant == "gated_delta_net"
    name = family or ("deepseek_v3" if mla else "glm4_moe" if sigmoid else "gpt_oss" if gpt_oss
                      else "qwen3_5_moe" if gdn else "qwen3_moe" if c.qk_layernorm else "mixtral")
    fam = get_family(name)
    qk_norm = bool(c.qk_layernorm) and not mla  # MLA's qk_layernorm are its latent norms
    if fam.qk_norm is not None and fam.qk_norm != qk_norm:
        raise ExportError(f"family {fam.name!r} {'has' if fam.qk_norm else 'has no'} query/key norm, the model has "
                          f"qk_layernorm={c.qk_layernorm}")
    aux = c.moe_aux_loss_coeff
    aux = float(aux[0] if isinstance(aux, list | tuple) else aux or 0.0)
    dtype = str(c.params_dtype).replace("torch.", "")
    arch = MoEArch(
        family=fam.name, vocab_size=int(m.vocab_size), hidden_size=c.hidden_size, num_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, num_kv_heads=c.num_query_groups or c.num_attention_heads,
        head_dim=head_dim, moe_ffn_hidden_size=c.moe_ffn_hidden_size, num_experts=c.num_moe_experts,
        top_k=c.moe_router_topk, norm_eps=c.layernorm_epsilon, rope_theta=float(m.rotary_base),
        max_position_embeddings=int(m.max_sequence_length),
        tie_word_embeddings=bool(m.share_embeddings_and_output_weights), qk_norm=qk_norm,
        norm_topk_prob=sigmoid or not c.moe_router_pre_softmax, router_aux_loss_coef=aux, dtype=dtype,
        kv_lora_rank=c.kv_lora_rank if mla else 0, q_lora_rank=(c.q_lora_rank or 0) if mla else 0,
        qk_rope_head_dim=c.qk_pos_emb_head_dim if mla else 0, v_head_dim=c.v_head_dim if mla else 0,
        shared_expert_ffn_hidden_size=c.moe_shared_expert_intermediate_size or 0, first_dense_layers=first_dense,
        dense_ffn_hidden_size=c.ffn_hidden_size if first_dense else 0,
        router_score_function=c.moe_router_score_function, router_expert_bias=bool(c.moe_router_enable_expert_bias),
        router_num_groups=c.moe_router_num_groups or 0, router_group_topk=c.moe_router_group_topk or 0,
        routed_scaling_factor=float(c.moe_router_topk_scaling_factor or 1.0),
        qkv_bias=bool(c.add_qkv_bias or c.add_bias_linear),  # Megatron biases linear_qkv under either
        rotary_percent=float(m.rotary_percent), linear_bias=bool(c.add_bias_linear),
        attention_sinks=c.softmax_type == "learnable", swiglu_limit=float(c.activation_func_clamp_value or 0.0),
        attention_output_gate=bool(c.attention_output_gate), shared_expert_gate=bool(c.moe_shared_expert_gate),
        zero_centered_norms=bool(c.layernorm_zero_centered_gamma), **(_linear_attention_fields(c) if gdn else {}),
        **_windows(c), **(_yarn(c, mla) if mla else _gpt_yarn(m)))
    fam.check(arch, "Megatron model")
    return arch


def _linear_attention_fields(c) -> dict[str, Any]:
    """The Gated DeltaNet layers (``linear_attention_freq``: one full-attention layer every N, or the per-layer list,
    1 a Gated DeltaNet) and their sizes."""
    freq = c.linear_attention_freq
    layers = (tuple(int(x) for x in freq) if isinstance(freq, list | tuple)
              else tuple(0 if (L + 1) % freq == 0 else 1 for L in range(c.num_layers)))
    return dict(linear_attention_layers=layers, linear_conv_kernel=c.linear_conv_kernel_dim,
                linear_num_key_heads=c.linear_num_key_heads, linear_key_head_dim=c.linear_key_head_dim,
                linear_num_value_heads=c.linear_num_value_heads, linear_value_head_dim=c.linear_value_head_dim)


def _yarn(c, mla: bool) -> dict[str, Any]:
    """MLA's YaRN rope scaling (empty for plain RoPE)."""
    if not mla or c.rope_type != "yarn":
        return {}
    return dict(rope_type="yarn", rope_factor=float(c.rotary_scaling_factor),
                rope_original_max_position_embeddings=int(c.original_max_position_embeddings),
                rope_beta_fast=float(c.beta_fast), rope_beta_slow=float(c.beta_slow), rope_mscale=float(c.mscale),
                rope_mscale_all_dim=float(c.mscale_all_dim))


def _gpt_yarn(m) -> dict[str, Any]:
    """YaRN outside multi-latent attention (:func:`_set_yarn`'s attributes; empty for plain RoPE)."""
    if m.position_embedding_type != "yarn":
        return {}
    c = m.config
    if getattr(c, "yarn_mscale", None) is not None or getattr(c, "yarn_mscale_all_dim", None) is not None:
        raise _unsupported("yarn_mscale / yarn_mscale_all_dim", (c.yarn_mscale, c.yarn_mscale_all_dim), "None")
    return dict(rope_type="yarn", rope_factor=float(c.yarn_rotary_scaling_factor),
                rope_original_max_position_embeddings=int(c.yarn_original_max_position_embeddings),
                rope_beta_fast=float(c.yarn_beta_fast), rope_beta_slow=float(c.yarn_beta_slow),
                rope_truncate=bool(c.yarn_correction_range_round_to_int))


def _windows(c) -> dict[str, Any]:
    """Sliding-window attention: the window in transformers' terms and which layers have it (empty without)."""
    if not c.window_size:
        return {}
    left, right = c.window_size
    if right != 0 or left < 0:
        raise _unsupported("window_size", c.window_size, "(window - 1, 0): a causal sliding window")
    layers = tuple(int(is_layer_window_attention(c.window_size, c.window_attn_skip_freq, L + 1))
                   for L in range(c.num_layers))
    return dict(sliding_window=left + 1, window_layers=layers)


def _first_dense_layers(c) -> int:
    """The number of dense layers before the first MoE layer (``moe_layer_freq``), refusing any other pattern."""
    freq = c.moe_layer_freq
    pattern = [1] * c.num_layers if freq == 1 else list(freq) if isinstance(freq, list | tuple) else None
    k = pattern.index(1) if pattern and 1 in pattern else -1
    if pattern is None or k < 0 or pattern != [0] * k + [1] * (c.num_layers - k):
        raise _unsupported("moe_layer_freq", freq, "1 or dense layers first, then MoE layers ([0, ..., 1, ...])")
    return k
