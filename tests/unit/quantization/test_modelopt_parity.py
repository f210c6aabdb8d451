"""Against what NVIDIA Model Optimizer 0.47 itself produced (tests/fixtures/modelopt_0_47, made by
tools/make_modelopt_fixtures.py; Model Optimizer is not needed here): its configs, amaxes, quantizer outputs, quantizer
states and ``mto.save`` files, on ``nn.Linear`` models on CPU.

Bit-exact (atol=0, rtol=0) wherever the arithmetic is the same: every INT case (per tensor, per channel, static
blocks padded to 128 on a 16-wide linear, both ranges), every amax, and FP8 in bf16. FP8 in fp32 differs by at most
one ulp in a few elements: Model Optimizer multiplies by ``1 / scale`` where this package divides (IEEE, the same
bits on CPU and GPU; docs/modelopt_compat.md).

What is compared is what any machine computes alike: the quantized operands (elementwise arithmetic), and our model's
output against the same forward written in plain torch on Model Optimizer's operands, both computed here. The
fixture's own model output is a GEMM result of the CPU that made it (another CPU sums the products in another order),
so it is no reference for an output computed on this one.
"""

import copy
import io
import lzma
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_moe.checkpoint as mto
import modelopt_moe.quantization as mtq
from modelopt_moe.checkpoint.modelopt_format import load_plain
from modelopt_moe.quantization.config import ConfigError, to_config
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "modelopt_0_47"
INT_CASES = ["int8_default", "int8_default_bf16", "int8_per_tensor", "int8_narrow", "int4_per_tensor",
             "int4_blockwise", "int8_legacy_dict"]
FP8_CASES = ["fp8_default", "fp8_default_bf16", "fp8_per_channel_per_token", "fp8_parent_class"]
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@pytest.fixture(scope="module")
def fixture():
    return load_plain(io.BytesIO(lzma.decompress((FIXTURES / "linear_cases.pt.xz").read_bytes())))


def unpack(p):
    return None if p is None else p["values"][p["index"].long()]


def model_like_the_fixture(fixture, dtype):
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(128, 32), act1=nn.ReLU(), fc2=nn.Linear(32, 16), act2=nn.ReLU(),
                                      fc3=nn.Linear(16, 8)))
    model.load_state_dict(fixture["model_state"])
    return model.to(dtype)


def quantize_like_the_fixture(fixture, name):
    case = fixture["cases"][name]
    dtype = getattr(torch, case["dtype"])
    model = model_like_the_fixture(fixture, dtype)
    calib = fixture["calib"].to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, copy.deepcopy(case["config"]), lambda m: m(calib))
    return model, case, fixture["test"].to(dtype)


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    return int((a.contiguous().view(_BITS[a.dtype]) != b.contiguous().view(_BITS[b.dtype])).sum())


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs().max())


def modelopt_fake_quant(x: torch.Tensor, amax: torch.Tensor, state: dict) -> torch.Tensor:
    """Model Optimizer's CPU fake quant of a per-tensor quantizer with quantizer state ``state``, written out in plain
    torch. INT: ``scale = (2**(b-1) - 1) / amax``, round half to even, clamp to ``[-2**(b-1), 2**(b-1) - 1]`` (or
    the symmetric range with ``narrow_range``), divide by the scale; FP8: :func:`reciprocal_fp8`."""
    if state["_num_bits"] == (4, 3):
        return reciprocal_fp8(x, amax)
    assert isinstance(state["_num_bits"], int)
    assert state["_axis"] is None
    assert state["_block_sizes"] is None
    bound = torch.tensor(2.0 ** (state["_num_bits"] - 1) - 1)
    scale = bound / amax.float()  # a tensor over a tensor: a true division, as Model Optimizer computes it
    q = torch.round(x.float() * scale).clamp(min=-bound if state["_narrow_range"] else -bound - 1, max=bound)
    return (q / scale).to(x.dtype)


LAYERS = ("fc1", "fc2", "fc3")


