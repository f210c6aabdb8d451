"""The framework-free grouped expert linear: amax layouts, backward modes, fresh weights by default and their reuse
inside a declared scope."""

import copy
import pickle
import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization import tensor_quantizer
from modelopt_moe.quantization import utils as qutils
from modelopt_moe.quantization.nn import GroupedLinear, expert_weights
from modelopt_moe.quantization.nn import experts as experts_nn
from modelopt_moe.quantization.weight_reuse import active_reuse_scopes

N, IN, OUT = 4, 32, 16
SPLITS = [5, 0, 7, 8]  # expert 1 gets no tokens


def _config(preset="fp8_default.yaml", weight_amax="vectorized", input_amax="per_expert", mode="dequantized",
            ste="pass_through"):
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax, cfg.experts.input_amax = weight_amax, input_amax
    cfg.backward.mode, cfg.backward.ste = mode, ste
    cfg.weight_amax_update = "static"  # these tests set and change amaxes by hand (dynamic: test_weight_amax_update)
    return cfg


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = GroupedLinear(N, IN, OUT, bias=True)
    with torch.no_grad():  # a distinct magnitude per expert: a wrong expert index cannot pass
        for i, w in enumerate(layer.expert_weights()):
            w.mul_(1.0 + i)
    return layer


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(SPLITS), IN, generator=g), torch.randn(sum(SPLITS), OUT, generator=g)


