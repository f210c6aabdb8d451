"""An expert down projection given its tokens' router probabilities (``down_proj_row_scale``): the framework-free
grouped linear quantizes (and calibrates on) its input ``x`` and feeds the GEMM ``scale_rows(Q(x), prob)``, in every
backward mode, STE, kernel path and in a step precision autoswitch samples."""

import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe import kernels as K
from modelopt_moe.numerics import clip_limit, fake_quant, scale_rows
from modelopt_moe.quantization.nn import GroupedLinear
from modelopt_moe.quantization.nn.row_scale import add_row_scaled_bias, down_proj_row_scale, row_scale_of

N, IN, OUT = 4, 32, 16
SPLITS = [5, 0, 7, 8]  # expert 1 gets no tokens
KERNELS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not K.kernels_available("cpu"), reason="Triton interpreter not active"))]


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SPLITS), IN, generator=g) * 3
    p = torch.rand(sum(SPLITS), generator=g)
    return x, p, torch.randn(sum(SPLITS), OUT, generator=g)


def _layer(kernel="torch", mode="dequantized", ste="pass_through", preset="fp8_default.yaml", calibrate_with=None):
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT)
    with torch.no_grad():  # a distinct magnitude per expert: a wrong expert index cannot pass
        for i, w in enumerate(layer.expert_weights()):
            w.mul_(1.0 + i)
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax, cfg.experts.input_amax = "vectorized", "per_expert"
    cfg.backward.mode, cfg.backward.ste, cfg.kernel, cfg.weight_amax_update = mode, ste, kernel, "static"
    x, p, _ = _data()

    def forward_loop(m):
        if calibrate_with is None:
            m(x, SPLITS)
        else:
            with down_proj_row_scale(m, calibrate_with):
                m(x, SPLITS)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, forward_loop)
    return layer


def _run(layer, x, p, g):
    x, p = x.clone().requires_grad_(True), p.clone().requires_grad_(True)
    for w in layer.parameters():
        w.grad = None
    with down_proj_row_scale(layer, p):
        y = layer(x, SPLITS)
    y.backward(g)
    return y.detach(), x.grad, p.grad, [w.grad.clone() for w in layer.expert_weights()]


def test_calibration_sees_the_input_before_the_probability():
    _, p, _ = _data()
    scaled = _layer(calibrate_with=p)
    x, _, _ = _data()
    want = torch.stack([c.abs().amax() if c.numel() else torch.tensor(0.0) for c in x.split(SPLITS)])
    seen = [i for i, m in enumerate(SPLITS) if m]
    assert torch.equal(scaled.input_quantizer.amax[seen], want[seen])
    assert row_scale_of(scaled) is None  # the scope ends with the block


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["dequantized", "high_precision", "quantized"])
@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_forward_and_gradients_match_a_hand_computed_reference(kernel, mode, ste):
    layer = _layer(kernel, mode, ste)
    layer.input_quantizer.amax = layer.input_quantizer.amax * 0.5  # something to clip
    x, p, g = _data(7)
    y, dx, dp, dws = _run(layer, x, p, g)

    ia, wa = layer.input_quantizer.amax, layer.weight_quantizer.amax
    xs, ps, gs = x.split(SPLITS), p.split(SPLITS), g.split(SPLITS)
    ws = [w.detach() for w in layer.expert_weights()]
    xq = [fake_quant(c, "e4m3", ia[i]) for i, c in enumerate(xs)]
    wq = [fake_quant(w, "e4m3", wa[i]) for i, w in enumerate(ws)]
    y_ref = torch.cat([scale_rows(xq[i], ps[i]) @ wq[i].t() for i in range(N)])
    assert torch.equal(y, y_ref)  # bit for bit, whatever the mode and kernel path
    if mode == "quantized":  # the gradient arriving at the GEMM output, fake-quantized per tensor
        full = torch.cat(gs)
        gs = torch.split(fake_quant(full, "e5m2", full.abs().amax()), SPLITS)
    x_op, w_op = (xs, ws) if mode == "high_precision" else (xq, wq)
    d_operand = [gs[i] @ w_op[i] for i in range(N)]  # the gradient of the GEMM's input operand
    want_dx = torch.cat([d * ps[i].unsqueeze(-1) for i, d in enumerate(d_operand)])
    want_dp = torch.cat([(d * x_op[i]).sum(-1) for i, d in enumerate(d_operand)])
    want_dw = [gs[i].t() @ scale_rows(x_op[i], ps[i]) for i in range(N)]
    if ste == "clipped":
        want_dx = want_dx * torch.cat([c.abs() <= clip_limit(ia[i]) for i, c in enumerate(xs)])
    torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dp, want_dp, rtol=1e-5, atol=1e-5)
    for got, want in zip(dws, want_dw, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["dequantized", "high_precision"])
