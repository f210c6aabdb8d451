"""NVFP4 with 4-over-6 block scales from the data (``nvfp4_four_over_six``) on the one-launch kernels: bit-exact with
``fake_quant`` on the values where the choice between a block's two candidates is delicate (ties, zero and non-finite
blocks, block scales that underflow or saturate, invalid amax), for expert weights, tokens split among experts and a
dense tensor, forward and straight-through backward. The format-parametrized tests of test_grouped_fake_quant.py
cover random data, options and checks.
"""

import warnings

import pytest
import torch
from autograd_paths import assert_kernel_path, assert_reference_path, graph_nodes
from test_grouped_fake_quant import assert_bits_equal, expert_amax, needs_triton
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe import kernels as K
from modelopt_moe.numerics import clip_limit, fake_quant
from modelopt_moe.quantization.nn import GroupedLinear

FMT = "nvfp4_four_over_six"
SG_ONE = 1536.0  # amax = 6 * 256: the second-level scale is exactly 1, block scales are the block max / 6 or / 4


def _block(*head: float) -> list[float]:
    return [*head, *[0.0] * (16 - len(head))]


# With sg = 1 and a block max of 12 the candidates' scales are 2 (E2M1 grid 0, 1, 2, 3, 4, 6, 8, 12) and 3 (0, 1.5,
# 3, 4.5, 6, 9, 12): 1.5 is exact on the 4 grid and 0.5 off on the 6 grid, 2.0 the other way round.
FOUR_WINS = _block(12.0, 1.5)
SIX_WINS = _block(12.0, 2.0)
TIE = _block(12.0, 1.5, 2.0)  # both errors 0.25 + 0.25: a tie keeps 6
EXACT_TIE = [12.0] * 16  # both errors 0
# Block max 6 * 2**-10: its scale on 6 is 2**-10, which rounds to E4M3's 0 (a tie to even); on 4 it is 1.5 * 2**-10,
# which rounds up to 2**-9. The 6 candidate is x * 0, the 4 one keeps the block exactly.
UNDERFLOW_ON_SIX = _block(6 * 2.0**-10, 2.0**-10, -(2.0**-9))
EXPECTED = {  # the output of each block above with sg = 1
    "four wins": _block(12.0, 1.5),
    "six wins": _block(12.0, 2.0),
    "tie": _block(12.0, 2.0, 2.0),
    "exact tie": [12.0] * 16,
    "underflow on six": UNDERFLOW_ON_SIX,
}


def _named_blocks() -> torch.Tensor:
    """[5, 16]: the blocks of :data:`EXPECTED`, in its order."""
    return torch.tensor([FOUR_WINS, SIX_WINS, TIE, EXACT_TIE, UNDERFLOW_ON_SIX])


