"""The export codecs of FP8_DYNAMIC, FP8 block-wise, INT4 W4A16 groups, MXFP4 and MXFP8: the stored codes are the ones
training's fake quant rounded to, and compressed-tensors' own decompressors read them back to the fake-quantized
weight (bit for bit where the file's scale is a power of two, MX; within one fp32 ulp where the file stores the
multiplicative reciprocal of training's divisor, as for per-tensor FP8)."""

import re

import pytest
import torch
from compressed_tensors import compressors
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from modelopt_moe.export.errors import ExportError
from modelopt_moe.export.schemes import SCHEMES, LinearQuant, QuantSpec, encode_linear, quantization_config, scheme_of
from modelopt_moe.numerics import fake_quant
from modelopt_moe.numerics.format import reciprocal
from modelopt_moe.numerics.integer import encode_int4_groups

M = "model.layers.0.mlp.experts.3.up_proj"


def _weight(rows=96, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    w[5, :64] = 0.0  # all-zero groups and blocks
    return w


def _ct_scheme(scheme) -> QuantizationScheme:
    """compressed-tensors' scheme object from the config group we write."""
    group = quantization_config(scheme, "compressed-tensors", [])["config_groups"]["group_0"]
    inputs = group["input_activations"]
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**group["weights"]),
                              input_activations=QuantizationArgs(**inputs) if inputs else None,
                              format=group["format"])


def _ulps(a, b) -> int:
    """The largest distance in fp32 ulps; ``-0.0`` counts as ``0.0`` (an integer code has no negative zero)."""
    a, b = a.float() + 0.0, b.float() + 0.0
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def _local(tensors: dict) -> dict:
    return {k.removeprefix(M + "."): v for k, v in tensors.items()}


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("inputs", [True, False])
def test_mx_decodes_bit_exact_with_compressed_tensors(fmt, inputs):
    q = LinearQuant(QuantSpec(fmt, None, 32), QuantSpec(fmt, None, 32) if inputs else None)
    scheme = scheme_of(q, M)
    assert scheme.name == fmt.upper() + ("" if inputs else "_A16")
    w = _weight()
    files = _local(encode_linear(M, w, None, None, scheme, "compressed-tensors"))
    compressor = compressors.MXFP4PackedCompressor if fmt == "mxfp4" else compressors.MXFP8QuantizationCompressor
    got = compressor.decompress(files, _ct_scheme(scheme))["weight"]
    assert torch.equal(got.float(), fake_quant(w, fmt, None, 32))
    assert files["weight_scale"].dtype == torch.uint8


@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups_decode_with_compressed_tensors_pack_quantized(group):
    q = LinearQuant(QuantSpec("int4", None, group))
    scheme = scheme_of(q, M)
    assert scheme.name == f"W4A16_G{group}"
    assert scheme.ct_format == "pack-quantized"
    w = _weight()
    files = _local(encode_linear(M, w, None, None, scheme, "compressed-tensors"))
    assert files["weight_packed"].dtype == torch.int32
    assert files["weight_packed"].shape == (96, 32)
    ct = _ct_scheme(scheme)
    want = fake_quant(w, "int4", None, group)
    got = compressors.PackedQuantizationCompressor.decompress(files, ct)["weight"]
    assert _ulps(got, want) <= 1
    # the stored codes are training's, exactly: compressed-tensors unpacks them, and over training's divisors they give
    # the fake quant bit for bit (a zero code has no sign: -0.0 compares as 0.0)
    codes, s = encode_int4_groups(w, group)
    assert torch.equal(unpack_from_int32(files["weight_packed"], 4, torch.Size(w.shape)), codes)
    decoded = (codes.float().unflatten(-1, (-1, group)) / s.unsqueeze(-1)).flatten(-2)
    assert torch.equal(decoded + 0.0, want + 0.0)
    assert torch.equal(files["weight_scale"], reciprocal(s))


def test_fp8_dynamic_channel_weights_and_per_token_inputs():
    q = LinearQuant(QuantSpec("e4m3", 0), QuantSpec("e4m3", per_token=True))
    scheme = scheme_of(q, M)
    assert scheme.name == "FP8_DYNAMIC"
    assert scheme.modelopt_algo == "FP8_PER_CHANNEL_PER_TOKEN"
    w = _weight()
    amax = w.abs().amax(1)
    ct = _local(encode_linear(M, w, amax, None, scheme, "compressed-tensors"))
    assert set(ct) == {"weight", "weight_scale"}
    assert ct["weight_scale"].shape == (96, 1)
    got = compressors.FloatQuantizationCompressor.decompress(ct, _ct_scheme(scheme))["weight"]
    assert _ulps(got, fake_quant(w, "e4m3", amax.unsqueeze(1))) <= 1
    mo = _local(encode_linear(M, w, amax, None, scheme, "modelopt"))
    assert mo["weight_scale"].shape == (96,)
    assert torch.equal(mo["weight_scale"], ct["weight_scale"].flatten())
    group = quantization_config(scheme, "compressed-tensors", [])["config_groups"]["group_0"]
    assert group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True


