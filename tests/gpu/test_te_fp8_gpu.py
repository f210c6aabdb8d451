"""``gemm: te_fp8`` on one GPU: quantized Transformer Engine grouped linears run their forward GEMMs as real FP8 GEMMs
with the calibrated scales (``modelopt_moe.plugins.te_fp8``).

* (i) the FP8 codes TE computes for the expert weights and tokens are :func:`modelopt_moe.numerics.quantize`'s, bit for
  bit (saturation, zeros and subnormals included); with their scale they dequantize to the fp32 fake quant bit for
  bit, and cast to bf16 to the fake-quant path's operand;
* (ii) the forward equals the exact (float64) product of those FP8 operands up to the bf16 output rounding, and the
  fake-quant forward (which multiplies the bf16-rounded values ``q / s``) within FP8-operand rounding;
* (iii) the input, weight and bias gradients of every backward mode that keeps bf16 backward GEMMs are the fake-quant
  path's, bit for bit: both run TE's bf16 grouped GEMMs on the same operands; with ``backward.mode: quantized`` (no
  bias, no learned amax) dgrad, and wgrad with aligned token counts and no router probabilities, are FP8 GEMMs: the
  exact (float64) products of the gradient's, weights' and tokens' FP8 codes up to the bf16 output rounding, and
  close to the fake-quant gradients;
* (iv) a Megatron GPT with ``TEGroupedMLP`` experts trains in Megatron's loop with ``te_fp8``; the amaxes stay;
  (timings: tools/bench_te_grouped_step.py, variants te_fp8 reuse / re-quantize).

Measured numbers are printed with the prefix ``TE_FP8`` (pytest ``-s``) and appended to ``$OUT/te_fp8_numbers.txt``
when ``OUT`` is set. Run: ``bash tools/run_gpu_suite.sh tests -k te_fp8 -s``.
"""

import contextlib
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability 8.9 or newer", allow_module_level=True)


import modelopt_moe.quantization as mtq  # noqa: E402
from modelopt_moe.numerics import Quantized, dequantize, fake_quant, quantize  # noqa: E402
from modelopt_moe.plugins import te_fp8  # noqa: E402
from modelopt_moe.quantization.config import ConfigError  # noqa: E402

N, IN, OUT = 4, 256, 128
SPLITS = [96, 0, 37, 123]  # ragged, and expert 1 gets no token
TOKENS = sum(SPLITS)
# te_fp8 vs the exact product of its FP8 operands: the bf16 rounding of the output (<= 2**-9 relative per element,
# ~1.1e-3 rms); fp32 split accumulation adds ~1e-5 at K=256.
EXACT_BOUND = 3e-3
# te_fp8 vs fake quant: the fake-quant GEMM multiplies q/s rounded to bf16 (<= 2**-9 relative per operand, ~1.6e-3
# rms on a sum of random-sign products), and both round the output to bf16: ~2.5e-3 expected.
FAKE_QUANT_BOUND = 1e-2


def _report(line: str) -> None:
    print(f"TE_FP8 {line}", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "te_fp8_numbers.txt"), "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _layer(bias="none", seed=0, n=N, k=IN, out=OUT):
    torch.manual_seed(seed)
    layer = te.GroupedLinear(n, k, out, bias=bias != "none", return_bias=bias == "return",
                             params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():  # a distinct magnitude per expert: a wrong expert's scale cannot pass
        for i in range(n):
            getattr(layer, f"weight{i}").mul_(1.0 + 0.5 * i)
            if bias != "none":
                getattr(layer, f"bias{i}").normal_()
    return layer


def _config(mode="dequantized", ste="pass_through", weight_amax="vectorized", input_amax="per_expert",
            gemm="te_fp8", preset="fp8_default.yaml"):
    cfg = mtq.load_config(preset)
    cfg.gemm = gemm
    cfg.experts.weight_amax, cfg.experts.input_amax = weight_amax, input_amax
    cfg.backward.mode, cfg.backward.ste = mode, ste
    cfg.weight_amax_update = "static"  # amaxes that training leaves alone (the tests scale weights past them)
    return cfg


def _tokens(seed, rows=TOKENS, k=IN):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)


