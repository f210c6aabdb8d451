"""The KV-cache presets: Model Optimizer 0.47's shapes and names, and the two ways README.md merges them into a model
preset (a YAML ``$import`` of both files, and the ``quant_cfg`` list merge Model Optimizer users write)."""

import pytest

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.config import to_config

CORE = "decoder.layers.0.self_attention.core_attention."
QKV = "decoder.layers.0.self_attention.linear_qkv."
# Model Optimizer 0.47's presets, as mtq.FP8_KV_CFG / mtq.NVFP4_KV_CFG print there
MODELOPT = {
    "FP8_KV_CFG": {"quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}]},
    "NVFP4_KV_CFG": {"quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {
        "num_bits": (2, 1), "effective_bits": 4.5,
        "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}}]},
}


def _resolved(cfg, name, cls="DotProductAttention"):
    got = to_config(cfg).resolve(name, cls)
    return None if got is None else (got.format, got.axis, got.block_size, got.enable)


@pytest.mark.parametrize("preset", sorted(MODELOPT))
def test_kv_presets_have_model_optimizers_shape_and_configure_k_and_v_alike(preset):
    ours = getattr(mtq, preset)
    assert list(ours) == ["quant_cfg"]
    for kind in ("k_bmm_quantizer", "v_bmm_quantizer"):
        assert _resolved(ours, CORE + kind) == _resolved(MODELOPT[preset], CORE + kind)
        assert _resolved(ours, CORE + kind)[3] is True
    assert _resolved(ours, CORE + "q_bmm_quantizer") is None  # no rule: disabled
    assert _resolved(ours, QKV + "weight_quantizer", "ColumnParallelLinear") is None


def test_readme_merges_give_the_model_preset_plus_an_fp8_kv_cache(tmp_path):
    merged = dict(mtq.FP8_DEFAULT_CFG)
    merged["quant_cfg"] = mtq.FP8_DEFAULT_CFG["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"]
    path = tmp_path / "fp8_with_kv.yaml"
    path.write_text("$import: [fp8_default.yaml, fp8_kv.yaml]\n")
    from_yaml = mtq.load_config(path)
    spliced = tmp_path / "spliced.yaml"
    spliced.write_text("$import: fp8_default.yaml\nquant_cfg:\n  - $import: fp8_kv.yaml\n")
    for cfg in (merged, from_yaml, mtq.load_config(spliced)):
        assert _resolved(cfg, CORE + "k_bmm_quantizer") == ("e4m3", None, None, True)
        assert _resolved(cfg, CORE + "v_bmm_quantizer") == ("e4m3", None, None, True)
        assert _resolved(cfg, QKV + "weight_quantizer", "ColumnParallelLinear") == _resolved(
            mtq.FP8_DEFAULT_CFG, QKV + "weight_quantizer", "ColumnParallelLinear")
    assert mtq.load_config("FP8_KV_CFG").quant_cfg == to_config(mtq.FP8_KV_CFG).quant_cfg


def test_nvidias_whole_recipe_is_one_preset_equal_to_the_mixed_preset_plus_the_fp8_kv_cache():
    """NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG (and its YAML by bare name) is NVFP4_EXPERTS_FP8_CFG merged with FP8_KV_CFG
    as README.md merges presets: NVFP4 routed experts, FP8 attention and shared experts, bf16 router and output layer,
    an FP8 KV cache; the mixed preset alone is unchanged (no KV cache)."""
    merged = dict(mtq.NVFP4_EXPERTS_FP8_CFG)
    merged["quant_cfg"] = mtq.NVFP4_EXPERTS_FP8_CFG["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"]
    one = mtq.NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG
    assert to_config(one) == to_config(merged)
    assert mtq.load_config("NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG") == to_config(one)
    assert mtq.load_config("nvfp4_experts_fp8_attn_fp8_kv") == to_config(one)
    expected = {
        (CORE + "k_bmm_quantizer", "DotProductAttention"): ("e4m3", None, None, True),
        (CORE + "v_bmm_quantizer", "DotProductAttention"): ("e4m3", None, None, True),
        (QKV + "weight_quantizer", "ColumnParallelLinear"): ("e4m3", None, None, True),
        ("decoder.layers.0.self_attention.linear_proj.input_quantizer", "RowParallelLinear"):
            ("e4m3", None, None, True),
        ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight_quantizer", "ColumnParallelLinear"):
            ("e4m3", None, None, True),
        ("decoder.layers.0.mlp.experts.linear_fc1.weight_quantizer", "SequentialMLP"): ("nvfp4", None, None, True),
        ("decoder.layers.0.mlp.experts.linear_fc2.input_quantizer", "SequentialMLP"): ("nvfp4", None, None, True),
    }
    for (name, cls), want in expected.items():
        assert _resolved(one, name, cls) == want, name
    for name in ("decoder.layers.0.mlp.router.weight_quantizer", "output_layer.weight_quantizer"):
        assert _resolved(one, name, "Linear") in (None, ("e4m3", None, None, False)), name
    assert to_config(one).experts == to_config(mtq.NVFP4_EXPERTS_FP8_CFG).experts
    assert _resolved(mtq.NVFP4_EXPERTS_FP8_CFG, CORE + "k_bmm_quantizer") is None
