"""A quantizer's mode follows its inputs (switches, config, amax, amax update) wherever they change, and the
forwards do what the mode says."""

import copy
import pickle
import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization import ExpertQuantizer, QuantizerAttributeConfig, QuantMode, TensorQuantizer
from modelopt_moe.quantization.nn import GroupedLinear


def test_the_mode_follows_switches_amax_config_and_amax_update():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits="e4m3"))
    assert q.mode is QuantMode.UNCALIBRATED
    q.enable_calib()
    assert q.mode is QuantMode.CALIBRATING
    assert q.is_calibrating
    q.disable_quant()
    assert q.mode is QuantMode.CALIBRATING  # calibrating, quantization off
    q.disable_calib()
    assert q.mode is QuantMode.OFF
    q.enable_quant()
    q.amax = 2.0
    assert q.mode is QuantMode.STATIC
    q.disable()
    assert q.mode is QuantMode.OFF
    assert not q.is_calibrating
    q.enable()
    q.reset_amax()
    assert q.mode is QuantMode.UNCALIBRATED
    q.set_amax_update("dynamic")
    assert q.mode is QuantMode.REFRESHED
    assert q.refreshes_amax
    q.set_from_attribute_config({"type": "dynamic"})
    # nothing to store, so nothing to refresh
    assert q.mode is QuantMode.DYNAMIC
    assert not q.refreshes_amax
    q.set_from_attribute_config({"type": "static"})
    q.amax = 1.0
    q.set_amax_update("learned")
    assert q.mode is QuantMode.LEARNED
    q.set_amax_update("static")
    assert q.mode is QuantMode.STATIC
    q.num_bits = 4  # a property setter changes the config too
    q.block_sizes = {-1: 16, "type": "dynamic"}
    assert q.mode is QuantMode.STATIC
    assert not q.needs_amax


def test_model_optimizer_style_writes_of_the_switches_and_the_amax_are_seen():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits="e4m3"), amax=1.0)
    q._if_calib = True  # Model Optimizer's attribute, written directly
    assert q.mode is QuantMode.CALIBRATING
    q._if_calib, q._enabled = False, False
    assert q.mode is QuantMode.OFF
    q._enabled = True
    q._amax = None
    assert q.mode is QuantMode.UNCALIBRATED
    q.load_state_dict({"_amax": torch.tensor(3.0)})
    assert q.mode is QuantMode.STATIC
    assert q.amax == 3.0


@pytest.mark.parametrize("copy_fn", [copy.deepcopy, lambda q: pickle.loads(pickle.dumps(q))])
def test_copies_keep_the_mode_and_keep_following_their_inputs(copy_fn):
    q = ExpertQuantizer(3, "vectorized", QuantizerAttributeConfig(num_bits="e4m3"))
    q.amax = torch.tensor([1.0, 2.0, 3.0])
    clone = copy_fn(q)
    assert clone.mode is QuantMode.STATIC
    clone.enable_calib()
    assert clone.mode is QuantMode.CALIBRATING
    assert q.mode is QuantMode.STATIC
    assert clone.view(1).mode is QuantMode.CALIBRATING
    assert clone.view(1).is_calibrating


def test_clips_only_where_a_clipped_straight_through_gradient_has_an_amax():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits="e4m3"))
    q.ste = "clipped"
    assert not q.clips  # no amax to clip at
    q.amax = 1.0
    assert q.clips
    q.disable_quant()
    assert not q.clips
    q.enable_quant()
    q.ste = "pass_through"
    assert not q.clips
    x = torch.tensor([0.5, 2.0], requires_grad=True)
    q.ste = "clipped"
    q(x).sum().backward()
    assert x.grad.tolist() == [1.0, 0.0]


def test_expert_weights_follow_the_mode_in_each_state():
    torch.manual_seed(0)
    layer = GroupedLinear(3, 16, 8)
    x = torch.randn(6, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, {**mtq.FP8_DEFAULT_CFG, "kernel": "torch", "weight_amax_update": "static"},
                     lambda m: m(x, [2, 2, 2]))
    wq = layer.weight_quantizer
    weights = layer.expert_weights()

    def expected(amax):
        return torch.cat([x[2 * i:2 * i + 2] @ fake_quant(w.detach(), "e4m3", amax[i]).t()
                          for i, w in enumerate(weights)])

    layer.input_quantizer.disable()
    assert wq.mode is QuantMode.STATIC
    stored = wq.amax.clone()
    with torch.no_grad():
        assert torch.equal(layer(x, [2, 2, 2]), expected(stored))
        for w in weights:
            w.mul_(2.0)
        assert torch.equal(layer(x, [2, 2, 2]), expected(stored))  # static: the stored amax
        wq.set_amax_update("dynamic")
        assert wq.mode is QuantMode.REFRESHED
        assert torch.equal(layer(x, [2, 2, 2]), expected(stored * 2))  # refreshed from the weights
        assert torch.equal(wq.amax, stored * 2)
        wq.disable_quant()
        assert wq.mode is QuantMode.OFF
        assert torch.equal(layer(x, [2, 2, 2]), torch.cat([x[2 * i:2 * i + 2] @ w.t() for i, w in enumerate(weights)]))
