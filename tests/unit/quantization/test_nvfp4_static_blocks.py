"""Static NVFP4 block scales (``block_sizes.type: static``) through ``mtq.quantize``: max calibration gives dynamic
NVFP4's bits, the FP8 scale sweep (``mse`` with ``fp8_scale_sweep``) and the 4-over-6 rule choose each block's
scale as a brute-force reference does (dense and every expert layout, a distinct magnitude per expert), the state
dict carries the block amaxes, the export writes exactly the block scales the fake quant used, ``weight_amax_update:
learned`` trains them from the searched values with the LSQ-style gradient, and what is refused."""

import copy
import warnings

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.export.codecs import decode_nvfp4_modelopt
from modelopt_moe.export.schemes import SCHEMES, encode_linear
from modelopt_moe.numerics import round_to_e2m1
from modelopt_moe.numerics.nvfp4 import NVFP4, fp8_scale_candidates
from modelopt_moe.quantization.config import ConfigError, to_config
from modelopt_moe.quantization.nn import GroupedLinear

E4M3_POSITIVE = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2**-9 .. 448
SWEEP = {"method": "mse", "fp8_scale_sweep": True}
FOUR_OVER_SIX = {"method": "mse", "start_multiplier": 1.0, "stop_multiplier": 1.5, "step_size": 0.5}


def static_cfg(algorithm, four_over_six=False, **extra):
    blocks = {-1: 16, "type": "static", "scale_bits": (4, 3)}
    if four_over_six:
        blocks["four_over_six"] = True
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                          {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (2, 1), "block_sizes": blocks}}],
            "algorithm": algorithm, "weight_amax_update": "static", **extra}


def quantize(model, config, forward_loop):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(model, copy.deepcopy(config), forward_loop)


def dense():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.copy_(torch.distributions.StudentT(4.0).sample((32, 64)) * 0.02)
    return model


def experts_model():
    torch.manual_seed(0)
    experts = GroupedLinear(num_gemms=3, in_features=64, out_features=32)
    with torch.no_grad():
        for i, w in enumerate(experts.expert_weights()):
            w.mul_(4.0**i)  # a distinct magnitude per expert: a wrong expert index cannot pass
    return experts


def reference_block_scales(w: torch.Tensor, amax: torch.Tensor, candidates: torch.Tensor, scale_max: float):
    """Per block, the E4M3 block scale of least squared error among ``candidates`` (the first of equal errors), by
    brute force: ``sg = amax / (6 * scale_max)``, ``Q = round_e2m1(w / (sb * sg)) * sb * sg``."""
    sg = amax / (6 * scale_max)
    blocks = w.float().unflatten(-1, (-1, 16))
    errors = []
    for sb in candidates:
        s = sb * sg
        errors.append(((blocks - round_to_e2m1(blocks / s) * s) ** 2).sum(-1))
    return candidates[torch.stack(errors).argmin(0)]


def block_scales_used(q, w, i=None):
    """The E4M3 block scales the quantizer's fake quant uses for weight ``w`` (expert ``i``)."""
    amax = q.amax if i is None else q.row_of(q.amax, i)
    blocks = q.block_amax if i is None else q.block_amax[i]
    return NVFP4.quantize_static(w, amax, blocks, q.cfg.block_scale_max).block_scale.squeeze(-1)


