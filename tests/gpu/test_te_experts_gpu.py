"""Transformer Engine experts on one GPU: Megatron ``TEGroupedMLP`` (``moe_grouped_gemm=True``) quantized in every
amax layout gives the ``SequentialMLP`` layer's output with the same weights, and gradients to every expert.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``.
"""

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")


import megatron_harness.models as mm  # noqa: E402
from te_moe_layers import hidden_states  # noqa: E402

import modelopt_moe.quantization as mtq  # noqa: E402
from modelopt_moe.numerics import fake_quant, scale_rows  # noqa: E402

EXPERTS, HIDDEN, FFN, TOKENS = 8, 256, 512, 512
LAYOUTS = ("shared", "vectorized", "per_expert")


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _moe_layers():
    """A TEGroupedMLP MoE layer and a SequentialMLP one with identical router and expert weights."""
    grouped = mm.build_moe_layer(transformer_engine=True, num_experts=EXPERTS, hidden=HIDDEN, ffn_hidden=FFN)
    sequential = mm.build_moe_layer(transformer_engine=False, num_experts=EXPERTS, hidden=HIDDEN, ffn_hidden=FFN)
    assert type(grouped.experts).__name__ == "TEGroupedMLP"
    assert type(sequential.experts).__name__ == "SequentialMLP"
    return grouped, sequential


def _hidden(seed):
    return hidden_states(seed, TOKENS, HIDDEN)


def _quantize(layer, preset, layout, input_amax="per_expert", ste="pass_through"):
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax = layout
    cfg.experts.input_amax = input_amax
    cfg.backward.ste = ste
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: [m(_hidden(s)) for s in range(2)])
    return layer


@pytest.fixture
def layers():
    """Fresh layers per test (Megatron's TE layers hold process groups: they do not deep-copy)."""
    return _moe_layers()


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml", "mxfp4_default.yaml",
                                    "mxfp8_default.yaml"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_te_grouped_experts_match_sequential_experts(layers, preset, layout):
    float_out = layers[0](_hidden(5))[0]
    grouped, sequential = (_quantize(m, preset, layout) for m in layers)
    assert type(grouped.experts.linear_fc1).__name__ == "QuantTEColumnParallelGroupedLinear"
    for gemm in ("linear_fc1", "linear_fc2"):
        for kind in ("weight_quantizer", "input_quantizer"):
            a = getattr(getattr(grouped.experts, gemm), kind)
            b = getattr(getattr(sequential.experts, gemm), kind)
            for i in range(EXPERTS):
                assert torch.equal(a.expert_amax(i), b.expert_amax(i)), (gemm, kind, i)
    x = _hidden(5)
    out_g, out_s = grouped(x)[0], sequential(x)[0]
    assert torch.isfinite(out_g).all()
    rel = ((out_g.float() - out_s.float()).norm() / out_s.float().norm()).item()
    assert rel < 1e-2, rel  # only the bf16 GEMM implementations differ
    assert ((out_g.float() - float_out.float()).norm() / float_out.float().norm()).item() > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_te_grouped_backward_reaches_every_expert_weight(layers, layout):
    grouped = _quantize(layers[0], "fp8_default.yaml", layout)
    x = _hidden(6).requires_grad_(True)
    grouped(x)[0].float().square().mean().backward()
    assert x.grad is not None
    assert torch.isfinite(x.grad).all()
    for gemm in ("linear_fc1", "linear_fc2"):
        for i in range(EXPERTS):
            grad = getattr(getattr(grouped.experts, gemm), f"weight{i}").grad
            assert grad is not None, (gemm, i)
            assert torch.isfinite(grad).all(), (gemm, i)
            assert grad.abs().sum() > 0, (gemm, i)


