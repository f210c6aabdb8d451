"""TensorQuantizer (modelopt_moe/quantization/tensor_quantizer.py): max calibration, switches, amax storage,
state dicts, copying and pickling, and the straight-through estimators."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization.config import QuantizerAttributeConfig
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

E4M3 = QuantizerAttributeConfig(num_bits=(4, 3))
E4M3_PER_CHANNEL = QuantizerAttributeConfig(num_bits=(4, 3), axis=0)
INT8_PER_CHANNEL = QuantizerAttributeConfig(num_bits=8, axis=0)


def _exact(actual, expected):
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


def test_per_tensor_collect_takes_the_max_over_calls_ignoring_nan():
    g = torch.Generator().manual_seed(1)
    q = TensorQuantizer(E4M3)
    xs = [torch.randn(4, 8, generator=g) * s for s in (1.0, 5.0, 2.0)]
    xs[2][1, 3] = float("nan")
    xs[0][0, 0] = -9.5  # the largest magnitude is negative and in the first call
    for x in xs:
        q.collect(x)
    expected = torch.stack([x.nan_to_num(0.0).abs().max() for x in xs]).max()
    assert q.amax.shape == ()
    assert q.amax.dtype == torch.float32
    _exact(q.amax, expected)
    assert q.amax >= 9.5


def test_per_channel_collect_keeps_one_amax_per_row_max_over_calls_ignoring_nan():
    g = torch.Generator().manual_seed(2)
    q = TensorQuantizer(E4M3_PER_CHANNEL)
    a = torch.randn(3, 10, generator=g)
    b = torch.randn(3, 10, generator=g) * torch.tensor([[0.1], [10.0], [1.0]])
    b[2, 4] = float("nan")
    q.collect(a)
    q.collect(b)
    assert q.amax.shape == (3, 1)
    expected = torch.maximum(a.abs().amax(1, keepdim=True), b.nan_to_num(0.0).abs().amax(1, keepdim=True))
    _exact(q.amax, expected)
    assert not torch.isnan(q.amax).any()


def test_per_channel_collect_on_3d_input_reduces_every_other_dim():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 6, generator=g) * torch.arange(1, 5).view(4, 1, 1)
    q = TensorQuantizer(E4M3_PER_CHANNEL)
    q.collect(x)
    assert q.amax.shape == (4, 1, 1)
    _exact(q.amax, x.abs().amax(dim=(1, 2), keepdim=True))


def test_disabled_quantizer_is_identity_and_collects_nothing():
    q = TensorQuantizer(E4M3)
    q.enable_calib()
    q.disable()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    assert q(x) is x
    assert q.amax is None
    q.enable()
    out = q(x)
    _exact(q.amax, x.abs().max())
    _exact(out, fake_quant(x, "e4m3", x.abs().max()))


def test_enable_false_in_the_attribute_config_disables():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, enable=False), amax=torch.tensor(1.0))
    x = torch.randn(5, generator=torch.Generator().manual_seed(5)) * 3
    assert not q.is_enabled
    assert q(x) is x


def test_calib_on_quant_off_collects_and_returns_input_unchanged():
    g = torch.Generator().manual_seed(6)
    q = TensorQuantizer(E4M3)
    q.enable_calib()
    q.disable_quant()
    x1, x2 = torch.randn(8, generator=g), torch.randn(8, generator=g) * 4
    assert q(x1) is x1
    assert q(x2) is x2
    _exact(q.amax, torch.maximum(x1.abs().max(), x2.abs().max()))


def test_calib_on_quant_on_quantizes_with_the_amax_including_this_batch():
    g = torch.Generator().manual_seed(7)
    q = TensorQuantizer(E4M3, amax=torch.tensor(0.5))
    q.enable_calib()
    x = torch.randn(16, generator=g) * 3
    out = q(x)
    _exact(q.amax, x.abs().max())
    _exact(out, fake_quant(x, "e4m3", x.abs().max()))


def test_calib_off_quant_on_uses_the_stored_amax_and_leaves_it_alone():
    g = torch.Generator().manual_seed(8)
    amax = torch.tensor(0.75)
    q = TensorQuantizer(INT8_PER_CHANNEL, amax=torch.full((4, 1), 0.75))
    x = torch.randn(4, 8, generator=g) * 2
    out = q(x)
    # Model Optimizer's default range: [-128, 127] levels, so negatives clamp at -128/127 * amax.
    _exact(out, fake_quant(x, "int8", torch.full((4, 1), 0.75), narrow_range=False))
    _exact(q.amax, torch.full((4, 1), 0.75))
    # values beyond the amax were clamped
    assert out.max() <= amax
    assert out.min() >= -amax * 128 / 127
    assert out.min() < -amax  # the extra negative level is reached
    assert x.abs().max() > amax


def test_quant_off_returns_input_object():
    q = TensorQuantizer(E4M3, amax=torch.tensor(1.0))
    q.disable_quant()
    x = torch.randn(3, 3)
    assert q(x) is x


def test_amax_setter_with_same_shape_updates_in_place():
    q = TensorQuantizer(E4M3_PER_CHANNEL, amax=torch.ones(4, 1))
    buf = q.amax
    version = buf._version
    q.amax = torch.arange(4.0).view(4, 1) + 1
    assert q.amax is buf
    assert q._amax is q._buffers["_amax"]
    assert buf._version > version
    _exact(buf, torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
    # A python float into a scalar amax: also in place.
    q2 = TensorQuantizer(E4M3, amax=torch.tensor(2.0))
    buf2, v2 = q2.amax, q2.amax._version
    q2.amax = 3.5
    assert q2.amax is buf2
    assert buf2._version > v2
    assert buf2.item() == 3.5


def test_amax_setter_does_not_alias_the_given_tensor_and_reshapes_on_shape_change():
    value = torch.ones(4, 1)
    q = TensorQuantizer(E4M3_PER_CHANNEL, amax=value)
    value.fill_(7.0)
    _exact(q.amax, torch.ones(4, 1))
    q.amax = torch.full((2, 1), 3.0)
    assert q.amax.shape == (2, 1)
    _exact(q.amax, torch.full((2, 1), 3.0))
    assert "_amax" in q.state_dict()


def test_collect_updates_the_amax_buffer_in_place():
    q = TensorQuantizer(E4M3)
    q.collect(torch.tensor([1.0, -2.0]))
    buf, version = q.amax, q.amax._version
    q.collect(torch.tensor([3.0]))
    assert q.amax is buf
    assert buf._version > version
    assert buf.item() == 3.0


@pytest.mark.parametrize("cfg", [E4M3, INT8_PER_CHANNEL])
def test_state_dict_round_trip_into_a_fresh_quantizer(cfg):
    g = torch.Generator().manual_seed(9)
    src = TensorQuantizer(cfg)
    x = torch.randn(6, 12, generator=g) * torch.logspace(-1, 1, 6).unsqueeze(1)
    src.collect(x)
    sd = src.state_dict()
    assert set(sd) == {"_amax"}

    dst = TensorQuantizer(cfg)
    assert dst.amax is None
    assert "_amax" not in dst.state_dict()
    dst.load_state_dict(sd)
    _exact(dst.amax, src.amax)
    assert dst.amax.data_ptr() != src.amax.data_ptr()
    y = torch.randn(6, 12, generator=g) * 2
    _exact(dst(y), src(y))


def test_load_state_dict_replaces_an_amax_of_another_shape():
    src = TensorQuantizer(E4M3_PER_CHANNEL, amax=torch.tensor([[1.0], [2.0], [3.0]]))
    dst = TensorQuantizer(E4M3_PER_CHANNEL, amax=torch.ones(5, 1))
    dst.load_state_dict(src.state_dict())
    _exact(dst.amax, torch.tensor([[1.0], [2.0], [3.0]]))


def test_strict_load_of_a_state_without_amax_into_a_calibrated_quantizer_reports_missing_key():
    dst = TensorQuantizer(E4M3, amax=torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="_amax"):
        dst.load_state_dict({})


def _calibrated_quantizer():
    q = TensorQuantizer(E4M3_PER_CHANNEL)
    q.collect(torch.randn(4, 16, generator=torch.Generator().manual_seed(10)) * 3)
    q.ste = "clipped"
    return q


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "pickle"])
def test_quantizer_copies_give_identical_outputs_and_state(clone):
    q = _calibrated_quantizer()
    c = clone(q)
    assert c is not q
    assert c.amax is not q.amax
    _exact(c.amax, q.amax)
    assert c.fmt == q.fmt
    assert c.axis == q.axis
    assert c.ste == "clipped"
    assert c.is_enabled
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(11)) * 4
    _exact(c(x), q(x))
    # The copy is independent.
    c.amax = torch.full((4, 1), 0.01)
    assert not torch.equal(c.amax, q.amax)


def _quantized_sequential():
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    calib = torch.randn(10, 16, generator=torch.Generator().manual_seed(13))
    return mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(calib))


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "pickle"])
def test_quantized_sequential_copies_give_identical_outputs(clone):
    model = _quantized_sequential()
    c = clone(model)
    assert type(c[0]) is type(model[0])
    assert type(c[0]).__name__ == "QuantLinear"
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(14)) * 2
    y = model(x)
    _exact(c(x), y)
    assert not torch.equal(y, nn.functional.linear(
        nn.functional.gelu(nn.functional.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias))
    names = [n for n, _, _ in mtq.named_quantizers(model)]
    assert names == [n for n, _, _ in mtq.named_quantizers(c)]
    for (_, qa, _), (_, qb, _) in zip(mtq.named_quantizers(model), mtq.named_quantizers(c), strict=True):
        assert qa.is_enabled == qb.is_enabled
        if qa.amax is not None:
            _exact(qb.amax, qa.amax)


def _assert_plain_state(obj, where):
    for key, value in vars(obj).items():
        assert not isinstance(value, dist.ProcessGroup), f"{where}.{key} is a ProcessGroup"
        try:
            pickle.dumps(value)
        except Exception as e:
            raise AssertionError(f"{where}.{key} ({type(value).__name__}) does not pickle: {e}") from e


def test_no_process_group_or_unpicklable_object_in_quantizer_or_quantized_module_vars():
    model = _quantized_sequential()
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer) or mtq.conversion.is_quantized(module):
            _assert_plain_state(module, name)
    _assert_plain_state(_calibrated_quantizer(), "quantizer")


def test_pass_through_ste_gradient_is_all_ones():
    g = torch.Generator().manual_seed(15)
    q = TensorQuantizer(E4M3, amax=torch.tensor(0.5))
    x = (torch.randn(6, 8, generator=g) * 2).requires_grad_()
    assert (x.detach().abs() > 0.5).any()
    q(x).backward(torch.ones(6, 8))
    _exact(x.grad, torch.ones(6, 8))


@pytest.mark.parametrize(("cfg", "amax"), [(E4M3, torch.tensor(0.5)),
                                           (INT8_PER_CHANNEL, torch.tensor([[0.2], [1.0], [3.0], [0.7]]))])
def test_clipped_ste_gradient_is_zero_exactly_where_abs_x_exceeds_amax(cfg, amax):
    g = torch.Generator().manual_seed(16)
    q = TensorQuantizer(cfg, amax=amax)
    q.ste = "clipped"
    x = torch.randn(4, 32, generator=g) * 1.5
    x[0, 0] = amax.flatten()[0]  # exactly at the amax: still passes
    x[1, 1] = -amax.flatten()[-1] if amax.numel() == 1 else -amax[1, 0]
    x.requires_grad_()
    upstream = torch.randn(4, 32, generator=g)
    q(x).backward(upstream)
    inside = x.detach().abs() <= amax
    assert (~inside).any()
    assert inside.any()
    _exact(x.grad, torch.where(inside, upstream, torch.zeros_like(upstream)))
    assert x.grad[0, 0] == upstream[0, 0]
    assert x.grad[1, 1] == upstream[1, 1]


def test_clipped_ste_with_invalid_amax_clips_nothing():
    q = TensorQuantizer(E4M3, amax=torch.tensor(0.0))
    q.ste = "clipped"
    x = (torch.randn(10, generator=torch.Generator().manual_seed(17)) * 100).requires_grad_()
    q(x).sum().backward()
    _exact(x.grad, torch.ones(10))


def test_uncalibrated_quantizer_warns_and_uses_the_current_tensor_amax(monkeypatch):
    monkeypatch.setattr("modelopt_moe.quantization.utils._warned", set())
    q = TensorQuantizer(E4M3)
    x = torch.randn(9, generator=torch.Generator().manual_seed(18))
    with pytest.warns(UserWarning, match="no calibrated amax"):
        out = q(x)
    _exact(out, fake_quant(x, "e4m3", x.abs().max()))
    assert q.amax is None
