"""``weight_amax_update: static | dynamic | learned`` on the framework-free grouped expert linear and nn.Linear:
what amax each forward uses, that the canonical amax holds it (checkpoints, export), weight reuse, the LSQ gradient."""

import copy
import pickle
import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe import kernels as K
from modelopt_moe.checkpoint import restore, save
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization import ConfigError, QuantizeConfig
from modelopt_moe.quantization.config import to_config
from modelopt_moe.quantization.nn import GroupedLinear, expert_weights

N, IN, OUT = 4, 32, 16
SPLITS = [5, 0, 7, 8]


def _cfg(update, preset="fp8_default.yaml", layout="vectorized", kernel="torch", ste="pass_through"):
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax, cfg.experts.input_amax = layout, "per_expert"
    cfg.kernel, cfg.backward.ste = kernel, ste
    cfg.weight_amax_update = update
    return cfg


def _grouped(update, **kw):
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT)
    with torch.no_grad():
        for i, w in enumerate(layer.expert_weights()):
            w.mul_(1.0 + i)
    x = torch.randn(sum(SPLITS), IN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, _cfg(update, **kw), lambda m: m(x, SPLITS))
    return layer, x


def _grow(layer, factor=6.0):
    """What Megatron's optimizer does: write the weights through .data (no version bump)."""
    for w in layer.expert_weights():
        w.data.mul_(factor)


def _expected(layer, x, amax):
    """The reference forward: inputs and weights fake-quantized with the given weight amax per expert."""
    iq = layer.input_quantizer
    chunks = x.split(SPLITS)
    outs = []
    for i, (c, w) in enumerate(zip(chunks, layer.expert_weights(), strict=True)):
        xq = fake_quant(c, iq.fmt, iq.amax[i])
        outs.append(xq @ fake_quant(w.detach(), layer.weight_quantizer.fmt, amax[i]).t())
    return torch.cat(outs)


def test_config_choice_is_validated():
    assert QuantizeConfig().weight_amax_update in ("static", "dynamic", "learned")
    with pytest.raises(ConfigError, match="weight_amax_update"):
        to_config({"weight_amax_update": "sometimes"})
    with pytest.raises(ConfigError, match="shared"):
        to_config({"weight_amax_update": "learned", "experts": {"weight_amax": "shared"}})
    with pytest.raises(ConfigError, match="high_precision"):
        to_config({"weight_amax_update": "learned", "backward": {"mode": "high_precision"}})


def test_static_keeps_the_calibrated_amax_and_clips_grown_weights():
    layer, x = _grouped("static")
    calibrated = layer.weight_quantizer.amax.clone()
    _grow(layer)
    with torch.no_grad():
        y = layer(x, SPLITS)
    assert torch.equal(layer.weight_quantizer.amax, calibrated)
    assert torch.equal(y, _expected(layer, x, calibrated))


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["vectorized", "per_expert", "shared"])
def test_dynamic_recomputes_from_the_current_weights_and_stores_what_it_used(layout, kernel):
    if kernel == "triton" and not K.kernels_available("cpu"):
        pytest.skip("Triton interpreter not active")
    layer, x = _grouped("dynamic", layout=layout, kernel=kernel)
    _grow(layer)
    with torch.no_grad():
        y = layer(x, SPLITS)
    amax = torch.stack([w.detach().abs().amax() for w in layer.expert_weights()])
    if layout == "shared":
        amax = amax.max().expand(N)
    assert torch.equal(layer.weight_quantizer.amax, amax)  # the canonical amax: what checkpoints and export read
    assert torch.equal(y, _expected(layer, x, amax))


def test_dynamic_amax_of_n_experts_is_one_launch(monkeypatch):
    if not K.kernels_available("cpu"):
        pytest.skip("Triton interpreter not active")
    from modelopt_moe.kernels import weight_amax as kernel_amax

    layer, x = _grouped("dynamic", kernel="triton")
    calls = []
    real = kernel_amax._launch_weight_amax
    monkeypatch.setattr(kernel_amax, "_launch_weight_amax", lambda *a: calls.append(len(a[0])) or real(*a))
    with torch.no_grad():
        layer(x, SPLITS)
    assert calls == [N]


