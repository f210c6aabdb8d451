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