def _edge_rows(dtype, seed: int) -> torch.Tensor:
    """[12, 64] in ``dtype``: random blocks between the delicate ones (zeros, -0.0, NaN, +-Inf, subnormals, huge
    values, the named blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 64, generator=g) * 3
    x[0] = 0.0
    x[1, :16] = -0.0
    x[1, 16:32] = torch.tensor(_block(-0.0, 0.0, -0.0))
    x[2, 3], x[2, 20], x[2, 40] = float("nan"), float("inf"), -float("inf")
    x[3, :16] = float("nan")  # an all-NaN block: block max 0
    x[3, 16:32] = torch.tensor(_block(float("nan"), 0.0, -0.0))
    tiny = torch.finfo(dtype).tiny  # subnormals of the dtype, and a block of them alone
    x[4, :16] = tiny * torch.linspace(-0.9, 0.9, 16)
    x[4, 16:20] = torch.tensor([tiny / 4, -tiny / 8, 1.0, -tiny / 2])
    x[5, :8] = torch.tensor([3e4, -6e4, 1e4, 7.0, -2.5e4, 0.5, 6e4, -1.0])  # above any amax below: saturates
    x[6:11, :16] = _named_blocks()
    x[6:11, 16:32] = -_named_blocks()  # mirrored: the sign must not change the choice
    x[6:11, 32:48] = _named_blocks() * 2.0**-6  # the same blocks in another binade of block scales
    x[11] *= 1e-4
    return x.to(dtype)


# Per expert: the named blocks' amax (sg = 1), one below most values (block scales saturate at 448), invalid ones
# (0, 2**-24, NaN, Inf, negative: the bound), a huge one (every block scale underflows: x * 0) and a tiny valid one.
AMAX = [SG_ONE, 0.05, 0.0, 2.0**-24, float("nan"), float("inf"), -1.0, 3.4e38, 2.0**-24 * (1 + 2.0**-23)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_weights_of_many_experts_with_edge_values_and_amax_are_the_reference(dtype):
    weights = [_edge_rows(dtype, seed=i) for i in range(len(AMAX))]
    amax = torch.tensor(AMAX)
    outs = K.grouped_weight_fake_quant(weights, amax, FMT)
    for i, (w, o) in enumerate(zip(weights, outs, strict=True)):
        assert_bits_equal(o, fake_quant(w, FMT, amax[i]), f"expert {i} amax {AMAX[i]}")
    # Per channel (one amax per row) and shared (one scalar) as well.
    rows = torch.stack([w.float().nan_to_num(0.0, 0.0, 0.0).abs().amax(dim=1) * 0.7 for w in weights])
    rows[0, 6:11] = SG_ONE
    for amax_kind in (rows, torch.tensor(SG_ONE)):
        for i, (w, o) in enumerate(zip(weights, K.grouped_weight_fake_quant(weights, amax_kind, FMT), strict=True)):
            assert_bits_equal(o, fake_quant(w, FMT, expert_amax(amax_kind, i)), f"expert {i}")
    if dtype == torch.float32:  # the named blocks keep the candidate the rule says (sg = 1: exact in fp32)
        for j, (name, want) in enumerate(EXPECTED.items()):
            assert outs[0][6 + j, :16].tolist() == want, name
            assert (-outs[0][6 + j, 16:32]).tolist() == want, name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tokens_split_among_experts_with_edge_values_are_the_reference(dtype):
    splits = [4, 0, 12, 0, 7, 1]
    x = torch.cat([_edge_rows(dtype, seed=9), _edge_rows(dtype, seed=10)[:12]])[: sum(splits)].contiguous()
    m = torch.tensor(splits)
    for amax in (torch.tensor([SG_ONE, 3.0, 0.05, float("nan"), 0.0, 3.4e38]), torch.tensor(SG_ONE),
                 torch.tensor(float("inf"))):
        y = K.grouped_input_fake_quant(x, m, amax, FMT)
        parts = [fake_quant(p, FMT, amax if amax.dim() == 0 else amax[i]) for i, p in enumerate(x.split(splits))]
        assert_bits_equal(y, torch.cat(parts), f"amax {amax.tolist()}")


@needs_triton
@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_straight_through_gradients_of_weights_tokens_and_a_dense_tensor(ste):
    weights = [_edge_rows(torch.bfloat16, seed=i).requires_grad_() for i in range(3)]
    amax = torch.tensor([SG_ONE, 2.0, float("nan")])
    outs = K.grouped_weight_fake_quant_ste(weights, amax, FMT, ste=ste)
    grads = [torch.randn(w.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) for w in weights]
    torch.autograd.backward(outs, grads)
    for i, (w, g) in enumerate(zip(weights, grads, strict=True)):
        assert_bits_equal(outs[i].detach(), fake_quant(w.detach(), FMT, amax[i]), f"expert {i}")
        keep = w.detach().abs() <= clip_limit(amax[i]) if ste == "clipped" else torch.ones_like(w, dtype=torch.bool)
        assert_bits_equal(w.grad, g * keep, f"expert {i} gradient")

    splits = [5, 0, 7]
    x = _edge_rows(torch.bfloat16, seed=3).requires_grad_()
    amax_in = torch.tensor([2.0, 1.0, SG_ONE])
    y = K.grouped_input_fake_quant_ste(x, torch.tensor(splits), amax_in, FMT, ste=ste)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(y.dtype)
    y.backward(gy)
    rows = torch.repeat_interleave(amax_in, torch.tensor(splits)).unsqueeze(-1)
    parts = [fake_quant(p, FMT, amax_in[i]) for i, p in enumerate(x.detach().split(splits))]
    assert_bits_equal(y.detach(), torch.cat(parts))
    assert_bits_equal(x.grad, gy * (x.detach().abs() <= clip_limit(rows)) if ste == "clipped" else gy)

    dense = _edge_rows(torch.float16, seed=4).view(3, 4, 64).requires_grad_()  # leading dims flattened
    out = K.dense_fake_quant_ste(dense, torch.tensor(2.0), FMT, ste=ste)
    assert_bits_equal(out.detach(), fake_quant(dense.detach(), FMT, torch.tensor(2.0)))
    out.backward(torch.ones_like(out))
    keep = dense.detach().abs() <= 2.0 if ste == "clipped" else torch.ones_like(dense, dtype=torch.bool)
    assert_bits_equal(dense.grad, torch.ones_like(dense) * keep)


def near_tie_blocks(n: int, seed: int) -> torch.Tensor:
    """[n, 16] fp32 blocks (quantized with sg = 1) whose two candidates' squared errors are nearly equal: max 12, a 1.5
    (0.5 off on the 6 grid, exact on the 4 grid) and a 2.0 (the other way round) at random places, and small values
    elsewhere that round to 0 in both candidates. The sum of the squares then rounds differently in different orders,
    and so does the choice of many blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 16, generator=g) * 0.45 * 2.0 ** -torch.randint(0, 6, (n, 16), generator=g).float()
    for row in x:
        where = torch.randperm(15, generator=g)[:3] + 1
        row[0], row[where[0]], row[where[1]] = 12.0, 1.5, 2.0
        row[where[2]] = 0.0
    return x