def test_kernel_and_torch_paths_give_the_same_bits(mode):
    if not K.kernels_available("cpu"):
        pytest.skip("Triton interpreter not active")
    x, p, g = _data(3)
    for preset in ("fp8_default.yaml", "nvfp4_default.yaml", "int8_default.yaml"):
        a = _run(_layer("torch", mode, "clipped", preset), x, p, g)
        b = _run(_layer("triton", mode, "clipped", preset), x, p, g)
        assert torch.equal(a[0], b[0]), preset
        assert torch.equal(a[1], b[1]), preset
        assert torch.equal(a[2], b[2]), preset
        assert all(torch.equal(u, v) for u, v in zip(a[3], b[3], strict=True)), preset


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_sampled_autoswitch_step_takes_scaled_operands(tmp_path, kernel):
    """An outlier expert switched to high precision multiplies its unquantized input by the probabilities; the
    others their quantized one."""
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.weight_amax, cfg.experts.input_amax, cfg.kernel, cfg.weight_amax_update = (
        "vectorized", "per_expert", kernel, "static")
    cfg.autoswitch = {"every": 1, "underflow_pct": 20.0, "mse": 0.05, "gemms": ["fprop"],
                      "log_dir": str(tmp_path / "logs")}
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT)
    with torch.no_grad():
        layer.expert_weights()[2][0, 0] = 1e5
    x, p, g = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    with mtq.autoswitch_step(layer, 0), down_proj_row_scale(layer, p):
        y = layer(x, SPLITS)
    ia, wa = layer.input_quantizer.amax, layer.weight_quantizer.amax
    for i, (xi, pi, w) in enumerate(zip(x.split(SPLITS), p.split(SPLITS), layer.expert_weights(), strict=True)):
        rows = slice(sum(SPLITS[:i]), sum(SPLITS[:i + 1]))
        w = w.detach()
        if i == 2:
            want = scale_rows(xi, pi) @ w.t()
        else:
            want = scale_rows(fake_quant(xi, "e4m3", ia[i]), pi) @ fake_quant(w, "e4m3", wa[i]).t()
        assert torch.equal(y[rows].detach(), want), i


def test_scopes_do_not_nest_and_the_rows_must_match():
    layer = _layer()
    x, p, _ = _data()
    with down_proj_row_scale(layer, p):
        with pytest.raises(RuntimeError, match="already active"):
            with down_proj_row_scale(layer, p):
                pass
    assert row_scale_of(layer) is None
    with down_proj_row_scale(layer, p[:-1]), pytest.raises(ValueError, match="20 rows"):
        layer(x, SPLITS)
    assert row_scale_of(layer) is None


def test_a_bias_inside_the_gemm_is_refused():
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT, bias=True)
    x, p, _ = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, mtq.load_config("fp8_default.yaml"), lambda m: m(x, SPLITS))
    with down_proj_row_scale(layer, p), pytest.raises(NotImplementedError, match="bias"):
        layer(x, SPLITS)


def test_returned_bias_is_megatrons_formula_per_expert():
    out = torch.randn(sum(SPLITS), OUT).to(torch.bfloat16)
    biases = [torch.randn(OUT).to(torch.bfloat16) for _ in range(N)]
    _, p, _ = _data()
    # TEGroupedMLP._apply_bias: t + b * p per expert, in fp32, back to the output dtype
    want = torch.cat([(t + b * q.unsqueeze(-1)).to(out.dtype)
                      for t, b, q in zip(out.split(SPLITS), biases, p.split(SPLITS), strict=True)])
    assert torch.equal(add_row_scaled_bias(out, biases, p, SPLITS), want)
    assert torch.equal(add_row_scaled_bias(out, biases[0], p), (out + biases[0] * p.unsqueeze(-1)).to(out.dtype))
