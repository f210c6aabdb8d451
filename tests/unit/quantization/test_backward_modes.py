"""Backward modes of a quantized GEMM (modelopt_moe/quantization/nn/functional.py) on a quantized nn.Linear.

Expected gradients are composed by hand from ``formats.fake_quant`` and matmuls:

* ``dequantized``:    dX = g @ Wq,  dW = g^T @ Xq
* ``high_precision``: dX = g @ W,   dW = g^T @ X
* ``quantized``:      G = fake_quant(g, e5m2, max|g|);  dX = G @ Wq,  dW = G^T @ Xq
* ``clipped`` STE multiplies dX by (|X| <= amax_x) and dW by (|W| <= amax_w).

The comparisons are exact (atol=0, rtol=0) in fp32: F.linear's autograd computes grad_input as ``g.mm(W)`` and
grad_weight as ``g.t().mm(X)`` for a 2-D input, the same products in the same order as the expressions here.
"""

import copy

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant

MODES = ["dequantized", "high_precision", "quantized"]
STES = ["pass_through", "clipped"]
TOKENS, IN, OUT = 5, 8, 4


def _exact(actual, expected):
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, IN, generator=g) * 2
    grad_out = torch.randn(TOKENS, OUT, generator=g)
    return x, grad_out


def _config(preset, mode, ste, how, grad_num_bits="e5m2"):
    if how == "dict":
        cfg = copy.deepcopy(getattr(mtq, preset))
        cfg["backward"] = {"mode": mode, "ste": ste, "grad_num_bits": grad_num_bits}
        cfg["weight_amax_update"] = "static"  # the hand-set weight amax below stays (dynamic would recompute it)
        return cfg
    cfg = mtq.load_config({"FP8_DEFAULT_CFG": "fp8_default.yaml", "INT8_DEFAULT_CFG": "int8_default.yaml"}[preset])
    cfg.backward.mode = mode
    cfg.backward.ste = ste
    cfg.backward.grad_num_bits = grad_num_bits
    cfg.weight_amax_update = "static"
    return cfg


def _quantized_linear(cfg, x, seed):
    torch.manual_seed(seed)
    layer = nn.Linear(IN, OUT, bias=True)
    mtq.quantize(layer, cfg, lambda m: m(x))
    # Amaxes well below max|x| and max|w| so that clipping happens in the forward and in the clipped STE.
    layer.input_quantizer.amax = layer.input_quantizer.amax * 0.5
    layer.weight_quantizer.amax = layer.weight_quantizer.amax * 0.6
    return layer


def _run(layer, x, grad_out):
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad_out)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _expected(layer, x, grad_out, mode, ste, grad_fmt="e5m2"):
    iq, wq = layer.input_quantizer, layer.weight_quantizer
    w = layer.weight.detach()
    xq = fake_quant(x, iq.fmt, iq.amax, **iq.int_kwargs)
    wq_ = fake_quant(w, wq.fmt, wq.amax, **wq.int_kwargs)
    y = torch.nn.functional.linear(xq, wq_, layer.bias.detach())
    if mode == "dequantized":
        dx, dw = grad_out @ wq_, grad_out.t() @ xq
    elif mode == "high_precision":
        dx, dw = grad_out @ w, grad_out.t() @ x
    else:
        gq = fake_quant(grad_out, grad_fmt, grad_out.abs().max())
        assert not torch.equal(gq, grad_out)
        dx, dw = gq @ wq_, gq.t() @ xq
    if ste == "clipped":
        mask_x, mask_w = x.abs() <= iq.amax, w.abs() <= wq.amax
        assert (~mask_x).any()
        assert (~mask_w).any()
        assert mask_x.any()
        assert mask_w.any()
        dx, dw = dx * mask_x, dw * mask_w
    return y, dx, dw


@pytest.mark.parametrize("how", ["dict", "load_config"])
@pytest.mark.parametrize("ste", STES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "INT8_DEFAULT_CFG"])
def test_gradients_match_hand_composed_fake_quant_matmuls(preset, mode, ste, how):
    seed = 100 + MODES.index(mode) * 10 + STES.index(ste)
    x, grad_out = _data(seed)
    layer = _quantized_linear(_config(preset, mode, ste, how), x, seed)
    assert layer.quant_backward.mode == mode
    assert layer.weight_quantizer.ste == ste
    assert (x.abs() > layer.input_quantizer.amax).any()
    y, dx, dw, db = _run(layer, x, grad_out)
    y_exp, dx_exp, dw_exp = _expected(layer, x, grad_out, mode, ste)
    _exact(y, y_exp)
    _exact(dx, dx_exp)
    _exact(dw, dw_exp)
    if mode != "quantized":
        _exact(db, grad_out.sum(0))


def test_quantized_mode_with_e4m3_gradients():
    x, grad_out = _data(7)
    layer = _quantized_linear(_config("FP8_DEFAULT_CFG", "quantized", "clipped", "dict", grad_num_bits=(4, 3)), x, 7)
    y, dx, dw, _ = _run(layer, x, grad_out)
    y_exp, dx_exp, dw_exp = _expected(layer, x, grad_out, "quantized", "clipped", grad_fmt="e4m3")
    _exact(y, y_exp)
    _exact(dx, dx_exp)
    _exact(dw, dw_exp)
    # e4m3 and e5m2 gradients differ, so the configured format is what was used.
    _, dx_e5m2, _ = _expected(layer, x, grad_out, "quantized", "clipped", grad_fmt="e5m2")
    assert not torch.equal(dx, dx_e5m2)


@pytest.mark.parametrize("ste", STES)
@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "INT8_DEFAULT_CFG"])
def test_forward_output_is_bit_identical_across_backward_modes(preset, ste):
    x, grad_out = _data(11)
    outputs, grads = {}, {}
    for mode in MODES:
        layer = _quantized_linear(_config(preset, mode, ste, "dict"), x, 11)
        y, dx, dw, _ = _run(layer, x, grad_out)
        outputs[mode], grads[mode] = y, (dx, dw)
    _exact(outputs["high_precision"], outputs["dequantized"])
    _exact(outputs["quantized"], outputs["dequantized"])
    # ...while the gradients of the three modes differ from each other.
    for a, b in [("dequantized", "high_precision"), ("dequantized", "quantized"), ("high_precision", "quantized")]:
        assert not torch.equal(grads[a][0], grads[b][0]), (a, b)
        assert not torch.equal(grads[a][1], grads[b][1]), (a, b)


@pytest.mark.parametrize("mode", ["dequantized", "high_precision", "quantized"])
def test_all_quantizers_disabled_gives_the_float_linear_forward_and_gradients(mode):
    x, grad_out = _data(12)
    layer = _quantized_linear(_config("FP8_DEFAULT_CFG", mode, "clipped", "dict"), x, 12)
    assert mtq.disable_quantizer(layer, "*") == 3
    ref = nn.Linear(IN, OUT)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    for got, want, what in zip(_run(layer, x, grad_out), _run(ref, x, grad_out), ["y", "dx", "dw", "db"],
                               strict=True):
        assert torch.equal(got, want), what