def test_max_calibrated_static_block_scales_are_dynamic_nvfp4_bit_for_bit():
    x = torch.randn(4, 64)
    for dtype in (torch.float32, torch.bfloat16):
        static, dynamic = dense().to(dtype), dense().to(dtype)
        data = x.to(dtype)
        quantize(static, static_cfg("max"), lambda m, data=data: m(data))
        nvfp4 = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                               {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (2, 1), "block_sizes": {
                                   -1: 16, "type": "dynamic", "scale_bits": (4, 3)}}}]}
        quantize(dynamic, nvfp4, lambda m, data=data: m(data))
        q = static[0].weight_quantizer
        assert q.block_amax.shape == (32, 4)
        assert q.block_amax.dtype == torch.float32
        assert torch.equal(q.amax, dynamic[0].weight_quantizer.amax)
        assert torch.equal(static(x.to(dtype)), dynamic(x.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_negative_or_nan_block_amax_is_a_zero_scale_that_keeps_the_sign_of_each_element(dtype):
    """torch.clamp(-0.0, 0) keeps the -0.0 on CPU and not on CUDA: the rule is +0.0 for every non-positive or NaN
    block amax, so the zero outputs carry each element's own sign on every device (NaN for an Inf element)."""
    torch.manual_seed(0)
    x = torch.randn(3, 64).to(dtype)
    x[2, 48] = float("inf")
    blocks = x.float().abs().unflatten(-1, (-1, 16)).amax(-1)
    specials = [0.0, -0.0, -1.0, float("nan")]
    for j, v in enumerate(specials):
        blocks[j % 3, j] = v
    out = NVFP4.fake_quant_static(x, torch.tensor(x.float().abs().max().item()), blocks)
    for j in range(len(specials)):
        got, want = out[j % 3, 16 * j: 16 * (j + 1)], x[j % 3, 16 * j: 16 * (j + 1)] * 0.0
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.signbit(got[~torch.isnan(got)]), torch.signbit(want[~torch.isnan(want)]))
        assert bool((got[~torch.isnan(got)] == 0).all())


def test_the_fp8_scale_sweep_tries_every_e4m3_block_scale_and_keeps_the_least_error():
    assert torch.equal(fp8_scale_candidates() * 448, E4M3_POSITIVE)  # Model Optimizer's 126 candidates
    model, x = dense(), torch.randn(4, 64)
    maxed = copy.deepcopy(model)
    quantize(model, static_cfg(SWEEP), lambda m: m(x))
    quantize(maxed, static_cfg("max"), lambda m: m(x))
    w, q = model[0].weight.detach(), model[0].weight_quantizer
    expected = reference_block_scales(w, q.amax, E4M3_POSITIVE, 448.0)
    assert torch.equal(block_scales_used(q, w), expected)
    assert torch.equal(q.amax, maxed[0].weight_quantizer.amax)  # the second-level amax stays max calibration's
    error = ((w - model[0].weight_quantizer(w)) ** 2).sum()
    assert error < ((w - maxed[0].weight_quantizer(w)) ** 2).sum()


@pytest.mark.parametrize("layout", ["vectorized", "per_expert", "shared"])
def test_each_expert_sweeps_its_own_blocks_under_its_layouts_second_level_amax(layout):
    experts = experts_model()
    weights = [w.detach().clone() for w in experts.expert_weights()]
    quantize(experts, static_cfg(SWEEP, experts={"weight_amax": layout}),
             lambda m: m(torch.randn(6, 64), [2, 2, 2]))
    q = experts.weight_quantizer
    assert q.block_amax.shape == (3, 32, 4)
    expected_amax = [w.abs().max() for w in weights]
    for i, w in enumerate(weights):
        amax = q.row_of(q.amax, i)
        assert torch.equal(amax, max(expected_amax) if layout == "shared" else expected_amax[i])
        assert torch.equal(block_scales_used(q, w, i), reference_block_scales(w, amax, E4M3_POSITIVE, 448.0))


def test_four_over_six_maps_each_blocks_max_to_6_or_to_4_whichever_quantizes_it_better():
    model, x = dense(), torch.randn(4, 64)
    quantize(model, static_cfg(FOUR_OVER_SIX, four_over_six=True), lambda m: m(x))
    w, q = model[0].weight.detach(), model[0].weight_quantizer
    block_max = w.abs().unflatten(-1, (-1, 16)).amax(-1)
    sg = q.amax / (6 * 256)  # 4-over-6 normalizes block scales to 256
    as_6 = (block_max / 6 / sg).to(torch.float8_e4m3fn).float()
    as_4 = (block_max * 1.5 / 6 / sg).to(torch.float8_e4m3fn).float()
    blocks = w.unflatten(-1, (-1, 16))
    err = [((blocks - round_to_e2m1(blocks / (s * sg).unsqueeze(-1)) * (s * sg).unsqueeze(-1)) ** 2).sum(-1)
           for s in (as_6, as_4)]
    expected = torch.where(err[1] < err[0], as_4, as_6)
    assert torch.equal(block_scales_used(q, w), expected)
    assert bool((expected == as_4).any())  # both choices occur
    assert bool((expected == as_6).any())


def test_the_state_dict_carries_the_block_amaxes_into_a_fresh_model():
    model, x = dense(), torch.randn(4, 64)
    quantize(model, static_cfg(SWEEP), lambda m: m(x))
    state = model.state_dict()
    assert state["0.weight_quantizer._block_amax"].shape == (32, 4)
    fresh = dense()
    quantize(fresh, {**static_cfg(SWEEP), "algorithm": None}, None)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("four_over_six", [False, True])
def test_export_writes_the_block_scales_the_fake_quant_used_and_decodes_to_its_weight(four_over_six):
    model = dense()
    quantize(model, static_cfg(FOUR_OVER_SIX if four_over_six else SWEEP, four_over_six), lambda m: m(
        torch.randn(4, 64)))
    w, q = model[0].weight.detach(), model[0].weight_quantizer
    out = encode_linear("layer", w, q.amax, torch.tensor(1.0), SCHEMES["NVFP4"], "modelopt",
                        weight_blocks=(q.block_amax, q.cfg.block_scale_max))
    assert torch.equal(out["layer.weight_scale"].float(), block_scales_used(q, w))
    assert out["layer.weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(out["layer.weight_scale_2"], q.amax / (6 * q.cfg.block_scale_max))
    decoded = decode_nvfp4_modelopt(out["layer.weight"], out["layer.weight_scale"], out["layer.weight_scale_2"],
                                    torch.float32)
    assert torch.equal(decoded, q(w))


def test_configs_refuse_what_static_block_scales_cannot_do():
    with pytest.raises(ConfigError, match="weight_amax_update=dynamic"):
        to_config({**static_cfg("max"), "weight_amax_update": "dynamic"})
    with pytest.raises(ConfigError, match="four_over_six"):
        to_config({"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": {
            "num_bits": (4, 3), "block_sizes": {-1: 16, "four_over_six": True}}}]})
    model = dense()
    config = static_cfg("max")
    config["quant_cfg"][1]["quantizer_name"] = "*quantizer"
    with pytest.raises(ValueError, match=r"0\.input_quantizer has static block scales"):
        quantize(model, config, lambda m: m(torch.randn(4, 64)))


