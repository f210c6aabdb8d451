"""FP8 block-wise (E4M3 weights in 128 x 128 blocks, activations per token in groups of 128, every scale from the
current data) through the public API: presets, configs, ``nn.Linear`` and the grouped expert linear in every backward
mode, calibration, reuse within a step, checkpoints."""

import copy
import warnings

import pytest
import torch
from torch import nn

import modelopt_moe.checkpoint as mto
import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization.nn import GroupedLinear

N, IN, OUT = 3, 200, 136  # neither dim a multiple of 128: partial blocks at both ends
SPLITS = [4, 0, 5]
W8A8 = "FP8_BLOCKWISE_W8A8_CFG"


def _cfg(preset=W8A8, **top):
    cfg = copy.deepcopy(getattr(mtq, preset))
    cfg.update(top)
    return cfg


def _data(seed=1, tokens=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, IN, generator=g) * torch.logspace(-1, 1, IN), torch.randn(tokens, OUT, generator=g)


def _grouped(cfg, seed=0):
    torch.manual_seed(seed)
    layer = GroupedLinear(N, IN, OUT, bias=True)
    with torch.no_grad():
        for i, w in enumerate(layer.expert_weights()):
            w.mul_(10.0 ** i)  # a distinct magnitude per expert: a wrong expert's scale cannot pass
    x, _ = _data()
    mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    return layer


def test_presets_are_model_optimizers_shapes_and_load_by_name():
    weight_only = mtq.load_config("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG")
    assert weight_only.resolve("fc.weight_quantizer", "Linear").block_size == (128, 128)
    assert not weight_only.resolve("fc.input_quantizer", "Linear").enable
    w8a8 = mtq.load_config("fp8_block_w8a8")
    inputs = w8a8.resolve("fc.input_quantizer", "Linear")
    assert (inputs.block_size, inputs.is_dynamic, inputs.format) == (128, True, "e4m3")
    # Model Optimizer's own dict forms are taken as written.
    cfg = mtq.QuantizerAttributeConfig(num_bits=(4, 3), block_sizes={-1: 128, -2: 128})
    assert (cfg.block_size, cfg.static_block_size, cfg.block_2d) == ((128, 128), None, (128, 128))
    cfg = mtq.QuantizerAttributeConfig(num_bits=(4, 3), type="dynamic", block_sizes={-1: 128})
    assert (cfg.block_size, cfg.static_block_size) == (128, None)


def test_w8a8_linear_quantizes_weight_blocks_and_token_groups_at_any_token_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, 8)).to(torch.bfloat16)
    x, _ = _data()
    mtq.quantize(model, _cfg(), lambda m: m(x.bfloat16()))
    for tokens in (9, 5, 1):  # calibrated on 9 tokens; Model Optimizer's 1x128 inputs refuse another count
        xt = _data(3, tokens)[0].bfloat16()
        expected = nn.functional.linear(fake_quant(xt, "e4m3", None, 128),
                                        fake_quant(model[0].weight, "e4m3", None, (128, 128)), model[0].bias)
        with torch.no_grad():
            assert torch.equal(model[0](xt), expected)


def test_calibration_records_no_block_or_token_amax():
    layer = _grouped(_cfg())
    amaxes = {k: v for k, v in layer.state_dict().items() if k.endswith("_amax")}
    # Every scale comes from the data: the inputs keep no amax; the weights keep only each expert's max (for
    # reports), never read by the forward.
    assert sorted(amaxes) == ["weight_quantizer._amax"]
    assert torch.equal(amaxes["weight_quantizer._amax"],
                       torch.stack([w.detach().abs().amax() for w in layer.expert_weights()]))
    x, _ = _data(5)
    y = layer(x, SPLITS)
    layer.weight_quantizer.amax = torch.full((N,), 1e-3)  # not read: the same output
    assert torch.equal(layer(x, SPLITS), y)


