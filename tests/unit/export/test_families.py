"""Hugging Face families (modelopt_moe/export/families.py): names and configs, checked against ``transformers``.

The names we write must be exactly the tensors ``transformers.save_pretrained`` writes for the same config, and the
configs we write must load into the ``transformers`` config classes with the values we meant.
"""

import pytest
import torch

from modelopt_moe.export import ExportError, get_family
from modelopt_moe.export.families import (
    FAMILIES,
    MoEArch,
    canonical_names,
    family_for_architecture,
    read_hf_config,
)


def _arch(family: str, **changes) -> MoEArch:
    base = dict(family=family, vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                head_dim=16, moe_ffn_hidden_size=32, num_experts=4, top_k=2, norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=128, qk_norm=family == "qwen3_moe", norm_topk_prob=True,
                router_aux_loss_coef=0.001)
    if family == "deepseek_v3":  # multi-latent attention, a dense first layer, shared experts, grouped sigmoid router
        base.update(num_kv_heads=4, qk_norm=False, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                    shared_expert_ffn_hidden_size=32, first_dense_layers=1, dense_ffn_hidden_size=96,
                    router_score_function="sigmoid", router_expert_bias=True, router_num_groups=2,
                    router_group_topk=1, routed_scaling_factor=2.5)
    if family == "glm4_moe":  # q/k/v biases, q/k norm, partial RoPE, a dense first layer, shared experts
        base.update(qk_norm=True, qkv_bias=True, rotary_percent=0.5, shared_expert_ffn_hidden_size=32,
                    first_dense_layers=1, dense_ffn_hidden_size=96, router_score_function="sigmoid",
                    router_expert_bias=True, routed_scaling_factor=2.5)
    if family == "gpt_oss":  # biases, sinks, alternating sliding windows, clamped SwiGLU, YaRN without truncation
        base.update(qkv_bias=True, linear_bias=True, attention_sinks=True, sliding_window=8, window_layers=(1, 0),
                    swiglu_limit=7.0, rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=32,
                    rope_truncate=False)
    if family == "qwen3_5_moe":  # a Gated DeltaNet layer then gated attention, a gated shared expert
        base.update(qk_norm=True, rotary_percent=0.25, shared_expert_ffn_hidden_size=32, shared_expert_gate=True,
                    linear_attention_layers=(1, 0), linear_conv_kernel=4, linear_num_key_heads=2,
                    linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=16,
                    attention_output_gate=True, zero_centered_norms=True)
    base.update(changes)
    return MoEArch(**base)


def _hf_model(family: str, arch: MoEArch):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in get_family(family).hf_config(arch).items()
                                  if k not in ("dtype", "torch_dtype")})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_names_are_what_transformers_saves(family, tie, tmp_path):
    arch = _arch(family, tie_word_embeddings=tie)
    model = _hf_model(family, arch)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    fam = get_family(family)
    ours = {fam.hf_tensor(c) for c in canonical_names(arch)}
    assert ours == saved
    for name in saved:
        assert fam.hf_tensor(fam.canonical_tensor(name)) == name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_round_trip_through_transformers(family):
    from transformers import AutoConfig

    arch = _arch(family, num_kv_heads=4, head_dim=32 if family == "qwen3_moe" else 16, norm_topk_prob=True)
    cfg = get_family(family).hf_config(arch, template={"bos_token_id": 7, "eos_token_id": 9, "rope_scaling": None})
    assert cfg["bos_token_id"] == 7
    assert "rope_scaling" not in cfg
    hf = AutoConfig.for_model(**cfg)
    assert type(hf).__name__ == {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
                                 "deepseek_v3": "DeepseekV3Config", "glm4_moe": "Glm4MoeConfig",
                                 "gpt_oss": "GptOssConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig"}[family]
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.num_experts_per_tok) == (64, 2, 4, 2)
    assert (hf.num_experts if family == "qwen3_5_moe" else hf.num_local_experts) == 4
    assert hf.rms_norm_eps == 1e-6
    assert get_family(family).arch_from_hf(hf.to_dict()) == arch
    assert get_family(family).arch_from_hf(cfg) == arch
    assert family_for_architecture(cfg) is get_family(family)


def test_qwen3_router_normalisation_survives_the_round_trip():
    fam = get_family("qwen3_moe")
    arch = _arch("qwen3_moe", norm_topk_prob=False)
    assert fam.arch_from_hf(fam.hf_config(arch)).norm_topk_prob is False
    with pytest.raises(ExportError, match="always renormalises"):
        get_family("mixtral").hf_config(_arch("mixtral", norm_topk_prob=False))


@pytest.mark.parametrize(("family", "key", "value", "match"), [
    ("qwen3_moe", "mlp_only_layers", [1], "dense MLP layers"),
    ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step=2"),
    ("qwen3_moe", "attention_bias", True, "attention_bias=True"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope scaling"),
    ("qwen3_moe", "hidden_act", "gelu", "hidden_act='gelu'"),
    ("mixtral", "sliding_window", 16, "sliding_window=16"),
    ("mixtral", "architectures", ["LlamaForCausalLM"], "expected MixtralForCausalLM"),
    ("gpt_oss", "swiglu_alpha", 1.5, "swiglu_alpha=1.5"),
    ("gpt_oss", "layer_types", ["chunked_attention", "full_attention"], "layer_types=.*'chunked_attention'"),
    ("gpt_oss", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                    "original_max_position_embeddings": 32, "attention_factor": 2.0},
     "rope_parameters.attention_factor=2.0"),
])
def test_unsupported_features_are_refused_by_name(family, key, value, match):
    cfg = get_family(family).hf_config(_arch(family))
    cfg[key] = value
    with pytest.raises(ExportError, match=match):
        get_family(family).arch_from_hf(cfg)


def test_unknown_family_and_architecture():
    with pytest.raises(ExportError, match=r"family='llama' is not supported; expected one of "
                                          r"\['deepseek_v3', 'glm4_moe', 'gpt_oss', 'mixtral', 'qwen3_5_moe', "
                                          r"'qwen3_moe'\]"):
        get_family("llama")
    assert get_family("Qwen3MoeForCausalLM").name == "qwen3_moe"
    with pytest.raises(ExportError, match="LlamaForCausalLM.*is not supported"):
        family_for_architecture({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ExportError, match="no tensor for canonical name 'layers.0.q_norm'"):
        get_family("mixtral").hf_module("layers.0.q_norm")
    assert get_family("mixtral").canonical("model.layers.0.mlp.gate") is None


def test_read_hf_config_errors(tmp_path):
    with pytest.raises(ExportError, match="no Hugging Face config"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        read_hf_config(tmp_path)
