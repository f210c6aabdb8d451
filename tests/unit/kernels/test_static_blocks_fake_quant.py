"""Static NVFP4 block scales of N experts in one launch: bit-exact against ``NVFP4.fake_quant_static`` per expert
(forward) and against ``StaticBlocksSTE``'s mask (clipped backward), in the Triton interpreter (conftest.py sets
TRITON_INTERPRET=1); tests/gpu/test_static_blocks_gpu.py runs the same comparison natively on CUDA."""

import pytest
import torch
from test_grouped_fake_quant import assert_bits_equal, make_experts, needs_triton  # noqa: E402 - sibling test module

from modelopt_moe import kernels as K
from modelopt_moe.kernels import static_blocks_fake_quant as sb
from modelopt_moe.numerics.nvfp4 import NVFP4

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SCALE_MAX = [448.0, 256.0]  # plain, 4-over-6


def _blocks(weights, seed=0, factor=(0.6, 1.4)):
    """Each block's amax: its own max times a factor in ``factor`` (some blocks saturate, some leave room)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for w in weights:
        bmax = w.float().abs().unflatten(-1, (-1, 16)).amax(-1)
        out.append(bmax * (factor[0] + (factor[1] - factor[0]) * torch.rand(bmax.shape, generator=g)))
    return torch.stack(out)


def _reference(weights, amax, blocks, scale_max):
    return [NVFP4.fake_quant_static(w, amax[i] if amax.dim() else amax, blocks[i], scale_max)
            for i, w in enumerate(weights)]


def _check(weights, amax, blocks, scale_max):
    outs = sb.grouped_static_blocks_fake_quant(weights, amax, blocks, "nvfp4", scale_max)
    assert len(outs) == len(weights)
    for i, (o, r) in enumerate(zip(outs, _reference(weights, amax, blocks, scale_max), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@needs_triton
@pytest.mark.parametrize("scale_max", SCALE_MAX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "shape"), [(1, (8, 64)), (3, (5, 48)), (4, (3, 2048 + 32))])
def test_static_blocks_bit_exact_per_expert(n, shape, dtype, scale_max):
    # 3 x 2080 spans several tiles per expert with a ragged last one; 8 x 64 is one full tile.
    weights = make_experts([shape] * n, dtype, seed=n)
    amax = torch.stack([w.float().abs().max() * (0.9 + 0.1 * i) for i, w in enumerate(weights)])
    _check(weights, amax, _blocks(weights, seed=n), scale_max)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_static_blocks_edge_values_follow_the_reference(dtype):
    """Zero blocks, zero / negative / -0.0 / NaN / Inf / tiny / huge block amaxes, NaN and Inf elements, an invalid
    second-level amax: the reference's bits (NaN where it has NaN)."""
    weights = make_experts([(4, 128)] * 3, dtype, seed=5)
    weights[0][0, :16] = 0.0  # an all-zero block
    weights[1][1, 3] = float("nan")
    weights[1][2, 17] = float("inf")
    weights[1][3, 40] = -float("inf")
    weights[2][0, 16:32] = -0.0
    blocks = _blocks(weights, seed=3)
    specials = [0.0, -0.0, -1.0, float("nan"), float("inf"), 1e-30, 3e38, 2.0**-24]
    for j, v in enumerate(specials):  # every special block amax on a block holding finite, NaN and Inf elements
        blocks[0, j % 4, j] = v
        blocks[1, (j + 1) % 4, j % 8] = v
    blocks[1, 1, 1] = 0.0  # the Inf element's block (row 2 col 17 is block 1 of row 2): zero scale -> NaN
    blocks[1, 2, 1] = 0.0
    for amax in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, float("nan"), float("inf")]),
                 torch.tensor(0.5)):
        _check(weights, amax, blocks, 448.0)


