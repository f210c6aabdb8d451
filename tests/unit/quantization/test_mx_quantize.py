"""MXFP4 and MXFP8 through the public API: Model Optimizer's preset names and dict form, the config's errors, every
framework-free quantized module kind (``nn.Linear``, the grouped expert linear) in every backward mode, what
calibration records, reuse within a step, and the quantizer state. The Megatron module kinds and checkpoints at any
TP/EP: tests/distributed/test_checkpoint_reshard.py; the kernels: tests/unit/kernels/test_mx_kernels.py."""

import warnings

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization import ConfigError
from modelopt_moe.quantization.nn import GroupedLinear

N, IN, OUT = 4, 48, 16  # IN = 48: a last block of 16 (zero-padded, as Model Optimizer pads)
SPLITS = [5, 0, 7, 8]
MX = [("MXFP4_DEFAULT_CFG", (2, 1), "mxfp4"), ("MXFP8_DEFAULT_CFG", (4, 3), "mxfp8")]


def _mx_cfg(num_bits, block=32):
    return {"num_bits": num_bits, "block_sizes": {-1: block, "type": "dynamic", "scale_bits": (8, 0)}}


@pytest.mark.parametrize(("preset", "num_bits", "fmt"), MX)
def test_presets_and_model_optimizers_dict_form_name_the_mx_format(preset, num_bits, fmt):
    cfg = getattr(mtq, preset)
    assert mtq.load_config(preset).model_dump() == cfg
    assert mtq.load_config(f"{fmt}_default").model_dump() == cfg
    for entry in cfg["quant_cfg"][:2]:
        assert entry["cfg"]["num_bits"] == num_bits
        assert entry["cfg"]["block_sizes"] == {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}
    q = mtq.TensorQuantizer(_mx_cfg(num_bits))
    assert q.fmt == fmt
    assert not q.needs_amax
    # The same num_bits with E4M3 block scales stays NVFP4 / without blocks FP8.
    other = {"num_bits": num_bits, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
    assert mtq.TensorQuantizer(other if num_bits == (2, 1) else {"num_bits": num_bits}).fmt in ("nvfp4", "e4m3")


@pytest.mark.parametrize(("preset", "num_bits", "fmt"), MX)
def test_a_block_that_is_not_32_is_a_config_error_naming_the_quantizer_the_value_and_what_works(preset, num_bits, fmt):
    config = {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": _mx_cfg(num_bits, 16)}], "algorithm": None}
    with pytest.raises(ConfigError) as e:
        mtq.quantize(nn.Sequential(nn.Linear(64, 8)), config)
    text = str(e.value)
    assert "quant_cfg.0.cfg" in text  # the rule of the quantizer
    assert "block_sizes[-1]=16" in text
    assert "blocks of 32" in text
    static = {"num_bits": num_bits, "block_sizes": {-1: 32, "type": "static", "scale_bits": (8, 0)}}
    with pytest.raises(ConfigError, match="block_sizes.type"):
        mtq.quantize(nn.Sequential(nn.Linear(64, 8)),
                     {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": static}], "algorithm": None})
    with pytest.raises(ConfigError, match="scale_bits"):  # E8M0 block scales on an int format
        mtq.quantize(nn.Sequential(nn.Linear(64, 8)), {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": {
            "num_bits": 4, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}}], "algorithm": None})


@pytest.mark.parametrize(("preset", "num_bits", "fmt"), MX)
def test_linear_forward_is_the_reference_on_inputs_and_weights_whatever_calibration_recorded(preset, num_bits, fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, 8))  # 16 wide: one padded block
    x = torch.randn(6, IN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, getattr(mtq, preset), lambda m: m(x))
    fc = model[0]
    want = fake_quant(x, fmt) @ fake_quant(fc.weight.detach(), fmt).t() + fc.bias
    assert torch.equal(fc(x), want)
    # Calibration records each quantizer's absolute max (reports, checkpoints); the forward never reads it.
    assert torch.equal(fc.weight_quantizer.amax, fc.weight.detach().abs().amax())
    assert f"{fmt}, E8M0 scales per 32 from the data, amax=" in repr(fc.weight_quantizer)
    fc.weight_quantizer.amax = fc.weight_quantizer.amax * 0.01
    fc.input_quantizer.amax = fc.input_quantizer.amax * 0.01
    assert torch.equal(fc(x), want)