def lsq_block_grad(w: torch.Tensor, wq: torch.Tensor, grad: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The learned block amax's gradient by its formula: ``sum (q - w * [|w| <= a]) / a * g / sqrt(16 * 6)``."""
    wb, qb, gb = (t.float().unflatten(-1, (-1, 16)) for t in (w, wq, grad))
    a = blocks.unsqueeze(-1)
    d = torch.where(wb.abs() <= a, qb - wb, qb)
    return (gb * d / a).sum(-1) / (16 * 6) ** 0.5


@pytest.mark.parametrize("layout", [None, "vectorized", "per_expert"])
def test_learned_block_scales_start_from_the_sweep_and_train_with_the_lsq_gradient(layout):
    data = torch.randn(6, 64)
    if layout is None:
        model, static = dense(), dense()
        loop, extra = (lambda m: m(data)), {}
    else:
        model, static = experts_model(), experts_model()
        loop, extra = (lambda m: m(data, [2, 2, 2])), {"experts": {"weight_amax": layout}}
    quantize(model, {**static_cfg(SWEEP, **extra), "weight_amax_update": "learned"}, loop)
    quantize(static, static_cfg(SWEEP, **extra), loop)
    q = model[0].weight_quantizer if layout is None else model.weight_quantizer
    qs = static[0].weight_quantizer if layout is None else static.weight_quantizer
    assert isinstance(q.block_amax, nn.Parameter)
    assert not q.learns_amax  # the second-level amax stays static
    assert torch.equal(q.block_amax.detach(), qs.block_amax)
    assert any(p is q.block_amax for p in model.parameters())
    out = loop(model)
    assert torch.equal(out, loop(static))  # the same forward as the static block scales
    g = torch.randn_like(out)
    (out * g).sum().backward()
    weights = [model[0].weight] if layout is None else list(model.expert_weights())
    assert q.block_amax.grad is not None
    for i, w in enumerate(weights):
        w = w.detach()
        blocks = q.block_amax.detach() if layout is None else q.block_amax.detach()[i]
        with torch.no_grad():
            wq = q(w) if layout is None else q.fake_quant_expert(i, w)
        # the weight operand's incoming gradient, through the linear: x^T g (per expert's rows of the batch)
        rows = slice(None) if layout is None else slice(2 * i, 2 * i + 2)
        grad_w = g[rows].t() @ data[rows]
        expected = lsq_block_grad(w, wq, grad_w, blocks)
        got = q.block_amax.grad if layout is None else q.block_amax.grad[i]
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7), (i, (got - expected).abs().max())
    before = q.block_amax.detach().clone()
    lr = 0.5 * float(before.max() / q.block_amax.grad.abs().max())  # a step that moves some block scale
    torch.optim.SGD([q.block_amax], lr=lr).step()
    assert not torch.equal(q.block_amax.detach(), before)
    assert not torch.equal(loop(model), loop(static))  # the next forward uses the trained block scales


