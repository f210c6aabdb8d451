"""Export schemes (modelopt_moe/export/schemes.py): what each format can express, the tensors it stores, its config.

Configs are validated by the readers' own schemas: compressed-tensors' ``QuantizationConfig`` and the fields vLLM's
``modelopt`` loader requires (vllm/model_executor/layers/quantization/modelopt.py, ``ModelOptQuantConfigBase
.from_config`` and ``ModelOptNvFp4Config._from_config``).
"""

import pytest
import torch

from modelopt_moe.export import ExportError, codecs
from modelopt_moe.export.schemes import (
    SCHEMES,
    LinearQuant,
    QuantSpec,
    encode_linear,
    hf_quant_config,
    quantization_config,
    resolve_scheme,
    scheme_of,
)

FP8 = QuantSpec("e4m3")
FP8_CH = QuantSpec("e4m3", axis=0)
NVFP4 = QuantSpec("nvfp4")
FOS = QuantSpec("nvfp4_four_over_six")


@pytest.mark.parametrize(("quant", "name"), [
    (LinearQuant(FP8, FP8), "FP8"),
    (LinearQuant(FP8, None), "FP8_A16"),
    (LinearQuant(FP8_CH, FP8), "FP8_CHANNEL"),
    (LinearQuant(FP8_CH, None), "FP8_CHANNEL_A16"),
    (LinearQuant(NVFP4, NVFP4), "NVFP4"),
    (LinearQuant(NVFP4, None), "NVFP4_A16"),
    (LinearQuant(FOS, FOS), "NVFP4_4O6"),
    (LinearQuant(FOS, None), "NVFP4_4O6_A16"),
    (LinearQuant(FOS, NVFP4), "NVFP4_4O6_WEIGHTS"),
    (LinearQuant(NVFP4, FOS), "NVFP4_4O6_INPUTS"),
    (LinearQuant(), None),
])
def test_scheme_of(quant, name):
    s = scheme_of(quant, "m")
    assert (s.name if s else None) == name


@pytest.mark.parametrize(("quant", "match"), [
    (LinearQuant(QuantSpec("int4", block_size=16)), "weight format int4 block=16 is not FP8"),
    (LinearQuant(QuantSpec("int8", axis=0), QuantSpec("int8")), "is not FP8 E4M3"),
    (LinearQuant(QuantSpec("e5m2"), QuantSpec("e5m2")), "weight format e5m2"),
    (LinearQuant(FP8, NVFP4), "FP8 weights need E4M3 per-tensor inputs"),
    (LinearQuant(NVFP4, FP8), "NVFP4 weights need NVFP4 inputs"),
    (LinearQuant(FOS, FP8),
     r"NVFP4 \(4-over-6\) weights need NVFP4 inputs \(plain or 4-over-6\) or none, got input e4m3"),
    (LinearQuant(FP8, FOS), "FP8 weights need E4M3 per-tensor inputs"),
    (LinearQuant(FOS, FOS, FOS), "an output quantizer"),
    (LinearQuant(FP8, FP8, FP8), "an output quantizer"),
    (LinearQuant(None, FP8), "the weight is not"),
])
def test_scheme_of_refuses_what_no_format_expresses(quant, match):
    with pytest.raises(ExportError, match=match) as e:
        scheme_of(quant, "model.layers.0.self_attn.q_proj")
    assert "model.layers.0.self_attn.q_proj" in str(e.value)


def test_resolve_scheme_errors_name_the_linear_and_the_allowed_set():
    with pytest.raises(ExportError,
                       match=r"format='bogus': expected one of \('compressed-tensors', 'modelopt', 'hf'\)"):
        resolve_scheme({}, "bogus")
    with pytest.raises(ExportError, match="not quantized"):
        resolve_scheme({"a": LinearQuant(), "b": LinearQuant()}, "compressed-tensors")
    with pytest.raises(ExportError, match="format='hf' writes unquantized weights.*a: weight e4m3"):
        resolve_scheme({"a": LinearQuant(FP8, FP8)}, "hf")
    with pytest.raises(ExportError, match=r"mixes \['FP8', 'NVFP4'\]"):
        resolve_scheme({"a": LinearQuant(FP8, FP8), "b": LinearQuant(NVFP4, NVFP4)}, "compressed-tensors")
    with pytest.raises(ExportError, match="FP8_CHANNEL .* has no Model Optimizer quant_algo"):
        resolve_scheme({"a": LinearQuant(FP8_CH, FP8)}, "modelopt")
    with pytest.raises(ExportError, match="b: quantization .* cannot be exported"):
        resolve_scheme({"a": LinearQuant(), "b": LinearQuant(QuantSpec("int4", block_size=16))}, "compressed-tensors")
    assert resolve_scheme({"a": LinearQuant(), "b": LinearQuant(NVFP4)}, "modelopt").modelopt_algo == "W4A16_NVFP4"
    assert resolve_scheme({"a": LinearQuant()}, "hf") is None


