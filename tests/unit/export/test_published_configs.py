"""The ``config.json`` files the families are published with: their YaRN rope scaling (DeepSeek-V3, Kimi-K2, gpt-oss)
maps to Megatron's YaRN as written on the Hub (the legacy ``rope_scaling`` key, ``type`` instead of ``rope_type``) and
as transformers 5.23 rewrites it (``rope_parameters``); their multi-token-prediction layers (DeepSeek-V3, GLM-4.5) are
refused naming the field and value; YaRN on a family that does not map it is refused naming the field.

The tiny checkpoints of tests/distributed (test_deepseek_v3.py, test_gpt_oss.py) prove that these YaRN settings give
transformers' logits; here the published files' own keys and sizes are read, without building anything.
"""

import pytest

from modelopt_moe.export import ExportError, get_family
from modelopt_moe.export.families import family_for_architecture

# deepseek-ai/DeepSeek-V3 config.json (quantization_config left out: FP8 weights are dequantized before import)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}
# Kimi-K2's changes to it: no MTP layer, one expert group, YaRN with beta_fast 1
KIMI_K2 = {**DEEPSEEK_V3, "num_nextn_predict_layers": 0, "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
           "num_attention_heads": 64, "num_key_value_heads": 64, "first_k_dense_replace": 1, "rope_theta": 50000.0,
           "max_position_embeddings": 131072, "vocab_size": 163840, "routed_scaling_factor": 2.827,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}}
# openai/gpt-oss-20b config.json (quantization_config left out: MXFP4 experts are dequantized before import)
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}
# zai-org/GLM-4.5-Air config.json
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408,
    "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_qk_norm": False, "vocab_size": 151552,
}

_YARN_FIELDS = ("rope_type", "rope_factor", "rope_original_max_position_embeddings", "rope_beta_fast",
                "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim", "rope_truncate")


def _transformers_form(cfg: dict) -> dict:
    """The config as transformers 5.23 writes it back (``rope_parameters``, ``rope_type``)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    config.architectures = cfg["architectures"]
    return config.to_dict()


@pytest.mark.parametrize(("name", "cfg", "expected"), [
    ("DeepSeek-V3 without its MTP layer", {**DEEPSEEK_V3, "num_nextn_predict_layers": 0},
     ("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0, True)),
    ("Kimi-K2", KIMI_K2, ("yarn", 32.0, 4096, 1.0, 1.0, 1.0, 1.0, True)),
    ("gpt-oss-20b", GPT_OSS, ("yarn", 32.0, 4096, 32.0, 1.0, 1.0, 0.0, False)),
])
def test_published_yarn_maps_as_written_and_as_transformers_rewrites_it(name, cfg, expected):
    family = family_for_architecture(cfg)
    arch = family.arch_from_hf(cfg)
    assert tuple(getattr(arch, f) for f in _YARN_FIELDS) == expected, name
    assert arch.rope_theta == float(cfg["rope_theta"])
    assert family.arch_from_hf(_transformers_form(cfg)) == arch, name
    # the exported config.json (transformers 5's keys) reads back to the same architecture
    assert family.arch_from_hf(family.hf_config(arch, cfg)) == arch, name


@pytest.mark.parametrize(("family", "cfg"), [("deepseek_v3", DEEPSEEK_V3), ("glm4_moe", GLM_45_AIR)])
def test_published_mtp_layers_are_refused_naming_the_field(family, cfg):
    for form in (cfg, _transformers_form(cfg)):
        with pytest.raises(ExportError, match=r"num_nextn_predict_layers=1 \(multi-token prediction layers\) is not "
                                              r"supported \(expected 0\)"):
            get_family(family).arch_from_hf(form)
    get_family(family).arch_from_hf({**cfg, "num_nextn_predict_layers": 0})  # the rest of the file maps


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_yarn_on_a_family_without_it_is_refused_naming_the_field(key):
    # Qwen3's documented long-context setting, as published configs add it (rope_scaling) and as transformers keeps it
    cfg = get_family("qwen3_moe").hf_config(get_family("qwen3_moe").arch_from_hf({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "max_position_embeddings": 128, "rope_theta": 1e6}))
    cfg.pop("rope_parameters")
    cfg[key] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    with pytest.raises(ExportError, match=rf"Qwen3MoeForCausalLM config: {key}.rope_type='yarn' \(rope scaling .*\) "
                                          r"is not supported by this family \(plain RoPE only: expected 'default'\)"):
        get_family("qwen3_moe").arch_from_hf(cfg)
