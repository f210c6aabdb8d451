"""FP8 blocks on the Triton kernels (kernels/fp8_block_fake_quant.py): 2-D weight blocks of N experts in one launch
and token groups, bit-exact against formats.fake_quant per expert, in the Triton interpreter (conftest.py sets
TRITON_INTERPRET=1); the same checks run natively on CUDA in tests/gpu/test_fp8_block_kernels_gpu.py."""

import sys

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe import kernels as K
from modelopt_moe.kernels import fp8_block_fake_quant
from modelopt_moe.numerics import fake_quant, scale_rows

pytestmark = pytest.mark.skipif(not K.kernels_available("cpu"),
                                reason="Triton interpreter not active (needs triton and TRITON_INTERPRET=1)")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# Small blocks keep the interpreter fast while every expert holds several blocks, partial ones at both ends.
BLOCK = (16, 8)
SHAPES = {"one expert": [(40, 20)], "ragged": [(40, 20), (16, 8), (7, 33)], "uniform": [(32, 24)] * 4}


def assert_bits_equal(actual, expected, what=""):
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    an, en = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(an, en), f"{what}: NaN positions differ"
    a = torch.where(an, torch.zeros_like(actual), actual).contiguous().view(_INT_VIEW[actual.dtype])
    e = torch.where(en, torch.zeros_like(expected), expected).contiguous().view(_INT_VIEW[actual.dtype])
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}"