def _grouped(preset, mode="dequantized", ste="pass_through", weight_amax="per_expert", kernel="auto"):
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT, bias=True)
    with torch.no_grad():  # a distinct magnitude per expert: a wrong expert index cannot pass
        for i, w in enumerate(layer.expert_weights()):
            w.mul_(4.0**i)
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax = weight_amax
    cfg.backward.mode, cfg.backward.ste, cfg.kernel = mode, ste, kernel
    x = torch.randn(sum(SPLITS), IN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    return layer


def _run(layer, x, g):
    x = x.clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    y = layer(x, SPLITS)
    y.backward(g)
    return y.detach(), x.grad, [w.grad.clone() for w in layer.expert_weights()]


@pytest.mark.parametrize("mode", ["dequantized", "high_precision", "quantized"])
@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
@pytest.mark.parametrize(("preset", "num_bits", "fmt"), MX)
def test_grouped_linear_in_every_backward_mode_matches_a_hand_computed_reference(preset, num_bits, fmt, mode, ste):
    layer = _grouped(preset, mode, ste)
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(sum(SPLITS), IN, generator=g) * 3, torch.randn(sum(SPLITS), OUT, generator=g)
    y, dx, dws = _run(layer, x, dy)
    xs, gs = torch.split(x, SPLITS), torch.split(dy, SPLITS)
    ws = [w.detach() for w in layer.expert_weights()]
    xq = [fake_quant(c, fmt) for c in xs]  # each token row's blocks: the same whichever expert it goes to
    wq = [fake_quant(w, fmt) for w in ws]
    assert torch.equal(y, torch.cat([xq[i] @ wq[i].t() + getattr(layer, f"bias{i}") for i in range(N)]))
    if mode == "quantized":  # the output gradient, fake-quantized per tensor (E5M2)
        full = torch.cat(gs)
        gs = torch.split(fake_quant(full, "e5m2", full.abs().amax()), SPLITS)
    x_op, w_op = (xs, ws) if mode == "high_precision" else (xq, wq)
    # MX has no amax to clip at: the clipped estimator passes every gradient, as Model Optimizer's MX does.
    torch.testing.assert_close(dx, torch.cat([gs[i] @ w_op[i] for i in range(N)]), rtol=1e-6, atol=1e-6)
    for i, got in enumerate(dws):
        torch.testing.assert_close(got, gs[i].t() @ x_op[i], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("preset", "num_bits", "fmt"), MX)
def test_grouped_linear_amax_layouts_agree_and_reuse_within_a_step_gives_the_same_step(preset, num_bits, fmt):
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(sum(SPLITS), IN, generator=g), torch.randn(sum(SPLITS), OUT, generator=g)
    runs = [_run(_grouped(preset, weight_amax=layout), x, dy) for layout in ("per_expert", "vectorized", "shared")]
    for other in runs[1:]:
        assert torch.equal(runs[0][0], other[0])
        assert torch.equal(runs[0][1], other[1])
    layer = _grouped(preset)
    with mtq.reuse_quantized_weights(layer):
        first, second = _run(layer, x, dy), _run(layer, x, dy)
        torch.optim.SGD(layer.parameters(), lr=0.5).step()  # an update inside the scope is seen
        third = _run(layer, x, dy)
    assert torch.equal(first[0], runs[0][0])
    assert torch.equal(second[0], first[0])
    fresh = _run(layer, x, dy)
    assert torch.equal(third[0], fresh[0])
    assert not torch.equal(third[0], first[0])


@pytest.mark.parametrize(("preset", "num_bits", "fmt"), MX)
def test_quantizer_state_round_trips_with_model_optimizers_names(preset, num_bits, fmt):
    q = mtq.TensorQuantizer(_mx_cfg(list(num_bits)))
    state = q.get_modelopt_state()
    assert state["_num_bits"] == num_bits
    assert state["_block_sizes"] == {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}
    other = mtq.TensorQuantizer()
    other.set_from_modelopt_state(state)
    assert other.fmt == fmt