@pytest.mark.parametrize("inputs", [True, False])
def test_fp8_blocks_decode_with_compressed_tensors(inputs):
    q = LinearQuant(QuantSpec("e4m3", None, (128, 128)), QuantSpec("e4m3", None, 128) if inputs else None)
    scheme = scheme_of(q, M)
    assert scheme.name == "FP8_BLOCK" + ("" if inputs else "_A16")
    assert scheme.modelopt_algo == "FP8_PB_WO"
    w = _weight(300, 260)
    ct = _local(encode_linear(M, w, None, None, scheme, "compressed-tensors"))
    assert ct["weight_scale"].shape == (3, 3)
    got = compressors.FloatQuantizationCompressor.decompress(ct, _ct_scheme(scheme))["weight"]
    assert _ulps(got, fake_quant(w, "e4m3", None, (128, 128))) <= 1
    mo = _local(encode_linear(M, w, None, None, scheme, "modelopt"))
    assert mo["weight_scale"].shape == (3, 1, 3, 1)
    assert torch.equal(mo["weight_scale"].flatten(), ct["weight_scale"].flatten())


@pytest.mark.parametrize(("q", "message"), [
    (LinearQuant(QuantSpec("int4", None, 128), QuantSpec("int8")), "INT4 weights export weight-only"),
    (LinearQuant(QuantSpec("int4", None, 16)), "is not FP8 E4M3"),
    (LinearQuant(QuantSpec("e4m3", None, (64, 64))), "weight format e4m3 block=(64, 64)"),
    (LinearQuant(QuantSpec("e4m3", None, (128, 128)), QuantSpec("e4m3")), "dynamic groups of 128"),
    (LinearQuant(QuantSpec("e4m3"), QuantSpec("e4m3", per_token=True)),
     "dynamic E4M3 inputs go with per-output-channel weights (FP8_DYNAMIC)"),
    (LinearQuant(QuantSpec("mxfp4", None, 32), QuantSpec("mxfp8", None, 32)), "MXFP4 weights need MXFP4 inputs"),
])
def test_what_no_engine_reads_is_refused_naming_the_layer_and_the_formats(q, message):
    with pytest.raises(ExportError, match=re.escape(message)) as e:
        scheme_of(q, M)
    assert M in str(e.value)
    assert "FP8_DYNAMIC" in str(e.value)
    assert "MXFP8" in str(e.value)


def test_int4_and_mxfp4_have_no_model_optimizer_name_an_engine_reads():
    from modelopt_moe.export.schemes import resolve_scheme

    for q in (LinearQuant(QuantSpec("int4", None, 128)), LinearQuant(QuantSpec("mxfp4", None, 32))):
        with pytest.raises(ExportError, match=f"{M}.*export it with format='compressed-tensors'"):
            resolve_scheme({M: q}, "modelopt")
    assert {s.modelopt_algo for s in SCHEMES.values()} >= {"FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8"}


@pytest.mark.parametrize(("q", "fmt", "words"), [
    (LinearQuant(QuantSpec("mxfp4", None, 32), QuantSpec("mxfp4", None, 32)), "compressed-tensors",
     ["MXFP4: E2M1, E8M0 scale per block of 32 inputs", "`weight_scale` uint8 `[out, in/32]`"]),
    (LinearQuant(QuantSpec("int4", None, 32)), "compressed-tensors",
     ["INT4, fp32 scale per group of 32 inputs", "`weight_packed` int32 `[out, in/8]`", "not quantized (weight-only)"]),
    (LinearQuant(QuantSpec("e4m3", 0), QuantSpec("e4m3", dynamic=True)), "modelopt",
     ["scale per token computed at run time", "`weight_scale` fp32 `[out]`", "FP8_PER_CHANNEL_PER_TOKEN"]),
    (LinearQuant(QuantSpec("e4m3", None, (128, 128))), "modelopt",
     ["fp32 scale per 128x128 block", "`[out/128, 1, in/128, 1]`", "FP8_PB_WO"]),
])
def test_model_card_states_the_trained_formats(q, fmt, words):
    from modelopt_moe.export.model_card import model_card

    linears = {M: q, "model.layers.0.mlp.gate": LinearQuant()}
    card = model_card(architecture="Qwen3MoeForCausalLM", fmt=fmt, linears=linears,
                      other_modules=["model.embed_tokens"], dtype="bfloat16", name="ckpt")
    for w in words:
        assert w in card, w
    assert "fix_nvfp4_experts" not in card
    assert "NVFP4" not in card