def _experts_inputs(layer, x):
    """The arguments the MoE layer passes its experts for ``x``: dispatched tokens, tokens per expert, probabilities."""
    captured = []
    hook = layer.experts.register_forward_pre_hook(lambda mod, args: captured.append(args) and None)
    with torch.no_grad():
        layer(x)
    hook.remove()
    return [t.detach().clone() for t in captured[0][:3]]


def _fake_quant_rows(q, t, splits):
    """Expert quantizer ``q``'s reference fake quant of the token matrix ``t`` (row blocks ``splits``)."""
    return torch.cat([fake_quant(c, q.fmt, q.expert_amax(i), q.block_size, **q.int_kwargs)
                      for i, c in enumerate(t.split(splits))])


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml", "mxfp4_default.yaml",
                                    "mxfp8_default.yaml"])
@pytest.mark.parametrize("input_amax", ["per_expert", "shared"])
def test_te_grouped_down_proj_input_is_the_prob_times_the_quantized_activation(layers, preset, input_amax,
                                                                               monkeypatch):
    """TEGroupedMLP's linear_fc2 GEMM receives ``prob * Q(act)`` (the fused kernel), bit for bit the reference on
    the token rows; its output is the engines' ``prob * down_proj(Q(act))`` up to the GEMM's rounding."""
    experts = _quantize(layers[0], preset, "vectorized", input_amax).experts
    hidden, tokens, probs = _experts_inputs(layers[0], _hidden(8))
    fc2 = experts.linear_fc2
    acts, operands = [], []
    real = te.GroupedLinear.forward

    def recording(self, inp, *args, **kwargs):  # TE's own forward (the GEMM), recording fc2's input operand
        if self is fc2:
            operands.append(inp.detach().clone())
        return real(self, inp, *args, **kwargs)

    monkeypatch.setattr(te.GroupedLinear, "forward", recording)
    hook = fc2.register_forward_pre_hook(lambda mod, args: acts.append(args[0].detach().clone()) and None)
    with torch.no_grad():
        out, bias = experts(hidden, tokens, probs)
    hook.remove()
    assert bias is None
    assert len(operands) == 1
    assert len(acts) == 1
    splits = tokens.tolist()
    q_act = _fake_quant_rows(fc2.input_quantizer, acts[0], splits)
    want = scale_rows(q_act, probs.reshape(-1))
    assert operands[0].dtype == want.dtype
    assert torch.equal(operands[0], want)
    wq = fc2.weight_quantizer
    engine = torch.cat([
        (a.float() @ fake_quant(getattr(fc2, f"weight{i}").detach(), wq.fmt, wq.expert_amax(i), wq.block_size,
                                **wq.int_kwargs).float().t()) * p.float().unsqueeze(-1)
        for i, (a, p) in enumerate(zip(q_act.split(splits), probs.reshape(-1).split(splits), strict=True))])
    rel = ((out.float() - engine).norm() / engine.norm()).item()
    assert rel < 1e-2, rel  # bf16 GEMM and rounding of the operand