def make_experts(shapes, dtype, seed=0):
    """Expert i is scaled by 4**i (exact in every dtype) so that a wrong expert index cannot pass; edge values:
    a NaN, an Inf, a -0.0 and an all-zero block in the first expert."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(s, generator=g) * 4.0 ** i).to(dtype) for i, s in enumerate(shapes)]
    w = out[0]
    w[0, 0], w[1, 1] = float("nan"), float("inf")
    w[BLOCK[0]:2 * BLOCK[0], :BLOCK[1]] = 0.0
    w[BLOCK[0], 0] = -0.0
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_2d_weight_blocks_of_n_experts_in_one_launch_are_bit_exact(fmt, case, dtype):
    weights = make_experts(SHAPES[case], dtype)
    assert fp8_block_fake_quant.takes_weights(fmt, BLOCK, weights)
    outs = K.grouped_weight_fake_quant(weights, None, fmt, BLOCK)
    assert "modelopt_moe.kernels.fp8_block_kernels" in sys.modules  # the kernel ran, not the reference
    for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
        assert_bits_equal(o, fake_quant(w, fmt, None, BLOCK), f"expert {i}")


def test_128_blocks_with_partial_edges_are_bit_exact():
    weights = make_experts([(136, 200), (128, 128)], torch.bfloat16)
    outs = K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
    for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
        assert_bits_equal(o, fake_quant(w, "e4m3", None, (128, 128)), f"expert {i}")


# Every launch variant of the 2-D block kernel, through the public grouped op with the variant made the default:
# one program per block and persistent loops (more blocks than programs, a remainder), two passes and whole blocks,
# the table search and the uniform division with and without masks (full blocks, and partial ones at the edges).
VARIANT_SHAPES = {"ragged": [(40, 20), (16, 8), (7, 33)], "uniform, full blocks": [(32, 24)] * 4,
                  "uniform, partial blocks": [(20, 12)] * 3}


@pytest.mark.parametrize("variant", sorted(fp8_block_fake_quant.BLOCK2D_VARIANTS))
@pytest.mark.parametrize("case", sorted(VARIANT_SHAPES))
def test_every_2d_block_kernel_variant_is_bit_exact(variant, case, monkeypatch):
    monkeypatch.setattr(fp8_block_fake_quant, "BLOCK2D_DEFAULT", variant)
    for fmt, dtype in (("e4m3", torch.bfloat16), ("e5m2", torch.float32)):
        weights = make_experts(VARIANT_SHAPES[case], dtype)
        outs = K.grouped_weight_fake_quant(weights, None, fmt, BLOCK)
        for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
            assert_bits_equal(o, fake_quant(w, fmt, None, BLOCK), f"{variant}, {fmt}, expert {i}")


@pytest.mark.parametrize("variant", sorted(fp8_block_fake_quant.BLOCK2D_VARIANTS))
def test_every_2d_block_kernel_variant_is_bit_exact_on_128_blocks(variant, monkeypatch):
    monkeypatch.setattr(fp8_block_fake_quant, "BLOCK2D_DEFAULT", variant)
    for shapes in ([(136, 200), (128, 128)], [(256, 128)] * 3):
        weights = make_experts(shapes, torch.float16)
        outs = K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
        for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
            assert_bits_equal(o, fake_quant(w, "e4m3", None, (128, 128)), f"{variant}, {shapes[0]}, expert {i}")


def test_an_unknown_2d_block_kernel_variant_is_refused_with_the_known_ones():
    weights = make_experts([(32, 24)], torch.float32)
    with pytest.raises(ValueError, match=r"variant 'fastest'.*two-pass"):
        fp8_block_fake_quant.weight_blocks_fake_quant(weights, "e4m3", BLOCK, variant="fastest")
    with pytest.raises(ValueError, match="prefetch needs chunk=0 and programs_per_sm > 0"):
        fp8_block_fake_quant.Block2dVariant(chunk=32, programs_per_sm=1, prefetch=True)


def test_the_interpreter_reports_no_registers():
    weights = make_experts([(32, 24)], torch.float32)
    assert fp8_block_fake_quant.block2d_resources(weights, "e4m3", BLOCK, "whole-w8") is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "k", "group"), [(9, 300, 128), (1, 20, 8), (33, 64, 16)])
def test_token_groups_are_bit_exact_at_any_token_count(tokens, k, group, dtype):
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, k, generator=g) * torch.logspace(-3, 3, k)).to(dtype)
    x[0, 0], x[-1, -1] = float("nan"), float("-inf")
    splits = [tokens // 2, 0, tokens - tokens // 2]
    assert fp8_block_fake_quant.takes_tokens("e4m3", group)
    assert_bits_equal(K.grouped_input_fake_quant(x, splits, None, "e4m3", group), fake_quant(x, "e4m3", None, group))
    prob = torch.rand(tokens, generator=g)
    assert_bits_equal(K.grouped_input_fake_quant_scaled(x, splits, None, "e4m3", prob, group),
                      scale_rows(fake_quant(x, "e4m3", None, group), prob))


def test_blocks_that_are_not_powers_of_two_run_the_reference():
    weights = make_experts([(30, 24)], torch.float32)
    assert not fp8_block_fake_quant.takes_weights("e4m3", (12, 8), weights)
    outs = K.grouped_weight_fake_quant(weights, None, "e4m3", (12, 8))
    assert_bits_equal(outs[0], fake_quant(weights[0], "e4m3", None, (12, 8)))


@pytest.mark.parametrize("mode", ["dequantized", "quantized"])
def test_grouped_linear_on_the_kernel_path_gives_the_reference_bits(mode):
    from modelopt_moe.quantization.nn import GroupedLinear

    def run(kernel):
        torch.manual_seed(0)
        layer = GroupedLinear(3, 136, 40, bias=False)
        with torch.no_grad():
            for i, w in enumerate(layer.expert_weights()):
                w.mul_(4.0 ** i)
        cfg = mtq.load_config("fp8_block_w8a8")
        cfg.kernel, cfg.backward.mode = kernel, mode
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 136, generator=g)
        mtq.quantize(layer, cfg, lambda m: m(x, [3, 0, 5]))
        x = x.clone().requires_grad_(True)
        y = layer(x, torch.tensor([3, 0, 5]))
        y.backward(torch.randn(y.shape, generator=g))
        return y.detach(), x.grad, [w.grad for w in layer.expert_weights()]

    ref, fast = run("torch"), run("triton")
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(fast[2], ref[2], strict=True))


def test_torch_compile_fullgraph_traces_2d_blocks():
    weights = make_experts([(40, 24)] * 3, torch.float32)

    def fn(*ws):
        return [o * 2 for o in K.grouped_weight_fake_quant(list(ws), None, "e4m3", BLOCK)]

    outs = torch.compile(fn, fullgraph=True, backend="eager")(*weights)
    for o, w in zip(outs, weights, strict=True):
        assert_bits_equal(o, fake_quant(w, "e4m3", None, BLOCK) * 2)