@pytest.mark.parametrize("update", ["static", "learned"])
@pytest.mark.parametrize("layout", [None, "vectorized", "per_expert"])
def test_save_and_restore_carry_the_block_amaxes_in_every_expert_layout(tmp_path, layout, update):
    from modelopt_moe.checkpoint import restore, save

    data = torch.randn(6, 64)
    build = dense if layout is None else experts_model
    loop = (lambda m: m(data)) if layout is None else (lambda m: m(data, [2, 2, 2]))
    extra = {} if layout is None else {"experts": {"weight_amax": layout}}
    model = build()
    quantize(model, {**static_cfg(SWEEP, **extra), "weight_amax_update": update}, loop)
    save(model, tmp_path / "ckpt.pt")
    torch.manual_seed(5)
    fresh = build()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(2.0)  # other weights: the checkpoint's must come back
    restore(fresh, tmp_path / "ckpt.pt")
    q = model[0].weight_quantizer if layout is None else model.weight_quantizer
    r = fresh[0].weight_quantizer if layout is None else fresh.weight_quantizer
    assert torch.equal(r.block_amax.detach(), q.block_amax.detach())
    assert r.learns_block_amax == (update == "learned")
    assert torch.equal(loop(fresh), loop(model))


def test_a_sweep_without_static_block_scales_warns_that_it_searched_nothing():
    model = dense()
    config = static_cfg(SWEEP)
    config["quant_cfg"][1]["cfg"]["block_sizes"]["type"] = "dynamic"
    with pytest.warns(UserWarning, match="no weight quantizer has static NVFP4 block scales"):
        mtq.quantize(model, config, lambda m: m(torch.randn(4, 64)))


@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
@pytest.mark.parametrize("operands", ["recompute", "keep"])
def test_kernel_triton_runs_static_block_scales_in_one_launch_with_the_references_bits(monkeypatch, ste, operands):
    """``kernel: triton`` fake-quantizes every expert's static block scales in one launch per forward (and one per
    recomputing backward), with the reference's outputs and gradients; the clipped STE clips at each block's amax."""
    from modelopt_moe.kernels import static_blocks_fake_quant as kernel_module

    launches = []
    real = kernel_module._launch_fake_quant
    monkeypatch.setattr(kernel_module, "_launch_fake_quant", lambda *a, **k: launches.append(1) or real(*a, **k))
    experts = experts_model()
    data = torch.randn(6, 64)
    reference = copy.deepcopy(experts)
    backward = {"ste": ste, "weight_operands": operands}
    quantize(reference, static_cfg(SWEEP, kernel="torch", backward=backward), lambda m: m(data, [2, 2, 2]))
    quantize(experts, static_cfg(SWEEP, kernel="triton", backward=backward), lambda m: m(data, [2, 2, 2]))
    launches.clear()
    x, x_ref = data.clone().requires_grad_(), data.clone().requires_grad_()  # dgrad needs the weight operands
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        out = experts(x, [2, 2, 2])
    assert len(launches) == 1
    ref = reference(x_ref, [2, 2, 2])
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)
    for w, r in zip(experts.expert_weights(), reference.expert_weights(), strict=True):
        assert torch.equal(w.grad, r.grad)
    if ste == "clipped":  # some weights lie above their block's amax (the sweep chose a smaller one)
        q = experts.weight_quantizer
        above = [(w.abs().unflatten(-1, (-1, 16)) > q.block_amax[i].unsqueeze(-1)).any()
                 for i, w in enumerate(experts.expert_weights())]
        assert any(above)
    assert len(launches) == (2 if operands == "recompute" else 1)