def _quantized(cfg, bias="none"):
    layer = _layer(bias)
    x = _tokens(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    return layer


@contextlib.contextmanager
def _gemm(model, gemm):
    """Every quantized module of ``model`` with ``gemm`` for the block (the same weights and amaxes)."""
    modules = [m for m in model.modules() if hasattr(m, "quant_gemm")]
    saved = [m.quant_gemm for m in modules]
    for m in modules:
        m.quant_gemm = gemm
    try:
        yield
    finally:
        for m, k in zip(modules, saved, strict=True):
            m.quant_gemm = k


def _run(layer, x, g, splits=SPLITS):
    x = x.clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    result = layer(x, splits)
    y = result[0] if isinstance(result, tuple) else result
    y.backward(g)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, result


def _exact(layer, x):
    """The float64 product of the FP8 operands, ``q_x q_w^T / (s_x s_w)`` (+ bias) per expert."""
    iq, wq = layer.input_quantizer, layer.weight_quantizer
    outs = []
    for i, (chunk, w) in enumerate(zip(torch.split(x, SPLITS), layer.expert_weights(), strict=True)):
        qx, qw = quantize(chunk.float(), "e4m3", iq.amax[i]), quantize(w.detach().float(), "e4m3", wq.amax[i])
        y = (qx.values.double() @ qw.values.double().t()) / (qx.scale.double() * qw.scale.double())
        if layer.apply_bias:
            y = y + getattr(layer, f"bias{i}").double()
        outs.append(y)
    return torch.cat(outs)


def _codes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float8_e4m3fn).view(torch.uint8)


# ---------------------------------------------------------------------------------------------------------- (i)
@pytest.mark.parametrize(("weight_amax", "input_amax"), [("vectorized", "per_expert"), ("shared", "shared"),
                                                     ("per_expert", "per_expert")])
def test_fp8_codes_are_the_fake_quant_codes_bit_for_bit(weight_amax, input_amax):
    layer = _quantized(_config(weight_amax=weight_amax, input_amax=input_amax))
    iq, wq = layer.input_quantizer, layer.weight_quantizer
    weights = layer.expert_weights()
    with torch.no_grad():
        weights[2].mul_(1.5)  # past its static amax: saturates at +-448
        weights[3][0, :4] = torch.tensor([0.0, -0.0, 1e-6, -1e-6], device="cuda")  # zeros, FP8 subnormals
    amax_before = (iq.amax.clone(), wq.amax.clone())
    fp8_weights = te_fp8.quantize_weights(layer, weights)
    saturated = 0
    for i, (w, t) in enumerate(zip(weights, fp8_weights, strict=True)):
        ref = quantize(w.detach().float(), "e4m3", wq.amax[i])
        assert torch.equal(t._data, _codes(ref.values)), f"expert {i}: FP8 codes differ from numerics.quantize"
        values = t._data.view(torch.float8_e4m3fn).float()
        fp32 = dequantize(Quantized("e4m3", values, ref.scale))
        assert torch.equal(fp32, fake_quant(w.detach().float(), "e4m3", wq.amax[i])), i
        assert torch.equal(fp32.to(torch.bfloat16), fake_quant(w.detach(), "e4m3", wq.amax[i])), i
        # TE's GEMM scales the product by scale_inv = 1/s, the fp32 reciprocal of our scale (within 1 ulp)
        torch.testing.assert_close(t._scale_inv.reshape(()), (1.0 / ref.scale.double()).float(), rtol=1.2e-7, atol=0)
        saturated += int((values.abs() == 448).sum())
    assert saturated > 0

    x = _tokens(5) * 3  # past the calibrated input amax
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-6, -1e-6], dtype=torch.bfloat16, device="cuda")
    fp8_inputs = te_fp8.quantize_inputs(layer, x, SPLITS)
    for i, (chunk, t) in enumerate(zip(torch.split(x, SPLITS), fp8_inputs, strict=True)):
        assert tuple(t._data.shape) == tuple(chunk.shape)
        ref = quantize(chunk.float(), "e4m3", iq.amax[i])
        assert torch.equal(t._data, _codes(ref.values)), f"expert {i}: input FP8 codes differ"
    # TE's cast left them
    assert torch.equal(iq.amax, amax_before[0])
    assert torch.equal(wq.amax, amax_before[1])
    _report(f"codes {weight_amax}/{input_amax}: weight and input FP8 codes bit-identical to numerics.quantize "
            f"({saturated} saturated weight elements)")