def _count_calls(monkeypatch, module, name) -> dict:
    calls, real = {"n": 0}, getattr(module, name)

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_dynamic_inside_a_reuse_scope_computes_once_and_sees_the_next_step(monkeypatch):
    layer, x = _grouped("dynamic")
    count = _count_calls(monkeypatch, expert_weights, "refresh_weight_amax")
    for step in range(2):
        with mtq.reuse_quantized_weights(layer):
            for _ in range(3):  # micro-batches of one step
                layer(x, SPLITS).sum().backward()
        _grow(layer, 2.0)  # the optimizer step, through .data
        assert count["n"] == step + 1
    with torch.no_grad():
        y = layer(x, SPLITS)
    amax = torch.stack([w.detach().abs().amax() for w in layer.expert_weights()])
    assert torch.equal(y, _expected(layer, x, amax))


def test_dynamic_dense_linear_and_gradient_accumulation():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(8, 32)
    mtq.quantize(lin, _cfg("dynamic"), lambda m: m(x))
    for _ in range(2):  # the second forward rewrites the amax the first one's backward may hold
        lin(x).sum().backward()
    lin.weight.data.mul_(5.0)
    with torch.no_grad():
        y = lin(x)
    amax = lin.weight.detach().abs().amax()
    assert torch.equal(lin.weight_quantizer.amax, amax)
    want = fake_quant(x, "e4m3", lin.input_quantizer.amax) @ fake_quant(lin.weight.detach(), "e4m3", amax).t()
    assert torch.equal(y, want + lin.bias.detach())


def test_update_weight_amax_and_fold_weight_use_the_current_weights():
    layer, x = _grouped("dynamic")
    _grow(layer)  # after the last optimizer step, no forward yet: the stored amax is the previous weights'
    assert mtq.update_weight_amax(layer) == 1
    amax = torch.stack([w.detach().abs().amax() for w in layer.expert_weights()])
    assert torch.equal(layer.weight_quantizer.amax, amax)
    _grow(layer, 1.5)
    mtq.fold_weight(layer)  # the export path: folded weights are what the next forward would have used
    amax = amax * 1.5
    assert all(torch.equal(w, fake_quant(w, "e4m3", amax[i])) for i, w in enumerate(layer.expert_weights()))


# ---------------------------------------------------------------------------------------------------------------
# learned


def _lsq_reference_grad(w, amax, g, fmt="e4m3"):
    """Autograd of q(w; amax) = s * R(w / s), s = amax / bound, R the fp8 rounding with a straight-through
    derivative inside the range and a constant at saturation: the LSQ derivative, times 1/sqrt(numel * bound)."""
    bound = 448.0
    a = amax.clone().requires_grad_(True)
    s = a / bound
    v = w / s
    rounded = fake_quant(v.detach(), fmt, torch.tensor(bound))  # R(v) on the scale-1 grid
    r = torch.where(v.detach().abs() <= bound, v + (rounded - v).detach(), rounded)
    q = s * r
    (q * g).sum().backward()
    return a.grad / (w.numel() * bound) ** 0.5


def test_learned_amax_is_a_parameter_with_the_lsq_gradient():
    layer, x = _grouped("learned")
    q = layer.weight_quantizer
    assert isinstance(q._amax, torch.nn.Parameter)
    assert any(p is q._amax for p in layer.parameters())
    assert "weight_quantizer._amax" in layer.state_dict()
    with torch.no_grad():
        q._amax.mul_(0.5)  # some weights saturate
    y = layer(x, SPLITS)
    g = torch.randn_like(y)
    y.backward(g)
    # reference: the GEMM's gradient at the fake-quantized weight, then LSQ per expert
    xq = [fake_quant(c, "e4m3", layer.input_quantizer.amax[i]) for i, c in enumerate(x.split(SPLITS))]
    gq = [gc.t() @ xc for gc, xc in zip(g.split(SPLITS), xq, strict=True)]
    want = torch.stack([_lsq_reference_grad(w.detach(), q.amax.detach()[i], gq[i])
                        for i, w in enumerate(layer.expert_weights())])
    torch.testing.assert_close(q._amax.grad, want, rtol=1e-5, atol=1e-9)
    assert q._amax.grad[0] != 0


def test_learned_amax_trains_and_the_forward_uses_it():
    layer, x = _grouped("learned", ste="clipped")
    q = layer.weight_quantizer
    opt = torch.optim.Adam([p for p in layer.parameters()], lr=1e-2)
    before = q.amax.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        layer(x, SPLITS).pow(2).mean().backward()
        opt.step()
    assert not torch.equal(q.amax.detach(), before)
    with torch.no_grad():
        y = layer(x, SPLITS)
    assert torch.equal(y, _expected(layer, x, q.amax.detach()))


