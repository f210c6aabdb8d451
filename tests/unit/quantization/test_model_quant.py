"""The mtq verbs (modelopt_moe/quantization/model_quant.py) on a plain nn.Sequential of nn.Linear, on CPU."""

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization.conversion import is_quantized

# (preset, upper bound of the relative output change)
PRESETS = [("FP8_DEFAULT_CFG", 0.2), ("INT8_DEFAULT_CFG", 0.2), ("NVFP4_DEFAULT_CFG", 0.5),
           ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", 0.5)]


def _exact(actual, expected):
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def _model(seed=0):
    torch.manual_seed(seed)
    # 128 inputs: a multiple of INT4's 128-element blocks and of NVFP4's 16.
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))


def _batches(seed=1, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 128, generator=g) for _ in range(n)]


def _forward_loop(batches):
    def loop(model):
        for b in batches:
            model(b)
    return loop


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _quantized(preset="FP8_DEFAULT_CFG", seed=0):
    float_model = _model(seed)
    model = mtq.quantize(copy.deepcopy(float_model), getattr(mtq, preset), _forward_loop(_batches()))
    return float_model, model


@pytest.mark.parametrize(("preset", "bound"), PRESETS)
def test_quantize_each_preset_changes_outputs_plausibly_and_calibrates_every_enabled_quantizer(preset, bound):
    float_model = _model()
    model = copy.deepcopy(float_model)
    out = mtq.quantize(model, getattr(mtq, preset), _forward_loop(_batches()))
    assert out is model
    assert all(is_quantized(model[i]) for i in (0, 2))
    assert not is_quantized(model[1])
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        rel = _rel(model(x), float_model(x))
    assert 0 < rel < bound, rel
    enabled = [(n, q) for n, q, _ in mtq.named_quantizers(model) if q.is_enabled]
    expected_enabled = 2 if preset == "INT4_BLOCKWISE_WEIGHT_ONLY_CFG" else 4
    assert len(enabled) == expected_enabled, [n for n, _ in enabled]
    for name, q in enabled:
        assert q.amax is not None, name
        assert torch.isfinite(q.amax).all(), name
        assert (q.amax > 0).all(), name
        assert not q._if_calib, name
        assert q._if_quant, name


def test_calibrated_amaxes_are_the_max_of_weights_and_of_the_forward_loop_inputs():
    float_model, model = _quantized("INT8_DEFAULT_CFG")
    batches = _batches()
    _exact(model[0].weight_quantizer.amax, float_model[0].weight.abs().amax(dim=1, keepdim=True))
    _exact(model[0].input_quantizer.amax, torch.stack([b.abs().max() for b in batches]).max())
    hidden = [torch.relu(float_model[0](b)) for b in batches]
    _exact(model[2].input_quantizer.amax, torch.stack([h.abs().max() for h in hidden]).max().detach())


def test_quantized_forward_equals_hand_composed_fake_quant_linears():
    float_model, model = _quantized("FP8_DEFAULT_CFG")
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3)) * 3  # beyond the calibrated range
    l0, l2 = model[0], model[2]
    w0 = fake_quant(l0.weight, "e4m3", l0.weight_quantizer.amax)
    w2 = fake_quant(l2.weight, "e4m3", l2.weight_quantizer.amax)
    h = torch.relu(F.linear(fake_quant(x, "e4m3", l0.input_quantizer.amax), w0, l0.bias))
    y = F.linear(fake_quant(h, "e4m3", l2.input_quantizer.amax), w2, l2.bias)
    _exact(model(x), y)


def test_recalibration_resets_amax_instead_of_keeping_the_old_max():
    _, model = _quantized("FP8_DEFAULT_CFG")
    small = [b * 0.01 for b in _batches()]
    mtq.calibrate(model, "max", _forward_loop(small))
    _exact(model[0].input_quantizer.amax, torch.stack([b.abs().max() for b in small]).max())


class TinyConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv(x))


def test_quantize_model_without_linear_raises_naming_the_model_class():
    with pytest.raises(ValueError, match="TinyConvNet") as info:
        mtq.quantize(TinyConvNet(), mtq.FP8_DEFAULT_CFG)
    assert "Conv1d" in str(info.value)