@pytest.mark.parametrize("mode", ["dequantized", "high_precision", "quantized"])
@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_grouped_linear_every_backward_mode_matches_a_hand_computed_reference(mode, ste):
    layer = _grouped(_cfg(backward={"mode": mode, "ste": ste}))
    x, g = _data(7)
    x = x.requires_grad_()
    y = layer(x, SPLITS)
    y.backward(g)
    xs, gs = torch.split(x.detach(), SPLITS), torch.split(g, SPLITS)
    ws = [w.detach() for w in layer.expert_weights()]
    xq = [fake_quant(c, "e4m3", None, 128) for c in xs]
    wq = [fake_quant(w, "e4m3", None, (128, 128)) for w in ws]
    if mode == "quantized":
        gs = torch.split(fake_quant(g, "e5m2", g.abs().amax()), SPLITS)
    x_op, w_op = (xs, ws) if mode == "high_precision" else (xq, wq)
    y_ref = torch.cat([xq[i] @ wq[i].t() + getattr(layer, f"bias{i}") for i in range(N)])
    assert torch.equal(y.detach(), y_ref.detach())
    # Block scales come from the data: nothing to clip at, the clipped STE passes every gradient.
    torch.testing.assert_close(x.grad, torch.cat([gs[i] @ w_op[i] for i in range(N)]), rtol=1e-6, atol=1e-6)
    for i, w in enumerate(layer.expert_weights()):
        torch.testing.assert_close(w.grad, gs[i].t() @ x_op[i], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weight_amax", ["shared", "vectorized", "per_expert"])
def test_every_expert_layout_gives_the_same_bits(weight_amax):
    reference = _grouped(_cfg())
    layer = _grouped(_cfg(experts={"weight_amax": weight_amax, "input_amax": "per_expert"}))
    x, _ = _data(2)
    assert torch.equal(layer(x, SPLITS), reference(x, SPLITS))


def test_reuse_within_a_step_and_weights_written_through_data():
    layer = _grouped(_cfg())
    x, _ = _data(4)
    with mtq.reuse_quantized_weights(layer):
        y1, y2 = layer(x, SPLITS), layer(x, SPLITS)
    assert torch.equal(y1, y2)
    for w in layer.expert_weights():
        w.data.mul_(1.5)  # as Megatron's optimizers write: the next forward sees it
    expected = torch.cat([c @ fake_quant(w.detach(), "e4m3", None, (128, 128)).t() + getattr(layer, f"bias{i}")
                          for i, (c, w) in enumerate(zip(torch.split(fake_quant(x, "e4m3", None, 128), SPLITS),
                                                         layer.expert_weights(), strict=True))])
    assert torch.equal(layer(x, SPLITS), expected.detach())


def test_save_and_restore_give_the_same_outputs(tmp_path):
    layer = _grouped(_cfg())
    x, _ = _data(6)
    mto.save(layer, tmp_path / "q.pt")
    fresh = mto.restore(GroupedLinear(N, IN, OUT, bias=True), tmp_path / "q.pt")
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x, SPLITS), layer(x, SPLITS))
    assert fresh.weight_quantizer.block_size == (128, 128)
    assert fresh.input_quantizer.block_size == 128


def test_a_2d_block_on_an_input_quantizer_is_a_config_error_naming_it():
    cfg = _cfg()
    cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer",
                             "cfg": {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}})
    model = nn.Sequential(nn.Linear(IN, OUT))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(mtq.ConfigError, match=r"0\.input_quantizer: 2-D blocks .* weights only.*-1: 128.*dynamic"):
            mtq.quantize(model, cfg, lambda m: m(_data()[0]))
    assert type(model[0]) is nn.Linear  # all or nothing: the model as before


@pytest.mark.parametrize("mode", ["dequantized", "high_precision", "quantized"])
def test_linear_every_backward_mode_matches_a_hand_computed_reference(mode):
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT)
    x, g = _data(8)
    mtq.quantize(layer, _cfg(backward={"mode": mode}), lambda m: m(x))
    x = x.clone().requires_grad_()
    layer(x).backward(g)
    xq, wq = fake_quant(x.detach(), "e4m3", None, 128), fake_quant(layer.weight.detach(), "e4m3", None, (128, 128))
    if mode == "quantized":
        g = fake_quant(g, "e5m2", g.abs().amax())
    x_op, w_op = (x.detach(), layer.weight.detach()) if mode == "high_precision" else (xq, wq)
    torch.testing.assert_close(x.grad, g @ w_op, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, g.t() @ x_op, rtol=1e-6, atol=1e-6)


def test_gemm_te_fp8_refuses_fp8_blocks_naming_them():
    from modelopt_moe.plugins import te_fp8

    cfg = mtq.load_config("fp8_default.yaml")
    cfg.gemm = "te_fp8"
    layer = _grouped(cfg)
    layer.weight_quantizer.set_from_attribute_config({"block_sizes": {-1: 128, -2: 128}})
    assert any("weight_quantizer quantizes in blocks ((128, 128))" in p for p in te_fp8.problems(layer))
    with pytest.raises(mtq.ConfigError, match="gemm te_fp8 cannot run"):
        te_fp8.check(layer)