def _quantized(cfg, seed=0):
    x, _ = _data()
    layer = _layer(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    return layer


def _run(layer, x, g):
    x = x.clone().requires_grad_(True)
    for w in layer.parameters():
        w.grad = None
    y = layer(x, SPLITS)
    y.backward(g)
    return y.detach(), x.grad, [w.grad.clone() for w in layer.expert_weights()]


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml", "int8_default.yaml"])
def test_vectorized_and_per_expert_give_bit_identical_outputs_and_gradients(preset):
    x, g = _data()
    vec = _run(_quantized(_config(preset, "vectorized")), x, g)
    per = _run(_quantized(_config(preset, "per_expert")), x, g)
    assert torch.equal(vec[0], per[0])
    assert torch.equal(vec[1], per[1])
    assert all(torch.equal(a, b) for a, b in zip(vec[2], per[2], strict=True))


def test_amax_layouts_hold_one_n_expert_tensor_per_expert_views_or_the_max():
    vec = _quantized(_config(weight_amax="vectorized"))
    per = _quantized(_config(weight_amax="per_expert"))
    shared = _quantized(_config(weight_amax="shared"))
    expected = torch.stack([w.detach().abs().amax() for w in _layer().expert_weights()])
    assert torch.equal(vec.weight_quantizer.amax, expected)
    assert [n for n, _ in per.weight_quantizer.named_children()] == ["0", "1", "2", "3"]
    assert torch.equal(per.weight_quantizer.amax, expected)
    assert [per.weight_quantizer[i].amax.item() for i in range(N)] == expected.tolist()
    assert torch.equal(shared.weight_quantizer.amax, expected.max().expand(N))


def test_each_expert_weight_uses_its_own_amax():
    layer = _quantized(_config(weight_amax="vectorized"))
    x, _ = _data()
    got = layer(x, SPLITS)
    xq = torch.cat([fake_quant(c, "e4m3", layer.input_quantizer.amax[i])
                    for i, c in enumerate(torch.split(x, SPLITS))])
    ref = []
    for i, (c, w) in enumerate(zip(torch.split(xq, SPLITS), layer.expert_weights(), strict=True)):
        wq = fake_quant(w.detach(), "e4m3", layer.weight_quantizer.amax[i])
        ref.append(c @ wq.t() + getattr(layer, f"bias{i}"))
    assert torch.equal(got, torch.cat(ref))


def test_an_expert_without_tokens_gets_the_shared_input_amax_and_a_warning(monkeypatch):
    monkeypatch.setattr(qutils, "_warned", set())
    x, _ = _data()
    layer = _layer()
    with pytest.warns(UserWarning, match=r"input_quantizer: experts \[1\]"):
        mtq.quantize(layer, _config(), lambda m: m(x, SPLITS))
    amax = layer.input_quantizer.amax
    assert amax[1] == amax.max()
    assert (amax > 0).all()
    assert torch.isfinite(layer(x, SPLITS)).all()


@pytest.mark.parametrize("mode", ["dequantized", "high_precision", "quantized"])
@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_backward_modes_match_a_hand_computed_reference(mode, ste):
    layer = _quantized(_config(mode=mode, ste=ste))
    # Amaxes below the data's range so the clipped STE has something to clip.
    layer.input_quantizer.amax = layer.input_quantizer.amax * 0.5
    layer.weight_quantizer.amax = layer.weight_quantizer.amax * 0.5
    x, g = _data(7)
    y, dx, dws = _run(layer, x, g)

    ia, wa = layer.input_quantizer.amax, layer.weight_quantizer.amax
    xs = torch.split(x, SPLITS)
    gs = torch.split(g, SPLITS)
    ws = [w.detach() for w in layer.expert_weights()]
    xq = [fake_quant(c, "e4m3", ia[i]) for i, c in enumerate(xs)]
    wq = [fake_quant(w, "e4m3", wa[i]) for i, w in enumerate(ws)]
    if mode == "quantized":  # the gradient arriving at the GEMM output, fake-quantized per tensor
        full = torch.cat(gs)
        gs = torch.split(fake_quant(full, "e5m2", full.abs().amax()), SPLITS)
    x_op, w_op = (xs, ws) if mode == "high_precision" else (xq, wq)
    want_dx = torch.cat([gs[i] @ w_op[i] for i in range(N)])
    want_dw = [gs[i].t() @ x_op[i] for i in range(N)]
    if ste == "clipped":
        want_dx = want_dx * torch.cat([c.abs() <= ia[i] for i, c in enumerate(xs)])
        want_dw = [d * (ws[i].abs() <= wa[i]) for i, d in enumerate(want_dw)]
    y_ref = torch.cat([xq[i] @ wq[i].t() + getattr(layer, f"bias{i}") for i in range(N)])
    assert torch.equal(y, y_ref.detach())  # the forward value never depends on the backward mode
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-6)
    for got, want in zip(dws, want_dw, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if ste == "clipped":
        assert (dx == 0).any()
        assert any((d == 0).any() for d in dws)


class _CountFakeQuant:
    """Counts expert weight fake-quantizations on the reference path (one call per expert weight)."""

    def __init__(self, monkeypatch):
        self.calls = 0

        def counting(x, *args, **kwargs):
            self.calls += x.shape == (OUT, IN)
            return fake_quant(x, *args, **kwargs)

        for module in (expert_weights, tensor_quantizer):  # the two call sites of the reference
            monkeypatch.setattr(module, "fake_quant", counting)


def _reference_forward(layer, x):
    """The layer's forward from scratch: current weights, current amaxes, nothing cached."""
    iq, wq = layer.input_quantizer, layer.weight_quantizer
    xq = torch.cat([fake_quant(c, "e4m3", iq.amax[i]) for i, c in enumerate(torch.split(x, SPLITS))])
    outs = []
    for i, (c, w) in enumerate(zip(torch.split(xq, SPLITS), layer.expert_weights(), strict=True)):
        outs.append(c @ fake_quant(w.detach(), "e4m3", wq.amax[i]).t() + getattr(layer, f"bias{i}"))
    return torch.cat(outs)


def test_weights_written_through_data_are_seen_by_the_next_forward():
    # How Megatron's optimizers update parameters: through .data, without bumping Tensor._version.
    layer = _quantized(_config())
    x, g = _data()
    _run(layer, x, g)
    versions = [w._version for w in layer.expert_weights()]
    for w in layer.expert_weights():
        w.data.mul_(1.5)
    assert [w._version for w in layer.expert_weights()] == versions
    assert torch.equal(_run(layer, x, g)[0], _reference_forward(layer, x).detach())


def test_micro_batches_reuse_the_fake_quantized_weights_inside_a_scope(monkeypatch):
    layer = _quantized(_config())
    x, g = _data()
    count = _CountFakeQuant(monkeypatch)
    _run(layer, x, g)
    _run(layer, x, g)
    assert count.calls == 2 * N  # no scope: every forward re-quantizes
    count.calls = 0
    with mtq.reuse_quantized_weights(layer):
        y1 = _run(layer, x, g)
        y2 = _run(layer, x, g)
        assert active_reuse_scopes() == 1
    assert count.calls == N  # once per scope
    assert torch.equal(y1[0], y2[0])
    assert all(torch.equal(a, b) for a, b in zip(y1[2], y2[2], strict=True))
    assert active_reuse_scopes() == 0
    _run(layer, x, g)
    assert count.calls == 2 * N  # leaving the scope dropped the values


def test_a_scope_still_sees_in_place_weight_and_amax_updates():
    layer = _quantized(_config())
    x, g = _data()
    with mtq.reuse_quantized_weights(layer):
        _run(layer, x, g)
        torch.optim.SGD(layer.parameters(), lr=0.5).step()  # a versioned in-place update inside the scope
        assert torch.equal(_run(layer, x, g)[0], _reference_forward(layer, x).detach())
        layer.weight_quantizer.amax = layer.weight_quantizer.amax * 0.5
        assert torch.equal(_run(layer, x, g)[0], _reference_forward(layer, x).detach())


def test_a_scope_covers_only_the_models_it_was_given(monkeypatch):
    a, b = _quantized(_config()), _quantized(_config(), seed=3)
    x, g = _data()
    count = _CountFakeQuant(monkeypatch)
    with mtq.reuse_quantized_weights([a]):
        for _ in range(2):
            _run(a, x, g)
            _run(b, x, g)
    assert count.calls == N + 2 * N


def test_a_checkpoint_load_is_seen_by_the_next_forward():
    layer = _quantized(_config())
    other = _quantized(_config(), seed=5)
    x = _data()[0]
    layer(x, SPLITS)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x, SPLITS), other(x, SPLITS))