@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_te_grouped_and_sequential_experts_give_the_router_the_same_gradient(layers, ste):
    """The router probabilities get their gradient through the down projection's input on both expert kinds."""
    grouped, sequential = (_quantize(m, "fp8_default.yaml", "vectorized", ste=ste) for m in layers)
    inputs = _experts_inputs(grouped, _hidden(9))
    g = torch.randn(inputs[0].shape[0], HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    res = {}
    for name, layer in (("grouped", grouped), ("sequential", sequential)):
        hidden, tokens, probs = (t.clone() for t in inputs)
        hidden.requires_grad_(True)
        probs.requires_grad_(True)
        out, _ = layer.experts(hidden, tokens, probs)
        out.backward(g.to(out.dtype))
        res[name] = (out.detach(), hidden.grad, probs.grad)
    assert res["grouped"][2] is not None
    assert res["grouped"][2].abs().sum() > 0
    for what, a, b in zip(("output", "token gradient", "probability gradient"), res["grouped"], res["sequential"],
                          strict=True):
        assert torch.isfinite(a).all(), what
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, (what, rel)  # only the bf16 GEMM implementations differ


@pytest.mark.parametrize("transformer_engine", [True, False], ids=["te_grouped", "sequential"])
def test_expert_biases_keep_megatrons_formula_under_the_router_probability_seam(transformer_engine):
    """With linear biases (``add_bias_linear``), the quantized layer with every quantizer disabled computes exactly
    Megatron's own layer: the seam that moves the router probability behind the down projection's quantizer adds a
    returned fc2 bias as ``out + prob * bias``, Megatron's formula, on each expert kind. Megatron's TEGroupedMLP and
    SequentialMLP themselves differ when biases are on, so each kind is compared with its own unquantized self.
    Megatron 0.19's SequentialMLP cannot backpropagate with biases at all (its ``output += bias * prob`` writes into
    the view a tensor-parallel reduce returned), so that kind is compared in the forward alone."""
    layer = mm.build_moe_layer(transformer_engine=transformer_engine, num_experts=EXPERTS, hidden=HIDDEN,
                               ffn_hidden=FFN, add_bias_linear=True)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "experts" in name and "bias" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    x = _hidden(5)

    def run():
        layer.zero_grad(set_to_none=True)
        if not transformer_engine:
            with torch.no_grad():
                return layer(x)[0], None, {}
        xx = x.clone().requires_grad_(True)
        out = layer(xx)[0]
        out.float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None and "bias" in n}
        return out.detach(), xx.grad, grads

    reference = run()
    _quantize(layer, "fp8_default.yaml", "vectorized")
    quantized = run()
    mtq.disable_quantizer(layer, "*")
    disabled = run()
    assert torch.equal(disabled[0], reference[0])
    if transformer_engine:
        assert torch.equal(disabled[1], reference[1])
        assert disabled[2].keys() == reference[2].keys()
        assert len(reference[2]) >= 2
    for name, g in reference[2].items():
        assert torch.equal(disabled[2][name], g), name
    rel = ((quantized[0].float() - reference[0].float()).norm() / reference[0].float().norm()).item()
    assert 1e-4 < rel < 0.1, rel  # quantized: close to, not equal to, the bf16 layer


def test_te_fp8_autocast_during_fake_quant_is_refused(layers):
    grouped = _quantize(layers[0], "fp8_default.yaml", "vectorized")
    with pytest.raises(RuntimeError, match="fp8_autocast"):
        with te.fp8_autocast(enabled=True):
            grouped(_hidden(7))