def forward_on_model_optimizers_operands(fixture, case, x: torch.Tensor) -> torch.Tensor:
    """The case's model forward in plain torch (``F.linear``, ReLU) on Model Optimizer's operands: its quantized
    ``fc1`` input and weights from the fixture; the ``fc2`` / ``fc3`` inputs (activations of this forward) quantized
    with its arithmetic written out (:func:`modelopt_fake_quant`) and its calibrated amax."""
    states, h = case["quantizer_state"], x
    for layer in LAYERS:
        assert states[f"{layer}.output_quantizer"]["_disabled"], layer
        iq = states[f"{layer}.input_quantizer"]
        if iq["_disabled"]:
            a = h
        elif layer == "fc1":
            a = unpack(case["fc1_input_q"])
        else:
            a = modelopt_fake_quant(h, case["amax"][f"{layer}.input_quantizer._amax"], iq)
        packed = case["weight_q"].get(layer)
        w = fixture["model_state"][f"{layer}.weight"].to(x.dtype) if packed is None else unpack(packed)
        h = F.linear(a, w, fixture["model_state"][f"{layer}.bias"].to(x.dtype))
        if layer != "fc3":
            h = torch.relu(h)
    return h


def assert_operands_and_output_are_model_optimizers(model, case, x, fixture):
    """Our quantized operands are Model Optimizer's bit for bit, and our output is the plain forward on its operands."""
    with torch.no_grad():
        expected_in = unpack(case["fc1_input_q"])
        if expected_in is not None:
            assert differing(model.fc1.input_quantizer(x), expected_in) == 0
            # The written-out arithmetic the reference uses for the later inputs is Model Optimizer's, on 15,360
            # activations that clip on both sides.
            state = case["quantizer_state"]["fc1.input_quantizer"]
            assert differing(modelopt_fake_quant(x, case["amax"]["fc1.input_quantizer._amax"], state), expected_in) == 0
        for layer, packed in case["weight_q"].items():
            w = getattr(model, layer).weight
            assert differing(getattr(model, layer).weight_quantizer(w), unpack(packed)) == 0, layer
        assert differing(model(x), forward_on_model_optimizers_operands(fixture, case, x)) == 0


def test_fixture_was_made_by_model_optimizer_0_47(fixture):
    assert fixture["modelopt_version"] == "0.47.0"
    assert set(fixture["cases"]) == set(INT_CASES + FP8_CASES)


@pytest.mark.parametrize("name", INT_CASES + FP8_CASES)
def test_amaxes_are_model_optimizers_bit_for_bit(fixture, name):
    model, case, _ = quantize_like_the_fixture(fixture, name)
    ours = {k: v for k, v in model.state_dict().items() if k.endswith("_amax")}
    assert sorted(ours) == sorted(case["amax"])  # the same quantizers enabled, static, with an amax
    for key, expected in case["amax"].items():
        assert ours[key].shape == expected.shape, key
        assert differing(ours[key], expected.float()) == 0, key


@pytest.mark.parametrize("name", INT_CASES)
def test_int_outputs_are_model_optimizers_bit_for_bit(fixture, name):
    model, case, x = quantize_like_the_fixture(fixture, name)
    assert_operands_and_output_are_model_optimizers(model, case, x, fixture)


@pytest.mark.parametrize("name", ["int8_default", "int8_per_tensor", "int4_per_tensor"])
def test_wide_int_range_is_what_puts_clipped_values_on_model_optimizers_levels(fixture, name):
    # The measurement behind narrow_range's default: with the symmetric range (this package's behaviour before),
    # clipped negative activations land one level off Model Optimizer's; with its default range none do.
    model, case, x = quantize_like_the_fixture(fixture, name)
    expected = unpack(case["fc1_input_q"])
    q = model.fc1.input_quantizer
    with torch.no_grad():
        wide = q(x)
        q.narrow_range = True
        narrow = q(x)
    assert differing(wide, expected) == 0
    off = differing(narrow, expected)
    assert 0 < off < x.numel() // 10, off
    # Exactly the elements that clip below -amax differ.
    scale = q.maxbound / q.amax
    assert off == int((x * scale < -q.maxbound - 0.5).sum())