def test_an_amax_change_is_seen_by_the_next_forward():
    for weight_amax in ("vectorized", "per_expert", "shared"):
        layer = _quantized(_config(weight_amax=weight_amax))
        x, g = _data()
        y0 = _run(layer, x, g)[0]
        if weight_amax == "per_expert":
            layer.weight_quantizer[2].amax = layer.weight_quantizer[2].amax * 0.5
        else:
            layer.weight_quantizer.amax = layer.weight_quantizer.amax * 0.5
        y1 = _run(layer, x, g)[0]
        assert not torch.equal(y0, y1), weight_amax
        mtq.calibrate(layer, "max", lambda m, x=x: m(x, SPLITS))  # back to the calibrated amax: back to y0
        assert torch.equal(_run(layer, x, g)[0], y0), weight_amax


def test_quantized_grouped_linear_pickles_and_deepcopies_without_its_caches():
    layer = _quantized(_config(weight_amax="per_expert"))
    x, _ = _data()
    y = layer(x, SPLITS)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert "_device_splits" not in clone.__dict__
        assert torch.equal(clone(x, SPLITS), y)
        assert clone.weight_quantizer[1].owner is clone.weight_quantizer  # the views follow their copied owner
        clone.weight_quantizer[1].amax = 7.0
        assert layer.weight_quantizer.amax[1] != 7.0


def test_kernel_triton_where_triton_cannot_run_fails_clearly(monkeypatch):
    layer = _quantized(_config())
    layer.quant_kernel = "triton"
    # As on a CPU machine without TRITON_INTERPRET (this test run may have the interpreter on).
    monkeypatch.setattr(experts_nn, "kernels_available", lambda device: False)
    with pytest.raises(RuntimeError, match="kernel='triton'"):
        layer(_data()[0], SPLITS)


@pytest.mark.parametrize("weight_amax", ["vectorized", "per_expert", "shared"])
def test_clipped_ste_with_per_channel_weight_amax_masks_each_channel(weight_amax):
    layer = _quantized(_config("int8_default.yaml", weight_amax=weight_amax, ste="clipped"))
    # Per-channel amax halved: channels clip where |w| exceeds their own amax.
    if weight_amax == "per_expert":
        for q in layer.weight_quantizer:
            q.amax = q.amax * 0.5
    else:
        layer.weight_quantizer.amax = layer.weight_quantizer.amax * 0.5
    x, g = _data(3)
    _, _, dws = _run(layer, x, g)
    xs, gs = torch.split(x, SPLITS), torch.split(g, SPLITS)
    xq = [fake_quant(c, "int8", layer.input_quantizer.amax[i]) for i, c in enumerate(xs)]
    clipped = 0
    for i, (w, dw) in enumerate(zip(layer.expert_weights(), dws, strict=True)):
        amax = layer.weight_quantizer.expert_amax(i)
        assert amax.shape == (OUT, 1)
        want = (gs[i].t() @ xq[i]) * (w.detach().abs() <= amax)
        torch.testing.assert_close(dw, want, rtol=1e-6, atol=1e-6)
        clipped += int((w.detach().abs() > amax).sum())
    assert clipped > 0