def _w(rows=32, cols=64):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_encode_fp8_tensors(fmt):
    w, a, x = _w(), torch.tensor(2.5), torch.tensor(7.0)
    t = encode_linear("m", w, a, x, SCHEMES["FP8"], fmt)
    shape = (1,) if fmt == "compressed-tensors" else ()
    assert set(t) == {"m.weight", "m.weight_scale", "m.input_scale"}
    assert t["m.weight"].dtype == torch.float8_e4m3fn
    assert t["m.weight"].shape == w.shape
    assert t["m.weight_scale"].shape == shape
    assert t["m.weight_scale"].dtype == torch.float32
    assert t["m.weight_scale"].item() == codecs.reciprocal(codecs.fp8_scale(a)).item()
    assert t["m.input_scale"].item() == codecs.reciprocal(codecs.fp8_scale(x)).item()


def test_encode_fp8_per_channel_tensors():
    w = _w()
    a = w.abs().amax(1)
    t = encode_linear("m", w, a, None, SCHEMES["FP8_CHANNEL_A16"], "compressed-tensors")
    assert set(t) == {"m.weight", "m.weight_scale"}
    assert t["m.weight_scale"].shape == (32, 1)


def test_encode_nvfp4_tensors_per_format():
    w, a, x = _w(), torch.tensor(3.0), torch.tensor(11.0)
    mo = encode_linear("m", w, a, x, SCHEMES["NVFP4"], "modelopt")
    ct = encode_linear("m", w, a, x, SCHEMES["NVFP4"], "compressed-tensors")
    assert set(mo) == {"m.weight", "m.weight_scale", "m.weight_scale_2", "m.input_scale"}
    assert set(ct) == {"m.weight_packed", "m.weight_scale", "m.weight_global_scale", "m.input_global_scale"}
    assert torch.equal(mo["m.weight"], ct["m.weight_packed"])
    assert mo["m.weight"].shape == (32, 32)
    assert torch.equal(mo["m.weight_scale"].view(torch.uint8), ct["m.weight_scale"].view(torch.uint8))
    assert mo["m.weight_scale_2"].shape == ()
    assert ct["m.weight_global_scale"].shape == (1,)
    assert mo["m.weight_scale_2"] == codecs.nvfp4_global_scale(a)
    assert ct["m.weight_global_scale"] == codecs.reciprocal(mo["m.weight_scale_2"])
    assert mo["m.input_scale"] == codecs.nvfp4_global_scale(x)
    assert ct["m.input_global_scale"] == codecs.reciprocal(mo["m.input_scale"])


def test_encode_errors():
    with pytest.raises(ExportError, match="m: the weight quantizer has no amax"):
        encode_linear("m", _w(), None, None, SCHEMES["FP8_A16"], "modelopt")
    with pytest.raises(ExportError, match="m: the input quantizer has no amax"):
        encode_linear("m", _w(), torch.tensor(1.0), None, SCHEMES["NVFP4"], "modelopt")
    with pytest.raises(ExportError, match="multiple of 16"):
        encode_linear("m", _w(8, 24), torch.tensor(1.0), None, SCHEMES["NVFP4_A16"], "modelopt")
    bad = _w()
    bad[0, 0] = float("nan")
    with pytest.raises(ExportError, match="m.weight: the weight holds NaN"):
        encode_linear("m", bad, torch.tensor(1.0), None, SCHEMES["NVFP4_A16"], "compressed-tensors")


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_compressed_tensors_config_is_valid_for_compressed_tensors(name):
    from compressed_tensors.quantization import QuantizationConfig

    cfg = quantization_config(SCHEMES[name], "compressed-tensors", ["lm_head", "model.layers.0.mlp.gate"])
    parsed = QuantizationConfig.model_validate({k: v for k, v in cfg.items() if k not in ("producer",
                                                                                          "sparsity_config")})
    group = parsed.config_groups["group_0"]
    assert group.weights.num_bits == (8 if "FP8" in name else 4)
    expected = {"FP8_DYNAMIC": "channel", "FP8_BLOCK": "block", "FP8_BLOCK_A16": "block"}.get(name) or (
        "group" if name.startswith(("W4A16", "MX")) else "channel" if "CHANNEL" in name else "tensor" if "FP8" in name
        else "tensor_group")
    assert group.weights.strategy == expected
    assert (group.input_activations is None) == ("A16" in name)
    assert parsed.ignore == ["lm_head", "model.layers.0.mlp.gate"]


@pytest.mark.parametrize("name", ["FP8", "NVFP4", "NVFP4_A16"])
def test_modelopt_configs_have_what_vllm_requires(name):
    """What vLLM's ModelOptQuantConfigBase.from_config requires: ``quant_algo`` in its QUANT_ALGOS; for NVFP4 under
    ``quantization``: ``group_size``, ``kv_cache_quant_algo`` and ``exclude_modules`` must be present."""
    vllm_algos = {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION"}
    scheme = SCHEMES[name]
    cfg = quantization_config(scheme, "modelopt", ["lm_head"])
    assert cfg["quant_method"] == "modelopt"
    assert cfg["quant_algo"] in vllm_algos
    assert cfg["ignore"] == cfg["exclude_modules"] == ["lm_head"]
    legacy = hf_quant_config(scheme, ["lm_head"])["quantization"]
    required = {"kv_cache_quant_algo", "exclude_modules"} | ({"group_size"} if "NVFP4" in name else set())
    assert required <= set(legacy)
    assert legacy["quant_algo"] == cfg["quant_algo"]
    if "NVFP4" in name:
        assert cfg["group_size"] == legacy["group_size"] == 16