def _four_over_six_model(weights: str, inputs: str | None):
    """A linear quantized through ``mtq.quantize`` with NVFP4 weights and inputs, each plain or 4-over-6
    (``block_sizes`` ``four_over_six: true`` with block scales from the data)."""
    import copy
    import warnings

    from torch import nn

    import modelopt_moe.quantization as mtq

    def cfg(fmt):
        blocks = {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
        if fmt == "4o6":
            blocks["four_over_six"] = True
        return {"num_bits": (2, 1), "block_sizes": blocks}

    rules = [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*weight_quantizer", "cfg": cfg(weights)}]
    if inputs is not None:
        rules.append({"quantizer_name": "*input_quantizer", "cfg": cfg(inputs)})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(_weight(48, 64))
    data = torch.randn(8, 64) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, copy.deepcopy({"quant_cfg": rules, "algorithm": "max"}), lambda m: m(data))
    return model[0]


@pytest.mark.parametrize(("weights", "inputs", "name"), [
    ("4o6", "4o6", "NVFP4_4O6"), ("4o6", None, "NVFP4_4O6_A16"), ("4o6", "plain", "NVFP4_4O6_WEIGHTS"),
    ("plain", "4o6", "NVFP4_4O6_INPUTS")])
def test_four_over_six_exports_plain_nvfp4_tensors_that_decode_to_the_trained_weight(weights, inputs, name):
    from modelopt_moe.export.codecs import decode_nvfp4_ct, decode_nvfp4_modelopt, unpack_fp4
    from modelopt_moe.numerics.nvfp4 import NVFP4, NVFP4_FOUR_OVER_SIX

    linear = _four_over_six_model(weights, inputs)
    wq, xq = linear.weight_quantizer, linear.input_quantizer
    q = LinearQuant(QuantSpec(wq.fmt, wq.axis, wq.block_size),
                    QuantSpec(xq.fmt, xq.axis, xq.block_size) if xq.is_quantizing else None)
    scheme = scheme_of(q, M)
    assert scheme.name == name
    w, trained = linear.weight.detach(), wq(linear.weight.detach())
    w_fmt = NVFP4_FOUR_OVER_SIX if weights == "4o6" else NVFP4
    assert torch.equal(trained, w_fmt.fake_quant(w, wq.amax))
    if weights == "4o6":  # some blocks took 4 for their max: not what plain NVFP4 rounds to
        assert not torch.equal(trained, NVFP4.fake_quant(w, wq.amax))
    x_amax = xq.amax if xq.is_quantizing else None
    mo = _local(encode_linear(M, w, wq.amax, x_amax, scheme, "modelopt"))
    ct = _local(encode_linear(M, w, wq.amax, x_amax, scheme, "compressed-tensors"))
    # plain NVFP4 tensors: Model Optimizer's formula is training's, bit for bit; the second-level scale is the
    # weight format's (amax / 1536 for 4-over-6, amax / 2688 plain)
    assert torch.equal(decode_nvfp4_modelopt(mo["weight"], mo["weight_scale"], mo["weight_scale_2"], torch.float32),
                       trained)
    assert torch.equal(mo["weight_scale_2"], wq.amax.float().reshape(()) / w_fmt.bound)
    assert torch.equal(ct["weight_packed"], mo["weight"])
    assert torch.equal(ct["weight_scale"], mo["weight_scale"])
    assert torch.equal(ct["weight_global_scale"], reciprocal(mo["weight_scale_2"]).reshape(1))
    # compressed-tensors' own decompressor (the reader we did not write) reads the codes training rounded to
    got = compressors.NVFP4PackedCompressor.decompress(ct, _ct_scheme(scheme))["weight"]
    assert torch.equal(got.float(), decode_nvfp4_ct(ct["weight_packed"], ct["weight_scale"], ct["weight_global_scale"],
                                                    got.dtype).float())
    assert _ulps(decode_nvfp4_ct(ct["weight_packed"], ct["weight_scale"], ct["weight_global_scale"], torch.float32),
                 trained) <= 2
    assert unpack_fp4(mo["weight"]).shape == w.shape
    if inputs is None:
        assert "input_scale" not in mo
        assert "input_global_scale" not in ct
        return
    # the input's global scale is its format's: 256-normalized for 4-over-6 inputs (amax / 1536)
    x_fmt = NVFP4_FOUR_OVER_SIX if inputs == "4o6" else NVFP4
    assert torch.equal(mo["input_scale"], xq.amax.float().reshape(()) / x_fmt.bound)
    assert torch.equal(ct["input_global_scale"], reciprocal(mo["input_scale"]).reshape(1))


def test_four_over_six_refuses_static_block_scales_naming_the_layer():
    scheme = SCHEMES["NVFP4_4O6"]
    w = _weight(16, 64)
    with pytest.raises(ExportError, match=f"{re.escape(M)}.weight: NVFP4 \\(4-over-6\\) chooses its block scales"):
        encode_linear(M, w, w.abs().amax(), torch.tensor(1.0), scheme, "modelopt",
                      weight_blocks=(torch.ones(16, 4), 256.0))