@pytest.mark.parametrize("input_amax", ["per_expert", "shared"])
def test_plain_te_grouped_linear_uses_the_kernel_path_and_matches_the_reference(input_amax):
    splits = [100, 0, 37, 119]
    x = torch.randn(sum(splits), 256, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for kernel in ("triton", "torch"):
        torch.manual_seed(3)  # the same weights for both
        m = te.GroupedLinear(4, 256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
        cfg = mtq.load_config("fp8_default.yaml")
        cfg.kernel = kernel
        cfg.experts.input_amax = input_amax
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(m, cfg, lambda mod: mod(x, splits))
        xi = x.clone().requires_grad_(True)
        y = m(xi, splits)
        y.float().sum().backward()
        outs[kernel] = (y.detach(), xi.grad, [m.weight0.grad, m.weight3.grad])
    assert torch.equal(outs["triton"][0], outs["torch"][0])
    assert torch.equal(outs["triton"][1], outs["torch"][1])
    assert all(torch.equal(a, b) for a, b in zip(outs["triton"][2], outs["torch"][2], strict=True))


def test_fused_wgrad_accumulation_is_refused_at_quantize_time_except_with_te_fp8():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    for gemm in ("fake_quant", "te_fp8"):
        m = te.GroupedLinear(2, 256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda",
                             fuse_wgrad_accumulation=True)
        cfg = mtq.load_config("fp8_default.yaml")
        cfg.gemm = gemm
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if gemm == "fake_quant":
                with pytest.raises(ValueError, match="no-gradient-accumulation-fusion"):
                    mtq.quantize(m, cfg, lambda mod: mod(x, [32, 32]))
            else:
                mtq.quantize(m, cfg, lambda mod: mod(x, [32, 32]))


def _quantized_te_grouped_linear(input_amax="per_expert", seed=3):
    torch.manual_seed(seed)
    layer = te.GroupedLinear(4, 256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.input_amax = input_amax
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda mod: mod(x, [64, 0, 100, 92]))
    return layer


def test_reuse_scope_on_te_grouped_linear_is_exact_and_data_writes_are_seen_outside_it():
    import copy

    splits = [64, 0, 100, 92]
    layer = _quantized_te_grouped_linear()
    weights = [layer.weight0, layer.weight1, layer.weight2, layer.weight3]
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)

    def run():
        xx = x.clone().requires_grad_(True)
        for w in weights:
            w.grad = None
        y = layer(xx, splits)
        y.backward(g)
        return y.detach(), xx.grad, [w.grad.clone() for w in weights]

    plain = run()
    with mtq.reuse_quantized_weights(layer):
        first, second = run(), run()
    for got in (first, second):
        assert torch.equal(got[0], plain[0])
        assert torch.equal(got[1], plain[1])
        assert all(torch.equal(a, b) for a, b in zip(got[2], plain[2], strict=True))
    with torch.no_grad():
        for w in weights:
            w.data.mul_(1.25)  # how Megatron's optimizers write: no version bump
    after = run()
    assert not torch.equal(after[0], plain[0])
    assert torch.equal(after[0], copy.deepcopy(layer)(x, splits).detach())


def test_quantized_te_grouped_linear_fwd_bwd_replays_from_a_cuda_graph():
    splits = [64, 0, 100, 92]
    layer = _quantized_te_grouped_linear()
    weights = [layer.weight0, layer.weight1, layer.weight2, layer.weight3]
    static_x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_g = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        y = layer(static_x, splits)
        y.backward(static_g)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the graph (fills the weight cache: the graph must not use it)
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in [static_x, *weights]:
        t.grad = torch.zeros_like(t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()

    for update in range(2):
        with torch.no_grad():  # an optimizer-like step between replays: the replay must see it
            for w in weights:
                w.mul_(1.0 + 0.1 * update)
        for t in [static_x, *weights]:
            t.grad.zero_()  # the graph accumulates into these very tensors
        graph.replay()
        torch.cuda.synchronize()
        # Eager reference through autograd.grad, leaving the captured .grad tensors alone.
        x = static_x.detach().clone().requires_grad_(True)
        y = layer(x, splits)
        want = torch.autograd.grad(y, [x, *weights], static_g)
        assert torch.equal(static_y, y.detach()), update
        for got, ref in zip([static_x.grad, *(w.grad for w in weights)], want, strict=True):
            assert torch.equal(got, ref), update


def test_quantized_grouped_linear_compiles_with_fullgraph_and_matches_eager():
    from modelopt_moe.quantization.nn import GroupedLinear

    splits = [64, 0, 100, 92]
    torch.manual_seed(4)
    layer = GroupedLinear(4, 256, 128, bias=False, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    cfg = mtq.load_config("nvfp4_default.yaml")
    cfg.experts.input_amax, cfg.backward.ste = "per_expert", "clipped"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda mod: mod(x, splits))

    def run(fn):
        for w in layer.parameters():
            w.grad = None
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        y.float().square().sum().backward()
        return y.detach(), xx.grad, [w.grad.clone() for w in layer.expert_weights()]

    eager = run(lambda t: layer(t, splits))
    compiled = run(torch.compile(lambda t: layer(t, splits), fullgraph=True))
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=0)
    for a, b in zip(compiled[2], eager[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
