"""One scheme per linear (modelopt_moe/export/layer_schemes.py): the configs both formats write when layers differ.

The configs are read with the readers' own code where it runs on CPU: compressed-tensors' ``QuantizationConfig`` and
its ``match_name`` (which group each linear, and vLLM's fused ``...mlp.experts`` layer, belongs to), transformers'
``get_experts_scheme`` / ``get_dense_scheme`` (which group its loader decodes the experts and the other linears
with). Model Optimizer's ``quantized_layers`` is checked for what vLLM's ``ModelOptMixedPrecisionConfig`` reads
(vllm/model_executor/layers/quantization/modelopt.py): every quantized linear by name with a ``quant_algo`` it
dispatches, ``group_size`` on NVFP4 entries, the bf16 linears in ``exclude_modules`` / ``ignore``.
"""

import pytest

from modelopt_moe.export import ExportError
from modelopt_moe.export.layer_schemes import (
    ct_targets,
    layers_hf_quant_config,
    layers_quantization_config,
    resolve_schemes,
)
from modelopt_moe.export.schemes import SCHEMES, LinearQuant, QuantSpec, hf_quant_config, quantization_config

FP8 = LinearQuant(QuantSpec("e4m3"), QuantSpec("e4m3"))
FP8_CH = LinearQuant(QuantSpec("e4m3", axis=0), QuantSpec("e4m3"))
NVFP4 = LinearQuant(QuantSpec("nvfp4"), QuantSpec("nvfp4"))
NVFP4_A16 = LinearQuant(QuantSpec("nvfp4"))
OFF = LinearQuant()
LAYERS, EXPERTS = 3, 4
VLLM_MIXED_ALGOS = {"FP8", "NVFP4", "W4A16_NVFP4", "MXFP8"}  # ModelOptMixedPrecisionConfig.get_quant_method