def test_learned_amax_state_cast_copy_and_restore(tmp_path):
    layer, x = _grouped("learned", layout="per_expert")
    keys = [k for k in layer.state_dict() if k.startswith("weight_quantizer")]
    assert keys == [f"weight_quantizer.{i}._amax" for i in range(N)]
    layer.bfloat16()
    assert layer.weight_quantizer._amax.dtype == torch.float32
    assert layer.weight0.dtype == torch.bfloat16
    layer.float()
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone.weight_quantizer.learns_amax
        assert torch.equal(clone.weight_quantizer.amax, layer.weight_quantizer.amax)
    with torch.no_grad():
        layer.weight_quantizer._amax.mul_(0.9)
    save(layer, tmp_path / "q.pt")
    fresh = GroupedLinear(N, IN, OUT)
    restore(fresh, tmp_path / "q.pt")
    assert fresh.weight_quantizer.learns_amax
    assert fresh.weight_quantizer.amax_update == "learned"
    assert torch.equal(fresh.weight_quantizer.amax, layer.weight_quantizer.amax)


def test_learned_per_channel_amax_is_refused_by_name():
    cfg = _cfg("learned")
    cfg.quant_cfg[0].cfg = cfg.quant_cfg[0].cfg.model_copy(update={"axis": 0})
    lin = torch.nn.Sequential(torch.nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"0\.weight_quantizer: .*per-channel"):
        mtq.quantize(lin, cfg)


def test_learned_amax_inside_a_reuse_scope_sees_in_place_updates(monkeypatch):
    layer, x = _grouped("learned")
    calls = _count_calls(monkeypatch, expert_weights, "fake_quant")
    with mtq.reuse_quantized_weights(layer):
        layer(x, SPLITS).sum().backward()
        layer(x, SPLITS).sum().backward()
        assert calls["n"] == N  # computed once (one reference call per expert)
        with torch.no_grad():
            layer.weight_quantizer._amax.mul_(0.5)  # bumps the version the reuse key holds
        y = layer(x, SPLITS)
        assert calls["n"] == 2 * N
    assert torch.equal(y.detach(), _expected(layer, x, layer.weight_quantizer.amax.detach()))


def test_learned_expert_view_trains_its_own_row():
    from modelopt_moe.quantization import ExpertQuantizer, QuantizerAttributeConfig
    from modelopt_moe.quantization.weight_amax import quantize_weight_operand

    q = ExpertQuantizer(3, "vectorized", QuantizerAttributeConfig(num_bits="e4m3"))
    q.amax = torch.tensor([1.0, 0.5, 2.0])
    q.set_amax_update("learned")
    w = torch.randn(8, 16, requires_grad=True)
    out = quantize_weight_operand(None, q.view(1), w)
    assert torch.equal(out.detach(), fake_quant(w.detach(), "e4m3", torch.tensor(0.5)))
    out.pow(2).sum().backward()
    assert q._amax.grad[1] != 0
    assert q._amax.grad[0] == 0
    assert q._amax.grad[2] == 0
    assert w.grad is not None


@pytest.mark.parametrize("narrow_range", [False, True])
def test_learned_int_amax_of_a_dense_linear_quantizes_on_the_configs_integer_range(narrow_range):
    """A learned INT8 weight amax of an ``nn.Linear`` takes the config's ``narrow_range`` as a static one does: with
    ``false`` a weight clipped below the amax lands on -128, with ``true`` on -127."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(8, 32)
    cfg = {"quant_cfg": [{"quantizer_name": "*weight_quantizer",
                          "cfg": {"num_bits": 8, "axis": None, "narrow_range": narrow_range}},
                         {"quantizer_name": "*input_quantizer", "cfg": {"enable": False}}],
           "algorithm": "max", "weight_amax_update": "learned"}
    mtq.quantize(lin, cfg, lambda m: m(x))
    q = lin.weight_quantizer
    q.amax = q.amax.detach() / 2  # half the weights' max: the most negative ones clip
    with torch.no_grad():
        y = lin(x)
    w = fake_quant(lin.weight.detach(), "int8", q.amax.detach(), narrow_range=narrow_range)
    assert bool((w == -q.amax.detach() * 128 / 127).any()) != narrow_range
    assert torch.equal(y, x @ w.t() + lin.bias.detach())