def test_quantize_rejects_an_invalid_dict_config_before_touching_the_model():
    model = _model()
    bad = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    bad["quant_cfg"][0]["cfg"]["num_bits"] = (3, 3)
    with pytest.raises(mtq.ConfigError, match="num_bits"):
        mtq.quantize(model, bad)
    assert not any(is_quantized(m) for m in model.modules())


def test_print_quant_summary_lists_every_quantizer():
    _, model = _quantized("INT8_DEFAULT_CFG")
    buf = io.StringIO()
    text = mtq.print_quant_summary(model, file=buf)
    assert buf.getvalue().rstrip("\n") == text
    lines = text.splitlines()
    names = [n for n, _, _ in mtq.named_quantizers(model)]
    assert names == [f"{i}.{k}_quantizer" for i in (0, 2) for k in ("input", "weight", "output")]
    assert len(lines) == len(names) + 1
    for name, line in zip(names, lines, strict=False):
        assert line.split()[0] == name
    assert "axis=0" in lines[1]
    assert "int8" in lines[1]
    assert lines[2].endswith("disabled")
    assert lines[-1] == "4 of 6 quantizers enabled"


def test_enable_and_disable_quantizer_with_wildcards():
    float_model, model = _quantized("FP8_DEFAULT_CFG")
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    y_float = float_model(x)
    y_quant = model(x)
    assert not torch.equal(y_quant, y_float)

    assert mtq.disable_quantizer(model, "*") == 6
    assert not any(q.is_enabled for _, q, _ in mtq.named_quantizers(model))
    _exact(model(x), y_float)

    assert mtq.enable_quantizer(model, "*weight_quantizer") == 2
    w_only = F.linear(torch.relu(F.linear(x, fake_quant(model[0].weight, "e4m3", model[0].weight_quantizer.amax),
                                          model[0].bias)),
                      fake_quant(model[2].weight, "e4m3", model[2].weight_quantizer.amax), model[2].bias)
    _exact(model(x), w_only)

    assert mtq.enable_quantizer(model, "*input_quantizer") == 2
    _exact(model(x), y_quant)

    assert mtq.disable_quantizer(model, "0.*") == 3
    assert [n for n, q, _ in mtq.named_quantizers(model) if q.is_enabled] == ["2.input_quantizer",
                                                                             "2.weight_quantizer"]
    assert mtq.disable_quantizer(model, "no_such_layer.*") == 0


@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "INT8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG",
                                    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"])
def test_fold_weight_writes_fake_quantized_weights_and_keeps_outputs(preset):
    _, model = _quantized(preset)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = model(x)
    expected_w = {}
    for i in (0, 2):
        q = model[i].weight_quantizer
        amax = None if q.block_size is not None else q.amax
        expected_w[i] = fake_quant(model[i].weight.detach(), q.fmt, amax, q.block_size)
        assert not torch.equal(expected_w[i], model[i].weight)
    params_before = [id(p) for p in model.parameters()]
    assert mtq.fold_weight(model) is model
    assert [id(p) for p in model.parameters()] == params_before
    for i in (0, 2):
        _exact(model[i].weight.detach(), expected_w[i])
        assert not model[i].weight_quantizer.is_enabled
    with torch.no_grad():
        _exact(model(x), y)


def test_calibrate_without_forward_loop_warns(monkeypatch):
    monkeypatch.setattr("modelopt_moe.quantization.utils._warned", set())
    with pytest.warns(UserWarning, match="no forward_loop"):
        model = mtq.quantize(_model(), mtq.FP8_DEFAULT_CFG)
    assert model[0].input_quantizer.amax is None
    _exact(model[0].weight_quantizer.amax, model[0].weight.abs().max().detach())


def test_weight_only_calibration_without_forward_loop_does_not_warn(monkeypatch):
    monkeypatch.setattr("modelopt_moe.quantization.utils._warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mtq.quantize(_model(), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    assert model[0].weight_quantizer.amax is not None


def test_quantize_with_a_loaded_config_object():
    cfg = mtq.load_config("int8_default.yaml")
    float_model = _model()
    model = mtq.quantize(copy.deepcopy(float_model), cfg, _forward_loop(_batches()))
    assert model[0].weight_quantizer.fmt == "int8"
    assert model[0].weight_quantizer.axis == 0
    assert model[0].weight_quantizer.amax.shape == (128, 1)
    assert model[0].quant_backward == cfg.backward