def _model(experts=lambda layer, proj: NVFP4, attention=FP8) -> dict[str, LinearQuant]:
    """A Qwen3-MoE-named model's linears: NVIDIA's recipe by default (NVFP4 experts, FP8 attention, bf16 rest)."""
    quants = {}
    for L in range(LAYERS):
        p = f"model.layers.{L}."
        quants.update({f"{p}self_attn.{m}": attention for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
        quants[p + "mlp.gate"] = OFF
        for e in range(EXPERTS):
            quants.update({f"{p}mlp.experts.{e}.{m}": experts(L, m) for m in ("gate_proj", "up_proj", "down_proj")})
    quants["lm_head"] = OFF
    return quants


def _configs(linears, fmt):
    schemes = resolve_schemes(linears, fmt)
    layers = {n: s for n, s in schemes.items() if s is not None}
    ignore = [n for n, s in schemes.items() if s is None]
    return schemes, layers, ignore


def test_resolve_schemes_gives_each_linear_its_own_and_names_what_a_format_refuses():
    schemes = resolve_schemes(_model(), "modelopt")
    assert schemes["model.layers.1.self_attn.k_proj"].name == "FP8"
    assert schemes["model.layers.2.mlp.experts.3.down_proj"].name == "NVFP4"
    assert schemes["model.layers.0.mlp.gate"] is None
    assert schemes["lm_head"] is None
    with pytest.raises(ExportError, match=r"format='modelopt': scheme FP8_CHANNEL \(model.layers.0.self_attn.q_proj: "
                                          "weight e4m3 axis=0.*\\) has no Model Optimizer quant_algo"):
        resolve_schemes(_model(attention=FP8_CH), "modelopt")
    assert resolve_schemes(_model(attention=FP8_CH), "compressed-tensors")["lm_head"] is None
    with pytest.raises(ExportError, match="format='hf' writes unquantized weights"):
        resolve_schemes(_model(), "hf")
    with pytest.raises(ExportError, match="not quantized"):
        resolve_schemes({"a": OFF}, "modelopt")
    with pytest.raises(ExportError, match=r"b: quantization .* cannot be exported"):
        resolve_schemes({"a": FP8, "b": LinearQuant(QuantSpec("int4", block_size=16))}, "compressed-tensors")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_one_scheme_writes_the_single_scheme_configs_unchanged(fmt):
    _, layers, ignore = _configs(_model(attention=NVFP4), fmt)
    assert layers_quantization_config(layers, fmt, ignore) == quantization_config(SCHEMES["NVFP4"], fmt, ignore)
    assert layers_hf_quant_config(layers, ignore) == hf_quant_config(SCHEMES["NVFP4"], ignore)


def test_modelopt_mixed_precision_lists_every_quantized_layer_with_its_algo():
    schemes, layers, ignore = _configs(_model(experts=lambda L, m: NVFP4_A16 if L == 2 else NVFP4), "modelopt")
    cfg = layers_quantization_config(layers, "modelopt", ignore)
    legacy = layers_hf_quant_config(layers, ignore)["quantization"]
    assert cfg["quant_method"] == "modelopt"
    assert cfg["quant_algo"] == legacy["quant_algo"] == "MIXED_PRECISION"
    assert "group_size" not in cfg
    assert "group_size" not in legacy
    assert cfg["quantized_layers"] == legacy["quantized_layers"]
    assert list(cfg["quantized_layers"]) == list(layers)  # every quantized linear, by name, in model order
    for name, entry in cfg["quantized_layers"].items():
        assert entry["quant_algo"] == schemes[name].modelopt_algo
        assert entry["quant_algo"] in VLLM_MIXED_ALGOS
        assert entry.get("group_size") == (16 if "NVFP4" in entry["quant_algo"] else None), name
    assert cfg["quantized_layers"]["model.layers.2.mlp.experts.0.up_proj"] == {"quant_algo": "W4A16_NVFP4",
                                                                              "group_size": 16}
    assert cfg["quantized_layers"]["model.layers.0.self_attn.v_proj"] == {"quant_algo": "FP8"}
    assert cfg["exclude_modules"] == cfg["ignore"] == legacy["exclude_modules"] == ignore
    assert set(ignore) == {"lm_head", *(f"model.layers.{L}.mlp.gate" for L in range(LAYERS))}
    assert not set(ignore) & set(cfg["quantized_layers"])
    assert cfg["kv_cache_quant_algo"] is None
    assert legacy["kv_cache_quant_algo"] is None


def _group_of(parsed, name):
    """The config groups compressed-tensors' own matcher puts module ``name`` in."""
    from compressed_tensors.utils.match import match_name

    return [g for g, scheme in parsed.config_groups.items() if any(match_name(name, t) for t in scheme.targets)]


def test_compressed_tensors_mixed_precision_groups_parse_and_match_each_linear_once():
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.integrations.compressed_tensors import get_dense_scheme, get_experts_scheme

    schemes, layers, ignore = _configs(_model(), "compressed-tensors")
    cfg = layers_quantization_config(layers, "compressed-tensors", ignore)
    assert cfg["format"] == "mixed-precision"
    parsed = QuantizationConfig.model_validate({k: v for k, v in cfg.items() if k not in ("producer",
                                                                                          "sparsity_config")})
    assert parsed.format == "mixed-precision"
    assert parsed.ignore == ignore
    assert {g.format for g in parsed.config_groups.values()} == {"float-quantized", "nvfp4-pack-quantized"}
    for name, s in schemes.items():
        groups = _group_of(parsed, name)
        if s is None:
            assert groups == [], name
            assert name in parsed.ignore, name
            continue
        assert len(groups) == 1, (name, groups)
        assert parsed.config_groups[groups[0]].format == s.ct_format, name
    # one regex covers every layer's experts; it also matches vLLM's fused experts layer by its name
    experts = next(g for g in parsed.config_groups.values() if g.format == "nvfp4-pack-quantized")
    assert experts.targets == [r"re:^model\.layers\.\d+\.mlp\.experts($|\.)"]
    assert all(_group_of(parsed, f"model.layers.{L}.mlp.experts") == _group_of(parsed, f"model.layers.{L}.mlp."
                                                                                      "experts.0.gate_proj")
               for L in range(LAYERS))
    assert _group_of(parsed, "model.layers.0.mlp.gate") == []  # the router is not an expert
    # transformers decodes the experts with the NVFP4 group, every other linear with the FP8 one
    assert get_experts_scheme(parsed).format == "nvfp4-pack-quantized"
    assert get_dense_scheme(parsed).format == "float-quantized"
    assert cfg["kv_cache_scheme"] is None


def test_targets_fall_back_per_layer_and_to_exact_names_where_experts_differ():
    # layer 0's experts FP8 (like the attention), the others NVFP4: one experts regex per layer, not \d+
    linears = _model(experts=lambda L, m: FP8 if L == 0 else NVFP4)
    _, layers, ignore = _configs(linears, "compressed-tensors")
    cfg = layers_quantization_config(layers, "compressed-tensors", ignore)
    fp8, nvfp4 = cfg["config_groups"]["group_0"]["targets"], cfg["config_groups"]["group_1"]["targets"]
    assert fp8[0] == r"re:^model\.layers\.0\.mlp\.experts($|\.)"
    assert nvfp4 == [rf"re:^model\.layers\.{L}\.mlp\.experts($|\.)" for L in (1, 2)]
    # gate/up NVFP4, down FP8 in layer 1: those experts are listed by name (no regex may claim the whole module)
    names = {n: s.name for n, s in resolve_schemes(_model(
        experts=lambda L, m: FP8 if (L, m) == (1, "down_proj") else NVFP4), "compressed-tensors").items() if s}
    nv = [n for n, s in names.items() if s == "NVFP4"]
    targets = ct_targets(nv, "NVFP4", names)
    assert r"re:^model\.layers\.0\.mlp\.experts($|\.)" in targets
    assert "model.layers.1.mlp.experts.2.gate_proj" in targets
    assert not any(t.startswith("re:") and ".1." in t.replace(r"\.", ".") for t in targets)


def test_no_quantized_layer_is_an_error():
    with pytest.raises(ExportError, match="no quantized linear"):
        layers_quantization_config({}, "modelopt", ["lm_head"])
    with pytest.raises(ExportError, match="no quantized linear"):
        layers_hf_quant_config({}, ["lm_head"])