# --------------------------------------------------------------------------------------------------------- (ii)
@pytest.mark.parametrize(("bias", "input_amax"),
                         [("none", "per_expert"), ("apply", "shared"), ("return", "per_expert")])
def test_forward_is_the_fp8_product_and_close_to_fake_quant(bias, input_amax):
    layer = _quantized(_config(input_amax=input_amax), bias)
    x = _tokens(7)
    with torch.no_grad():
        got = layer(x, SPLITS)
        with _gemm(layer, "fake_quant"):
            fake = layer(x, SPLITS)
    if bias == "return":
        assert isinstance(got, tuple)
        assert len(got[1]) == N
        assert all(torch.equal(a, b) for a, b in zip(got[1], fake[1], strict=True))
        got, fake = got[0], fake[0]
    assert got.dtype == torch.bfloat16
    assert got.shape == (TOKENS, OUT)
    assert torch.isfinite(got).all()
    exact = _exact(layer, x)
    rel_exact, rel_fake = _rel(got, exact), _rel(got, fake)
    max_abs = (got.double() - fake.double()).abs().max().item()
    scale = fake.double().abs().max().item()
    _report(f"forward bias={bias} input_amax={input_amax}: rel_fro(te_fp8, exact fp8 product)={rel_exact:.3e} "
            f"rel_fro(fake quant, exact)={_rel(fake, exact):.3e} rel_fro(te_fp8, fake quant)={rel_fake:.3e} "
            f"max_abs(te_fp8 - fake quant)={max_abs:.3e} (max|y|={scale:.3e}, ratio {max_abs / scale:.3e})")
    assert rel_exact < EXACT_BOUND, rel_exact
    assert rel_fake < FAKE_QUANT_BOUND, rel_fake
    assert not torch.equal(got, fake)  # the FP8 GEMM did run