@pytest.mark.parametrize(("preset", "algorithm", "four_over_six"), [
    ("NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", SWEEP, False), ("NVFP4_FOUR_OVER_SIX_CFG", FOUR_OVER_SIX, True)])
def test_model_optimizers_preset_names_choose_the_same_block_scales(preset, algorithm, four_over_six):
    x = torch.randn(4, 64)
    model, weights_only = dense(), dense()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, copy.deepcopy(getattr(mtq, preset)), lambda m: m(x))
    quantize(weights_only, static_cfg(algorithm, four_over_six), lambda m: m(x))
    q = model[0].weight_quantizer
    assert q.static_block_scales
    assert q.cfg.block_scale_max == (256.0 if four_over_six else 448.0)
    assert torch.equal(q.block_amax, weights_only[0].weight_quantizer.block_amax)
    assert model[0].input_quantizer.is_enabled  # inputs: NVFP4 with block scales from the data
    assert not model[0].input_quantizer.static_block_scales
    assert mtq.load_config(preset).weight_amax_update == "static"


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_clipped_ste_of_experts_clips_at_each_blocks_amax_in_the_module(kernel):
    """The experts' clipped straight-through gradient inside the module is StaticBlocksSTE's, expert by expert: zero
    where a weight exceeds its block's amax (not the expert's second-level amax)."""
    from modelopt_moe.quantization.tensor_quantizer import StaticBlocksSTE

    experts = experts_model()
    data = torch.randn(6, 64)
    quantize(experts, static_cfg(SWEEP, kernel=kernel, backward={"ste": "clipped"}), lambda m: m(data, [2, 2, 2]))
    q = experts.weight_quantizer
    grad = torch.randn(6, 32)
    experts(data, [2, 2, 2]).backward(grad)
    for i, w in enumerate(experts.expert_weights()):
        leaf = w.detach().clone().requires_grad_()
        wq = StaticBlocksSTE.apply(leaf, q.row_of(q.amax, i), q.block_amax[i], q.fmt, q.cfg.block_scale_max, True)
        (data[2 * i : 2 * i + 2] @ wq.t()).backward(grad[2 * i : 2 * i + 2])
        assert torch.equal(w.grad == 0, leaf.grad == 0), i
        torch.testing.assert_close(w.grad, leaf.grad, rtol=1e-6, atol=0)
    above_block = [(w.abs().unflatten(-1, (-1, 16)) > q.block_amax[i].unsqueeze(-1)).any()
                   for i, w in enumerate(experts.expert_weights())]
    assert any(above_block)


@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
@pytest.mark.parametrize("layout", ["vectorized", "per_expert"])
def test_learned_block_scales_of_experts_take_one_launch_and_the_references_gradients(monkeypatch, layout, ste):
    """``kernel: triton`` with learned block amaxes: one launch forward, and the weights' and block amaxes' gradients
    bit for bit those of the reference expert by expert (``kernel: torch``)."""
    from modelopt_moe.kernels import static_blocks_fake_quant as kernel_module

    launches = []
    real = kernel_module._launch_fake_quant
    monkeypatch.setattr(kernel_module, "_launch_fake_quant", lambda *a, **k: launches.append(1) or real(*a, **k))
    data = torch.randn(6, 64)
    models = {}
    for kernel in ("torch", "triton"):
        models[kernel] = experts_model()
        cfg = static_cfg(SWEEP, kernel=kernel, experts={"weight_amax": layout}, backward={"ste": ste})
        quantize(models[kernel], {**cfg, "weight_amax_update": "learned"}, lambda m: m(data, [2, 2, 2]))
    launches.clear()
    outs = {k: m(data, [2, 2, 2]) for k, m in models.items()}
    assert len(launches) == 1
    assert torch.equal(outs["triton"], outs["torch"])
    g = torch.randn_like(outs["torch"])
    for out in outs.values():
        (out * g).sum().backward()
    q, qr = models["triton"].weight_quantizer, models["torch"].weight_quantizer
    assert q.learns_block_amax
    assert torch.equal(q.block_amax.grad.view(torch.int32), qr.block_amax.grad.view(torch.int32))  # signed zeros too
    assert q.block_amax.grad.abs().sum() > 0
    for w, r in zip(models["triton"].expert_weights(), models["torch"].expert_weights(), strict=True):
        assert torch.equal(w.grad.view(torch.int32), r.grad.view(torch.int32))