def test_narrow_range_case_matches_with_narrow_range_true(fixture):
    model, case, x = quantize_like_the_fixture(fixture, "int8_narrow")
    assert model.fc1.input_quantizer.narrow_range
    assert model.fc1.weight_quantizer.narrow_range
    with torch.no_grad():
        assert differing(model.fc1.input_quantizer(x), unpack(case["fc1_input_q"])) == 0


def test_int4_static_blocks_pad_a_16_wide_linear(fixture):
    model, case, _ = quantize_like_the_fixture(fixture, "int4_blockwise")
    q = model.fc3.weight_quantizer
    # one padded block per row of the [8, 16] weight
    assert q.static_block_size == 128
    assert q.amax.shape == (8, 1)
    assert model.fc1.weight_quantizer.amax.shape == (32, 1)
    with torch.no_grad():
        assert differing(q(model.fc3.weight), unpack(case["weight_q"]["fc3"])) == 0


def reciprocal_fp8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's CPU FP8 arithmetic, written out: ``448 / amax`` as torch computes a float over a tensor
    (a reciprocal times 448), then a multiply by ``1 / scale`` instead of a division."""
    scale = 448.0 / amax.float()
    q = (x.float() * scale).clamp(min=-448.0, max=448.0).to(torch.float8_e4m3fn).float()
    return (q * (1 / scale)).to(x.dtype)


@pytest.mark.parametrize("name", ["fp8_default", "fp8_per_channel_per_token", "fp8_parent_class"])
def test_fp8_fp32_differs_only_by_the_reciprocal_multiply(fixture, name):
    model, case, x = quantize_like_the_fixture(fixture, name)
    iq = model.fc1.input_quantizer
    pairs = [(iq, x, case["fc1_input_q"])] + [(getattr(model, n).weight_quantizer, getattr(model, n).weight.detach(),
                                              p) for n, p in case["weight_q"].items()]
    for q, t, packed in pairs:
        amax = q.amax if q.amax is not None else q.amax_of(t)
        with torch.no_grad():
            ours = q(t)
        theirs = unpack(packed)
        # Model Optimizer's outputs are exactly the reciprocal formula; ours exactly the IEEE one (the contract).
        assert differing(reciprocal_fp8(t, amax), theirs) == 0
        assert differing(ours, mtq.fake_quant(t, "e4m3", amax)) == 0
        if amax.numel() == 1:
            # One scale: at most one ulp apart (the final multiply by 1 / scale rounds twice).
            assert max_ulps(ours, theirs) <= 1
        # Per channel or per token, a scale one ulp off can move an element that sits on a rounding tie to the
        # neighbouring FP8 level: measured in docs/modelopt_compat.md.


def test_fp8_in_bf16_is_bit_equal(fixture):
    model, case, x = quantize_like_the_fixture(fixture, "fp8_default_bf16")
    assert_operands_and_output_are_model_optimizers(model, case, x, fixture)


def test_per_token_dynamic_input_keeps_no_amax_and_quantizes_each_row(fixture):
    model, _, x = quantize_like_the_fixture(fixture, "fp8_per_channel_per_token")
    q = model.fc1.input_quantizer
    assert q.is_dynamic
    assert q.amax is None
    row_amax = x.abs().amax(dim=-1, keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(q(x), mtq.fake_quant(x, "e4m3", row_amax), atol=0, rtol=0)


def test_parent_class_as_written_for_model_optimizer(fixture):
    model, _, _ = quantize_like_the_fixture(fixture, "fp8_parent_class")
    assert model.fc1.weight_quantizer.is_enabled
    assert model.fc3.input_quantizer.is_enabled
    assert not model.fc2.weight_quantizer.is_enabled  # "fc2.*" disabled after the nn.Linear entries


# ----------------------------------------------------------------------------------------------------------- states


@pytest.mark.parametrize("name", INT_CASES + FP8_CASES)
def test_model_optimizer_quantizer_states_set_our_quantizers(fixture, name):
    model, case, _ = quantize_like_the_fixture(fixture, name)
    for qname, state in case["quantizer_state"].items():
        fresh = TensorQuantizer()
        fresh.set_from_modelopt_state(state)
        ours = model.get_submodule(qname)
        assert fresh.is_enabled == ours.is_enabled, qname
        if ours.is_enabled:
            assert (fresh.fmt, fresh.block_size, fresh.static_block_size, fresh.narrow_range, fresh.is_dynamic) == (
                ours.fmt, ours.block_size, ours.static_block_size, ours.narrow_range, ours.is_dynamic), qname
            # A per-token quantizer is saved by Model Optimizer after its first forward with the kept axes in place
            # of block_sizes {-1: None}: the same amax on the 2-D activations it saw.
            x = fixture["test"]
            if ours.is_dynamic:
                assert torch.equal(fresh.amax_of(x), ours.amax_of(x)), qname
            else:
                assert fresh.axis == ours.axis, qname
            assert (fresh.amax is None) == (ours.amax is None), qname
            assert fresh.amax is None or fresh.amax.shape == ours.amax.shape, qname
        # Our own state round-trips and names Model Optimizer's attributes.
        mine = ours.get_modelopt_state()
        assert {"_num_bits", "_axis", "_block_sizes", "_narrow_range", "_disabled"} <= set(mine)
        again = TensorQuantizer()
        again.set_from_modelopt_state(mine)
        assert again.cfg.model_dump() == ours.cfg.model_dump()
        assert again.is_enabled == ours.is_enabled


@pytest.mark.parametrize("name", ["int8_default", "int4_blockwise", "fp8_default"])
def test_restore_reads_the_file_mto_save_wrote(fixture, name, tmp_path):
    case = fixture["cases"][name]
    path = tmp_path / "modelopt.pth"
    path.write_bytes(case["mto_save"])
    fresh = nn.Sequential(OrderedDict(fc1=nn.Linear(128, 32), act1=nn.ReLU(), fc2=nn.Linear(32, 16),
                                      act2=nn.ReLU(), fc3=nn.Linear(16, 8)))
    mto.restore(fresh, path)
    for key, expected in case["amax"].items():
        assert differing(fresh.state_dict()[key], expected) == 0, key
    ours, _, x = quantize_like_the_fixture(fixture, name)
    with torch.no_grad():
        assert differing(fresh(x), ours(x)) == 0


def test_restore_from_modelopt_state_then_load_state_dict(fixture):
    case = fixture["cases"]["int8_default"]
    saved = load_plain(io.BytesIO(case["mto_save"]))
    fresh = model_like_the_fixture(fixture, torch.float32)
    fresh = mto.restore_from_modelopt_state(fresh, saved["modelopt_state"])
    fresh.load_state_dict(saved["model_state_dict"])
    assert fresh.fc1.weight_quantizer.axis == 0
    assert not fresh.fc1.output_quantizer.is_enabled
    for key, expected in case["amax"].items():
        assert differing(fresh.state_dict()[key], expected) == 0, key


# ---------------------------------------------------------------------------------------------------------- configs


def test_every_supported_preset_of_model_optimizer_validates():
    presets = torch.load(FIXTURES / "presets.pt", weights_only=True)
    for name in ("FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT8_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
                 "INT8_WEIGHT_ONLY_CFG", "FP8_PER_CHANNEL_PER_TOKEN_CFG", "NVFP4_EXPERTS_ONLY_CFG", "W4A16_NVFP4_CFG"):
        cfg = to_config(copy.deepcopy(presets[name]))
        assert cfg.quant_cfg[0].quantizer_name == "*"
        assert cfg.quant_cfg[0].enable is False
    nvfp4 = to_config(presets["NVFP4_DEFAULT_CFG"]).resolve("fc.weight_quantizer", ("Linear",))
    assert nvfp4.format == "nvfp4"
    assert nvfp4.effective_bits == 4.5
    int4 = to_config(presets["INT4_BLOCKWISE_WEIGHT_ONLY_CFG"]).resolve("fc.weight_quantizer", ("Linear",))
    assert int4.static_block_size == 128
    assert int4.block_size is None


@pytest.mark.parametrize("name", ["INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG"])
def test_presets_of_features_we_do_not_have_fail_pointing_to_the_differences_table(name):
    presets = torch.load(FIXTURES / "presets.pt", weights_only=True)
    with pytest.raises(ConfigError, match=r"awq_lite.*docs/modelopt_compat\.md"):
        to_config(copy.deepcopy(presets[name]))