def _adjacent_pairs(sq: torch.Tensor) -> torch.Tensor:
    """The reference's order (``block_square_error``): adjacent pairs, then pairs of those, ..."""
    while sq.shape[-1] > 1:
        sq = sq[..., 0::2] + sq[..., 1::2]
    return sq[..., 0]


def _error_sums(x: torch.Tensor, order) -> torch.Tensor:
    """Each block's squared error of both candidates (sg = 1: scales 2 and 3), summed by ``order``: [n, 2]."""
    from modelopt_moe.numerics.nvfp4 import round_to_e2m1

    return torch.stack([order((round_to_e2m1(x / s) * s - x) ** 2) for s in (2.0, 3.0)], dim=-1)


@needs_triton
def test_blocks_whose_choice_depends_on_the_order_of_the_error_sum_follow_the_reference():
    x = near_tie_blocks(512, seed=0).reshape(64, 128)
    out = K.grouped_weight_fake_quant([x], torch.tensor([SG_ONE]), FMT)[0]
    assert_bits_equal(out, fake_quant(x, FMT, torch.tensor(SG_ONE)))
    y = K.grouped_input_fake_quant(x, torch.tensor([40, 24]), torch.tensor([SG_ONE, SG_ONE]), FMT)
    assert_bits_equal(y, out)
    # Not vacuous: summed left to right, or as a reduction of 16 (numpy sums 8 strided pairs first), the errors
    # choose another candidate for some of these blocks.
    blocks = x.reshape(-1, 16)
    tree = _error_sums(blocks, _adjacent_pairs)
    for order in (lambda sq: sq.cumsum(-1)[..., -1], lambda sq: _adjacent_pairs(sq[..., :8] + sq[..., 8:])):
        other = _error_sums(blocks, order)
        assert ((other[:, 1] < other[:, 0]) != (tree[:, 1] < tree[:, 0])).any()


# ----------------------------------------------------------------------------------------------------------------
# A user's config: 4-over-6 from the data on weights and inputs of a dense and a grouped expert linear
# ----------------------------------------------------------------------------------------------------------------
SPLITS = [5, 0, 9, 2]  # tokens per expert, one expert without any


def _quantize_and_step(kind: str, kernel: str, ste: str, input_amax: str):
    cfg = mtq.load_config("nvfp4_4over6.yaml")  # the shipped preset, mtq.NVFP4_4OVER6_CFG
    cfg.kernel, cfg.backward.ste, cfg.experts.input_amax = kernel, ste, input_amax
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "dense":
        model = nn.Sequential(nn.Linear(64, 16)).to(torch.bfloat16)
        x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
        forward = model
    else:
        model = GroupedLinear(len(SPLITS), 64, 32, bias=False)
        with torch.no_grad():
            for i, w in enumerate(model.expert_weights()):
                w.mul_(1.0 + 3 * i)  # a distinct magnitude per expert
        x = torch.randn(sum(SPLITS), 64, generator=g) * 4

        def forward(t):
            return model(t, SPLITS)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: forward(x))
    formats = {q.fmt for n, q in model.named_modules() if n.endswith(("weight_quantizer", "input_quantizer"))}
    xx = (x * 1.5).requires_grad_(True)  # past the calibrated input amax: the clipped STE clips some
    y = forward(xx)
    y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return y.detach(), xx.grad, [p.grad for p in model.parameters()], graph_nodes(y), formats


@needs_triton
@pytest.mark.parametrize(("kind", "ste", "input_amax"), [("dense", "clipped", "shared"),
                                                         ("dense", "pass_through", "shared"),
                                                         ("grouped", "clipped", "per_expert"),
                                                         ("grouped", "pass_through", "shared")])
def test_a_dynamic_four_over_six_config_runs_on_the_kernels_with_the_reference_bits(kind, ste, input_amax):
    ref = _quantize_and_step(kind, "torch", ste, input_amax)
    fast = _quantize_and_step(kind, "triton", ste, input_amax)
    assert fast[4] == ref[4] == {FMT}
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(fast[2], ref[2], strict=True))
    assert_kernel_path(fast[3])
    assert_reference_path(ref[3])