def test_te_fp8_forward_runs_the_fp8_gemm_and_leaves_the_amax(monkeypatch):
    layer = _quantized(_config())
    calls = []
    real = te_fp8.forward
    monkeypatch.setattr(te_fp8, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    before = (layer.input_quantizer.amax.clone(), layer.weight_quantizer.amax.clone())
    x = _tokens(8).requires_grad_(True)
    layer(x, SPLITS).float().square().mean().backward()
    assert calls == [1]
    assert torch.equal(layer.input_quantizer.amax, before[0])
    assert torch.equal(layer.weight_quantizer.amax, before[1])


# -------------------------------------------------------------------------------------------------------- (iii)
@pytest.mark.parametrize(("mode", "ste", "bias"), [
    ("dequantized", "pass_through", "none"),
    ("dequantized", "clipped", "apply"),
    ("high_precision", "pass_through", "none"),
    ("quantized", "pass_through", "apply"),  # with a bias the quantized backward stays on bf16 GEMMs
])
def test_gradients_are_the_fake_quant_gradients_bit_for_bit(mode, ste, bias):
    layer = _quantized(_config(mode, ste), bias)
    with torch.no_grad():
        layer.weight1.mul_(1.3)  # past the static amax: the clipped STE masks something
    x = _tokens(9) * 1.5
    g = _tokens(10, k=OUT)
    fp8 = _run(layer, x, g)
    with _gemm(layer, "fake_quant"):
        fake = _run(layer, x, g)
    assert sorted(fp8[2]) == sorted(fake[2])
    diffs = {"input": (fp8[1].double() - fake[1].double()).abs().max().item()}
    for name in fake[2]:
        diffs[name] = (fp8[2][name].double() - fake[2][name].double()).abs().max().item()
    _report(f"gradients mode={mode} ste={ste} bias={bias}: max |te_fp8 - fake quant| "
            + " ".join(f"{k}={v:.3e}" for k, v in diffs.items()) + f"; forward rel_fro {_rel(fp8[0], fake[0]):.3e}")
    assert torch.equal(fp8[1], fake[1]), "input gradient"
    for name in fake[2]:
        assert torch.equal(fp8[2][name], fake[2][name]), name
    # expert 1 has no token: zeros there
    assert fp8[1].abs().sum() > 0
    assert fp8[2]["weight0"].abs().sum() > 0


def _exact_grads(layer, x, g, grad_fmt, ste, splits):
    """The float64 products of the FP8 operands that ``backward.mode: quantized`` multiplies: dgrad ``Q(g) Q(w)``
    and wgrad ``Q(g)^T Q(x)`` per expert, ``Q(g)`` with one scale from ``max|g|`` (masked by the clipped STE)."""
    iq, wq = layer.input_quantizer, layer.weight_quantizer
    qg = quantize(g.float(), grad_fmt, g.float().abs().amax())
    dgrads, wgrads = [], {}
    start = 0
    for i, (rows, w) in enumerate(zip(splits, layer.expert_weights(), strict=True)):
        gv = qg.values[start:start + rows].double() / qg.scale.double()
        chunk = x[start:start + rows]
        qx, qw = quantize(chunk.float(), "e4m3", iq.amax[i]), quantize(w.detach().float(), "e4m3", wq.amax[i])
        d = gv @ (qw.values.double() / qw.scale.double())
        wg = gv.t() @ (qx.values.double() / qx.scale.double())
        if ste == "clipped":
            d = d * (chunk.float().abs() <= iq.amax[i]).double()
            wg = wg * (w.detach().float().abs() <= wq.amax[i]).double()
        dgrads.append(d)
        wgrads[f"weight{i}"] = wg
        start += rows
    return torch.cat(dgrads), wgrads


# Token counts that are multiples of 16 (FP8 wgrad), and the ragged SPLITS (bf16 wgrad, the fake-quant path's)
ALIGNED = [96, 0, 48, 112]


@pytest.mark.parametrize(("ste", "grad_bits", "splits"), [("pass_through", "e5m2", ALIGNED),
                                                          ("clipped", "e4m3", ALIGNED),
                                                          ("pass_through", "e5m2", SPLITS)])
def test_quantized_backward_runs_fp8_gemms_on_the_gradient_codes(monkeypatch, ste, grad_bits, splits):
    """``backward.mode: quantized``: dgrad (and wgrad, when every token count is a multiple of 16) are FP8 GEMMs of
    the quantized output gradient with the weights' (tokens') codes: the exact product up to the bf16 output
    rounding, close to the fake-quant gradients. With ragged counts wgrad is the fake-quant path's, bit for bit."""
    cfg = _config("quantized", ste)
    cfg.backward.grad_num_bits = grad_bits
    layer = _quantized(cfg)
    with torch.no_grad():
        layer.weight2.mul_(1.3)  # past the static amax: the clipped STE masks something
    x = _tokens(9) * 1.5
    g = _tokens(10, k=OUT)
    g[3, :3] = torch.tensor([0.0, -0.0, 1e-30], dtype=torch.bfloat16, device="cuda")  # zeros, below E5M2's range
    layouts = []
    real = te_fp8._te().grouped_gemm
    api = te_fp8._te()

    def spy(a, b, *args, layout="TN", **kw):
        layouts.append((layout, type(a[0]).__name__, type(b[0]).__name__))
        return real(a, b, *args, layout=layout, **kw)

    monkeypatch.setattr(api, "grouped_gemm", spy)
    fp8 = _run(layer, x, g, splits)
    monkeypatch.setattr(api, "grouped_gemm", real)
    assert [lay for lay, *_ in layouts] == ["TN", "NN", "NT"], layouts
    fp8_gemms = layouts if splits is ALIGNED else layouts[:2]
    assert all(a == b == "Float8TensorStorage" for _, a, b in fp8_gemms), layouts
    with _gemm(layer, "fake_quant"):
        fake = _run(layer, x, g, splits)
    if splits is not ALIGNED:
        for name in fake[2]:
            assert torch.equal(fp8[2][name], fake[2][name]), name
    dgrad, wgrads = _exact_grads(layer, x, g, grad_bits, ste, splits)
    rel = {"input": (_rel(fp8[1], dgrad), _rel(fp8[1], fake[1]))}
    for name, exact in wgrads.items():
        rel[name] = (_rel(fp8[2][name], exact) if exact.abs().sum() else 0.0, _rel(fp8[2][name], fake[2][name])
                     if fake[2][name].abs().sum() else 0.0)
    _report(f"fp8 backward ste={ste} grad={grad_bits} splits={splits}: rel_fro(te_fp8, exact fp8 product) / "
            "(te_fp8, fake quant) " + " ".join(f"{k}={a:.2e}/{b:.2e}" for k, (a, b) in rel.items()))
    assert sorted(fp8[2]) == sorted(fake[2])
    for name, (to_exact, to_fake) in rel.items():
        if name == "input" or splits is ALIGNED:  # (the bf16 wgrad is the fake-quant one, checked above)
            assert to_exact < EXACT_BOUND, (name, to_exact)
        assert to_fake < FAKE_QUANT_BOUND, (name, to_fake)
    assert torch.equal(fp8[2]["weight1"], torch.zeros_like(fp8[2]["weight1"]))  # expert 1 has no token
    assert fp8[2]["weight0"].abs().sum() > 0
    assert (layer.weight2.detach().abs() > layer.weight_quantizer.amax[2]).any()  # the clipped STE masks weights
    assert not torch.equal(fp8[0], fake[0])  # the FP8 forward GEMM ran (its value differs from fake quant's)


@pytest.mark.parametrize(("mode", "ste"), [("dequantized", "pass_through"), ("dequantized", "clipped"),
                                     ("high_precision", "pass_through"), ("quantized", "pass_through")])
def test_router_probabilities_scale_the_fp8_output_and_get_the_fake_quant_gradients(mode, ste):
    """As an expert down projection given its tokens' router probabilities: the FP8 GEMM's output rows times the
    probabilities (the engines' order), and every gradient, the probabilities' included, the fake-quant path's bit
    for bit; under ``quantized`` dgrad is an FP8 GEMM, so the input and probability gradients are close to the
    fake-quant ones and the weight gradients (bf16 wgrad on ``scale_rows(Q(x), p)``) still equal them."""
    from modelopt_moe.numerics import scale_rows
    from modelopt_moe.quantization.nn.row_scale import down_proj_row_scale

    layer = _quantized(_config(mode, ste))
    x, g = _tokens(9) * 1.5, _tokens(10, k=OUT)
    p0 = torch.rand(TOKENS, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))

    def run():
        xx, p = x.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        for q in layer.parameters():
            q.grad = None
        with down_proj_row_scale(layer, p):
            y = layer(xx, SPLITS)
        y.backward(g)
        return y.detach(), xx.grad, p.grad, {n: q.grad.clone() for n, q in layer.named_parameters()
                                             if q.grad is not None}

    fp8 = run()
    with _gemm(layer, "fake_quant"):
        fake = run()
    with torch.no_grad():
        plain = layer(x, SPLITS)  # the FP8 GEMM without the probabilities
    assert torch.equal(fp8[0], scale_rows(plain, p0))
    rel = _rel(fp8[0], fake[0])
    grad_rel = (_rel(fp8[1], fake[1]), _rel(fp8[2], fake[2]))
    _report(f"router probabilities mode={mode} ste={ste}: rel_fro(te_fp8, fake quant) {rel:.3e}, input gradient "
            f"{grad_rel[0]:.3e}, probability gradient {grad_rel[1]:.3e}")
    assert rel < FAKE_QUANT_BOUND, rel
    if mode == "quantized":  # FP8 dgrad
        assert 0 < grad_rel[0] < FAKE_QUANT_BOUND, grad_rel
        assert grad_rel[1] < FAKE_QUANT_BOUND, grad_rel
    else:
        assert torch.equal(fp8[1], fake[1]), "input gradient"
        assert torch.equal(fp8[2], fake[2]), "probability gradient"
    assert fp8[2].abs().sum() > 0
    assert sorted(fp8[3]) == sorted(fake[3])
    assert all(torch.equal(fp8[3][n], fake[3][n]) for n in fake[3])


