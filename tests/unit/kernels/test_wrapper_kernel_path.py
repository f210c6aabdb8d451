"""The quantized grouped linear on the one-launch kernel path (``kernel: triton``, here under the Triton
interpreter) gives the same bits as on the torch reference path: outputs, input and weight gradients."""

import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.kernels import kernels_available
from modelopt_moe.quantization.nn import GroupedLinear

pytestmark = pytest.mark.skipif(not kernels_available("cpu"), reason="needs the Triton interpreter on CPU")

SPLITS = [3, 0, 5]


def _run(preset, weight_amax, input_amax, ste, kernel, narrow_range=None):
    torch.manual_seed(0)
    layer = GroupedLinear(len(SPLITS), 32, 16, bias=False)
    with torch.no_grad():
        for i, w in enumerate(layer.expert_weights()):
            w.mul_(1.0 + 3 * i)
    cfg = mtq.load_config(preset)
    if narrow_range is not None:
        for entry in cfg.quant_cfg:
            if entry.cfg is not None:
                entry.cfg = entry.cfg.model_copy(update={"narrow_range": narrow_range})
    cfg.experts.weight_amax, cfg.experts.input_amax = weight_amax, input_amax
    cfg.backward.ste, cfg.kernel = ste, kernel
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SPLITS), 32, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    x = x.clone().requires_grad_(True)
    y = layer(x, torch.tensor(SPLITS))
    y.backward(torch.randn(y.shape, generator=g))
    return y.detach(), x.grad, [w.grad for w in layer.expert_weights()]


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml", "mxfp4_default.yaml",
                                    "mxfp8_default.yaml", "nvfp4_4over6.yaml"])
@pytest.mark.parametrize(("weight_amax", "input_amax", "ste"), [
    ("vectorized", "per_expert", "clipped"),
    ("per_expert", "shared", "pass_through"),
    ("vectorized", "shared", "clipped"),
    ("shared", "per_expert", "pass_through"),
])
def test_kernel_path_matches_the_reference_bit_for_bit(preset, weight_amax, input_amax, ste):
    ref = _run(preset, weight_amax, input_amax, ste, "torch")
    fast = _run(preset, weight_amax, input_amax, ste, "triton")
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(fast[2], ref[2], strict=True))


@pytest.mark.parametrize("preset", ["int8_default.yaml", "int4_blockwise_weight_only.yaml"])
@pytest.mark.parametrize("narrow_range", [False, True])
def test_int_kernel_path_matches_the_reference_in_both_ranges(preset, narrow_range):
    # int8: per channel, inputs per tensor; int4: blocks of 128 on 32-wide experts (padded), both int ranges.
    ref = _run(preset, "vectorized", "per_expert", "clipped", "torch", narrow_range)
    fast = _run(preset, "vectorized", "per_expert", "clipped", "triton", narrow_range)
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(fast[2], ref[2], strict=True))


@pytest.mark.parametrize(("weight_amax", "input_amax", "ste"), [
    ("vectorized", "per_expert", "clipped"),
    ("per_expert", "shared", "pass_through"),
])
def test_quantized_grouped_linear_traces_with_fullgraph_and_matches_eager(weight_amax, input_amax, ste):
    torch.manual_seed(0)
    layer = GroupedLinear(len(SPLITS), 32, 16, bias=True)
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.weight_amax, cfg.experts.input_amax = weight_amax, input_amax
    cfg.backward.ste, cfg.kernel = ste, "triton"
    x = torch.randn(sum(SPLITS), 32, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))

    def run(fn):
        for w in layer.parameters():
            w.grad = None
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        y.square().sum().backward()
        return y.detach(), xx.grad, [w.grad.clone() for w in layer.expert_weights()]

    eager = run(lambda t: layer(t, SPLITS))
    torch._dynamo.reset()
    compiled = run(torch.compile(lambda t: layer(t, SPLITS), fullgraph=True, backend="aot_eager"))
    assert torch.equal(compiled[0], eager[0])
    assert torch.equal(compiled[1], eager[1])
    assert all(torch.equal(a, b) for a, b in zip(compiled[2], eager[2], strict=True))
