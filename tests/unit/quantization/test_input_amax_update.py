"""``input_amax_update: learned`` on nn.Linear and the framework-free grouped expert linear: the input amax is a
parameter started from the calibrated value, its gradient is the straight-through LSQ derivative (against an autograd
reference and a finite difference), one per layer (``shared``) or per expert, it trains and beats the static scale on
a tiny QAD run, and it survives a checkpoint round trip."""

import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.checkpoint import restore, save
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization import ConfigError
from modelopt_moe.quantization.config import to_config
from modelopt_moe.quantization.nn import GroupedLinear

N, IN, OUT = 4, 32, 16
SPLITS = [5, 0, 7, 8]


def _cfg(input_layout="per_expert", kernel="torch", ste="pass_through", fmt="e4m3"):
    cfg = mtq.load_config("fp8_default.yaml").model_dump()
    cfg["experts"] = {"weight_amax": "vectorized", "input_amax": input_layout}
    cfg["kernel"], cfg["backward"]["ste"] = kernel, ste
    cfg["weight_amax_update"], cfg["input_amax_update"] = "static", "learned"
    if fmt != "e4m3":
        # symmetric int levels [-B, B]: the range the derivative's clipping test uses
        cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "cfg": {"num_bits": fmt, "narrow_range": True}})
    return cfg


def _quantize(model, cfg, loop):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(model, cfg, loop)


def _grouped(**kw):
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT)
    per_row = torch.tensor([1.0, 1.0, 3.0, 0.5]).repeat_interleave(torch.tensor(SPLITS))
    x = torch.randn(sum(SPLITS), IN) * per_row[:, None]
    _quantize(layer, _cfg(**kw), lambda m: m(x, SPLITS))
    return layer, x


def _reference_amax_grad(x, amax, grad_q, fmt="e4m3"):
    """Autograd of q(x; amax) = s * R(x / s), s = amax / bound, R the rounding with a straight-through derivative
    inside the range and a constant where x saturates."""
    bound = {"e4m3": 448.0, 8: 127.0}[fmt]
    a = amax.detach().clone().requires_grad_(True)
    s = a / bound
    v = x / s
    rounded = fake_quant(v.detach(), fmt if fmt == "e4m3" else "int8", torch.tensor(bound))
    r = torch.where(v.detach().abs() <= bound, v + (rounded - v).detach(), rounded)
    (s * r * grad_q).sum().backward()
    return a.grad


def test_config_choices_and_refusals_name_the_key():
    assert to_config({}).input_amax_update == "static"
    with pytest.raises(ConfigError, match="input_amax_update"):
        to_config({"input_amax_update": "dynamic"})
    with pytest.raises(ConfigError, match="input_amax_update=learned with backward.mode=high_precision"):
        to_config({"input_amax_update": "learned", "backward": {"mode": "high_precision"}})
    with pytest.raises(ConfigError, match="input_amax_update=learned with gemm=te_fp8"):
        to_config({"input_amax_update": "learned", "gemm": "te_fp8"})
    cfg = _cfg()
    cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "cfg": {"num_bits": "e4m3", "axis": -1}})
    with pytest.raises(ValueError, match=r"0\.input_quantizer: .*learned amax .*per-channel"):
        _quantize(torch.nn.Sequential(torch.nn.Linear(16, 8)), cfg, lambda m: m(torch.randn(4, 16)))


def test_learned_inputs_without_calibration_are_refused_before_anything_changes():
    lin = torch.nn.Sequential(torch.nn.Linear(16, 8))
    with pytest.raises(ValueError, match="input_amax_update=learned starts every input amax from its calibrated "
                                         "value, but this call calibrates none"):
        mtq.quantize(lin, _cfg())
    assert type(lin[0]) is torch.nn.Linear


def test_yaml_key_reaches_the_input_quantizers_only(tmp_path):
    path = tmp_path / "learned_inputs.yaml"
    path.write_text("$import: fp8_default.yaml\nweight_amax_update: static\ninput_amax_update: learned\n")
    lin = torch.nn.Sequential(torch.nn.Linear(16, 8))
    x = torch.randn(4, 16)
    _quantize(lin, mtq.load_config(str(path)), lambda m: m(x))
    names = [n for n, _ in lin.named_parameters()]
    assert names == ["0.weight", "0.bias", "0.input_quantizer._amax"]
    assert lin[0].input_quantizer.amax.item() == x.abs().max().item()  # started from the calibrated value


@pytest.mark.parametrize("fmt", ["e4m3", 8])
def test_dense_input_amax_gradient_matches_the_lsq_reference(fmt):
    torch.manual_seed(1)
    lin = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    x = torch.randn(24, IN)
    _quantize(lin, _cfg(fmt=fmt), lambda m: m(x))
    q = lin[0].input_quantizer
    with torch.no_grad():
        q._amax.mul_(0.6)  # some inputs clip
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    w = lin[0].weight.detach()
    wq = fake_quant(w, "e4m3", w.abs().amax())
    want = _reference_amax_grad(x, q.amax, g @ wq, fmt)
    torch.testing.assert_close(q._amax.grad, want, rtol=1e-5, atol=1e-7)
    assert want != 0