@pytest.mark.parametrize("mode", ["dequantized", "quantized"])  # quantized: the FP8 weights with transposed codes
def test_reuse_scope_reuses_the_fp8_weights_exactly_and_weight_writes_are_seen_outside_it(mode):
    layer = _quantized(_config(mode))
    x, g = _tokens(13), _tokens(14, k=OUT)
    plain = _run(layer, x, g)
    with mtq.reuse_quantized_weights(layer):
        first, second = _run(layer, x, g), _run(layer, x, g)
    for got in (first, second):
        assert torch.equal(got[0], plain[0])
        assert torch.equal(got[1], plain[1])
        assert all(torch.equal(got[2][n], plain[2][n]) for n in plain[2])
    with torch.no_grad():
        for w in layer.expert_weights():
            w.data.mul_(1.25)  # how Megatron's optimizers write: no version bump
    assert not torch.equal(_run(layer, x, g)[0], plain[0])


# ---------------------------------------------------------------------------------------------------- refusals
def test_a_config_the_fp8_gemm_cannot_run_fails_in_quantize():
    with pytest.raises(ConfigError, match="te_fp8.*\n.*nvfp4"):
        _quantized(_config(preset="nvfp4_default.yaml"))
    layer = _layer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="no calibrated amax"):
            mtq.quantize(layer, _config())  # no forward_loop: no input amax for a static scale