@needs_triton
def test_static_blocks_and_zero_block_amax_with_inf_give_nan_as_the_reference():
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1], w[0, 2] = float("inf"), 1.0, -1.0
    ref = NVFP4.fake_quant_static(w, torch.tensor(1.0), torch.zeros(1, 1))
    assert torch.isnan(ref[0, 0])  # the reference's x * 0 rule
    assert ref[0, 1].item() == 0.0
    got = sb.grouped_static_blocks_fake_quant([w], torch.tensor([1.0]), torch.zeros(1, 1, 1), "nvfp4", 448.0)[0]
    assert_bits_equal(got, ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_static_blocks_clipped_backward_is_the_one_expert_mask(dtype):
    weights = make_experts([(6, 64)] * 3, dtype, seed=2)
    weights[0][0, 0] = float("nan")
    blocks = _blocks(weights, seed=4, factor=(0.3, 1.2))
    blocks[1, 0, 0] = float("nan")
    blocks[2, 1, 2] = -0.0
    amax = torch.stack([w.float().abs().max() for w in weights])
    grads = [torch.randn(w.shape, dtype=dtype) for w in weights]
    grads[2][0, 0] = float("inf")
    leaves = [w.clone().requires_grad_() for w in weights]
    outs = sb.grouped_static_blocks_fake_quant_ste(leaves, amax, blocks, "nvfp4", 448.0, ste="clipped")
    torch.autograd.backward(outs, grads)
    from modelopt_moe.quantization.tensor_quantizer import StaticBlocksSTE

    for i, w in enumerate(weights):
        ref_leaf = w.clone().requires_grad_()
        StaticBlocksSTE.apply(ref_leaf, amax[i], blocks[i], "nvfp4", 448.0, True).backward(grads[i])
        assert_bits_equal(leaves[i].grad, ref_leaf.grad, f"expert {i}")
        assert_bits_equal(outs[i].detach(), NVFP4.fake_quant_static(w, amax[i], blocks[i]), f"expert {i}")
    assert any(not torch.equal(lf.grad, g) for lf, g in zip(leaves, grads, strict=True))  # something was clipped


@needs_triton
def test_static_blocks_pass_through_backward_returns_the_gradients():
    weights = [w.requires_grad_() for w in make_experts([(2, 32)] * 2, torch.float32)]
    outs = sb.grouped_static_blocks_fake_quant_ste(weights, torch.tensor([1.0, 2.0]), _blocks(weights), "nvfp4",
                                                   448.0)
    grads = [torch.randn(2, 32) for _ in weights]
    torch.autograd.backward(outs, grads)
    for w, g in zip(weights, grads, strict=True):
        assert torch.equal(w.grad, g)


def test_static_blocks_torch_fallback_is_the_reference(monkeypatch):
    monkeypatch.setattr(sb, "kernels_available", lambda device: False)
    weights = make_experts([(3, 32)] * 2, torch.bfloat16)
    amax, blocks = torch.tensor([1.0, 9.0]), _blocks(weights)
    _check(weights, amax, blocks, 256.0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"block_amax": torch.ones(2, 3, 1)}, r"block_amax of shape \(2, 3, 1\) does not fit 2 experts of shape "
                                         r"\(3, 32\); expected \(2, 3, 2\)"),
    ({"fmt": "e4m3"}, "format 'e4m3' has no static two-level block scales"),
    # 4-over-6 from the data chooses its block scales at every call: static block scales are NVFP4's.
    ({"fmt": "nvfp4_four_over_six"}, "format 'nvfp4_four_over_six' has no static two-level block scales"),
    ({"amax": torch.ones(2, 3)}, r"amax must be \[N\] or a scalar, got \(2, 3\)"),
    ({"block_amax": torch.ones(2, 3, 2, dtype=torch.int32)}, "block_amax must be a floating tensor"),
])
def test_static_blocks_value_errors(kwargs, match):
    args = {"weights": [torch.ones(3, 32), torch.ones(3, 32)], "amax": torch.ones(2),
            "block_amax": torch.ones(2, 3, 2), "fmt": "nvfp4", "scale_max": 448.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        sb.grouped_static_blocks_fake_quant(**args)


@needs_triton
def test_static_blocks_compile_fullgraph_traces_the_op():
    weights = make_experts([(2, 32)] * 2, torch.float32)
    amax, blocks = torch.tensor([1.0, 2.0]), _blocks(weights)

    def f(a, b):
        return sb.grouped_static_blocks_fake_quant([a, b], amax, blocks, "nvfp4", 448.0)

    got = torch.compile(f, fullgraph=True, backend="eager")(*weights)
    for o, r in zip(got, _reference(weights, amax, blocks, 448.0), strict=True):
        assert_bits_equal(o, r)
    assert K.kernels_available("cpu")