def test_gradient_agrees_with_a_finite_difference_where_inputs_clip():
    """Where x clips, q = +-amax exactly, so d loss / d amax is a true derivative there (PACT's); with the other
    inputs 0 (q = 0 whatever the scale) a central difference of the loss must equal the backward."""
    lin = torch.nn.Sequential(torch.nn.Linear(4, 2, bias=False))
    x = torch.tensor([[0.0, 0.0, 8.0, -6.0], [5.0, 0.0, -9.0, 0.0]])
    _quantize(lin, _cfg(), lambda m: m(x))
    q = lin[0].input_quantizer
    with torch.no_grad():
        q._amax.fill_(4.0)
    lin(x).sum().backward()
    h = 1e-3

    def loss(a):
        with torch.no_grad():
            q._amax.fill_(a)
            return lin(x).sum().double()

    fd = (loss(4.0 + h) - loss(4.0 - h)) / (2 * h)
    torch.testing.assert_close(q._amax.grad.double(), fd, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_per_expert_and_shared_gradients(kernel):
    per, x = _grouped(input_layout="per_expert", kernel=kernel)
    shared, _ = _grouped(input_layout="shared", kernel=kernel)
    for layer in (per, shared):
        q = layer.input_quantizer
        assert isinstance(q._amax, torch.nn.Parameter)
        assert q.amax.shape == (N,)
        with torch.no_grad():
            q._amax.mul_(0.7)
    grads = {}
    for name, layer in (("per_expert", per), ("shared", shared)):
        y = layer(x, SPLITS)
        g = torch.linspace(-1, 1, y.numel()).reshape_as(y)
        y.backward(g)
        q = layer.input_quantizer
        want = []
        for i, (c, gc, w) in enumerate(zip(x.split(SPLITS), g.split(SPLITS), layer.expert_weights(), strict=True)):
            wq = fake_quant(w.detach(), "e4m3", layer.weight_quantizer.amax[i])
            want.append(_reference_amax_grad(c, q.amax[i], gc @ wq))
        grads[name] = (q._amax.grad, torch.stack(want))
    got, want = grads["per_expert"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert got[1] == 0
    assert (got[[0, 2, 3]] != 0).all()
    got, want = grads["shared"]
    torch.testing.assert_close(got, want.sum().expand(N), rtol=1e-5, atol=1e-7)  # one per layer: the total


def test_a_rank_whose_experts_get_no_token_still_takes_part():
    """An expert-parallel rank that the router sends no token (an empty token matrix) runs the backward too (every
    rank makes the gradient's collectives), with a zero gradient."""
    layer, _ = _grouped(input_layout="shared")
    x = torch.zeros(0, IN, requires_grad=True)
    layer(x, [0] * N).sum().backward()
    assert torch.equal(layer.input_quantizer._amax.grad, torch.zeros(N))
    assert x.grad.shape == (0, IN)


def test_learned_inputs_train_and_beat_the_static_scale_on_a_tiny_qad_run():
    """Distillation of a float teacher into its FP8-weight, INT4-input student, calibrated on a batch with one
    outlier (so the calibrated max wastes the four bits on the data that follows): the learned input amaxes move,
    and the held-out loss ends far below the static-scale run's. The amaxes get their own learning rate, as
    docs/qad.md advises (Adam moves a parameter by about lr per step, whatever its size)."""

    def data(seed, outlier=False):
        x = torch.randn(256, IN, generator=torch.Generator().manual_seed(seed))
        if outlier:
            x[0, 0] = 40.0
        return x

    torch.manual_seed(1234)
    teacher = torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.GELU(), torch.nn.Linear(64, OUT))
    calib, train, held_out = data(1, outlier=True), data(2), data(3)
    results = {}
    for update in ("static", "learned"):
        student = torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.GELU(), torch.nn.Linear(64, OUT))
        student.load_state_dict(teacher.state_dict())
        cfg = _cfg(fmt=4)
        cfg["input_amax_update"] = update
        _quantize(student, cfg, lambda m: m(calib))
        start = [student[i].input_quantizer.amax.detach().clone() for i in (0, 2)]
        amaxes = [p for n, p in student.named_parameters() if n.endswith("_amax")]
        others = [p for n, p in student.named_parameters() if not n.endswith("_amax")]
        opt = torch.optim.Adam([{"params": others}, {"params": amaxes, "lr": 1.0}], lr=3e-3)
        for step in range(60):
            xb = train[(step % 8) * 32:(step % 8 + 1) * 32]
            opt.zero_grad()
            torch.nn.functional.mse_loss(student(xb), teacher(xb).detach()).backward()
            opt.step()
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(student(held_out), teacher(held_out)).item()
        moved = [not torch.equal(student[i].input_quantizer.amax, a) for i, a in zip((0, 2), start, strict=True)]
        results[update] = (loss, moved, [student[i].input_quantizer.amax.item() for i in (0, 2)])
    assert results["learned"][1] == [True, True]
    assert results["static"][1] == [False, False]
    assert all(a > 0 for a in results["learned"][2])
    assert results["learned"][0] < 0.2 * results["static"][0], results


def test_learned_input_amax_checkpoint_round_trip(tmp_path):
    layer, x = _grouped(input_layout="per_expert")
    with torch.no_grad():
        layer.input_quantizer._amax.mul_(torch.tensor([0.9, 1.0, 0.8, 1.1]))
    save(layer, tmp_path / "q.pt")
    fresh = GroupedLinear(N, IN, OUT)
    restore(fresh, tmp_path / "q.pt")
    q = fresh.input_quantizer
    assert q.learns_amax
    assert q.amax_update == "learned"
    assert any(p is q._amax for p in fresh.parameters())
    assert torch.equal(q.amax, layer.input_quantizer.amax)
    with torch.no_grad():
        assert torch.equal(fresh(x, SPLITS), layer(x, SPLITS))