# --------------------------------------------------------------------------------------------------------- (iv)
@pytest.mark.parametrize("mode", ["dequantized", "quantized"])
def test_megatron_te_grouped_mlp_trains_with_te_fp8(megatron_one_gpu, monkeypatch, mode):
    import megatron_harness.models as mm

    from modelopt_moe.plugins.megatron import training as mt

    steps, micro = 6, 2
    model = mm.build_moe_gpt(num_experts=8, hidden=128, ffn_hidden=256, seed=1, experts="te",
                             params_dtype=torch.bfloat16)
    cfg = _config(mode, weight_amax="per_expert", input_amax="per_expert")
    calib = mm.text_batches(2, 32, 2)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: [mm.lm_loss(m, b) for b in calib])
    model.train()
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    assert type(fc1).__name__ == "QuantTEColumnParallelGroupedLinear"
    assert fc1.quant_gemm == "te_fp8"
    amax = {n: b.clone() for n, b in model.named_buffers() if n.endswith("_amax")}
    assert any(".experts.linear_fc2." in n for n in amax)
    calls, fp8_backward = [], []
    real, real_backward = te_fp8.forward, te_fp8._Fp8Gemm.backward
    monkeypatch.setattr(te_fp8, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(te_fp8._Fp8Gemm, "backward",
                        staticmethod(lambda *a: fp8_backward.append(1) or real_backward(*a)))

    trainer = mt.setup_training(model, reuse_quantized_weights=True)
    batches = mm.text_batches(2, 32, steps * micro, offset=100)
    losses = mt.train(trainer, batches, steps=steps, num_microbatches=micro)
    _report(f"megatron TEGroupedMLP te_fp8 backward {mode} losses {[round(v, 4) for v in losses]}")
    assert calls, losses
    assert bool(fp8_backward) == (mode == "quantized")  # quantized: FP8 backward GEMMs
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    trained = mt.unwrap(trainer.model)
    for name, b in trained.named_buffers():
        if name in amax:
            assert torch.equal(b, amax[name]), name  # static: training leaves every amax

    eval_batch = mm.text_batches(2, 32, 1, offset=1000)[0]
    with torch.no_grad():
        fp8_logits = mm.gather_logits(trainer.model.eval(), eval_batch).float()
        with _gemm(trained, "fake_quant"):
            fake_logits = mm.gather_logits(trainer.model, eval_batch).float()
    rel = _rel(fp8_logits, fake_logits)
    _report(f"megatron logits rel_fro(te_fp8, fake quant) = {rel:.3e} (2 MoE layers; a near-tie routing decision "
            "may flip between the two)")
    assert rel < 0.2  # a sanity bound: the per-GEMM agreement is (ii)'s
