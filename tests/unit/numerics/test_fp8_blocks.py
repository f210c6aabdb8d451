"""FP8 in blocks (numerics/fp8.py, numerics/blocks.py): every block is the per-tensor FP8 rule with the block's own
amax, partial blocks are zero-padded, and the edge rules of the module docstring hold."""

import pytest
import torch

from modelopt_moe.numerics import fake_quant, quantize

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16,
                                torch.float16: torch.int16}[t.dtype])


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    same = (_bits(a) == _bits(b)) | (torch.isnan(a) & torch.isnan(b))
    assert bool(same.all()), f"{int((~same).sum())} elements differ"


def _spread(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-2]).unsqueeze(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (2, 130, 129), (5, 7)])
def test_each_2d_block_is_per_tensor_fp8_with_the_blocks_own_amax(shape, dtype):
    x = _spread(shape).to(dtype)
    y = fake_quant(x, "e4m3", None, (128, 128))
    assert y.dtype == dtype
    assert y.shape == x.shape
    for r in range(0, shape[-2], 128):
        for c in range(0, shape[-1], 128):
            block = x[..., r:r + 128, c:c + 128]
            for i in range(block.shape[0] if block.dim() == 3 else 1):
                b = block[i] if block.dim() == 3 else block
                expected = fake_quant(b, "e4m3", b.float().abs().amax())
                got = y[i, r:r + 128, c:c + 128] if block.dim() == 3 else y[r:r + 128, c:c + 128]
                _exact(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_token_groups_of_128_are_per_tensor_fp8_per_group_at_any_token_count(tokens, dtype):
    x = (torch.randn(tokens, 300) * torch.logspace(-2, 2, 300)).to(dtype)
    y = fake_quant(x, "e4m3", None, 128)
    for t in range(tokens):
        for c in range(0, 300, 128):
            g = x[t, c:c + 128]
            _exact(y[t, c:c + 128], fake_quant(g, "e4m3", g.float().abs().amax()))


def test_edge_blocks_zero_tiny_inf_nan_and_negative_zero():
    x = torch.zeros(4, 8)
    x[0:2, 0:2] = 2.0 ** -30  # tiny block: amax invalid -> scale 1 -> rounds to 0 (E4M3's smallest is 2**-9)
    x[0, 2], x[0, 3], x[1, 3] = float("inf"), 1.0, 0.3  # a block holding Inf: scale 1, Inf saturates to 448
    x[2, 0], x[2, 1], x[3, 1] = float("nan"), 3.0, -1.0  # NaN stays in its element, ignored by the block max
    x[3, 2] = -0.0  # an all-zero block with a negative zero
    y = fake_quant(x, "e4m3", None, (2, 2))
    assert torch.equal(y[0:2, 0:2], torch.zeros(2, 2))
    assert y[0, 2] == 448.0
    assert y[0, 3] == 1.0
    assert y[1, 3] == fake_quant(torch.tensor(0.3), "e4m3", torch.tensor(448.))
    assert torch.isnan(y[2, 0])
    assert int(torch.isnan(y).sum()) == 1
    assert y[2, 1] == 3.0
    assert y[3, 1] == fake_quant(torch.tensor(-1.0), "e4m3", torch.tensor(3.0))
    assert y[3, 2] == 0
    assert torch.signbit(y[3, 2])
    assert torch.equal(y[2:4, 4:8], torch.zeros(2, 4))
    assert torch.isfinite(y[~torch.isnan(x)]).all()


def test_quantize_gives_the_values_and_one_scale_per_block_padding_counted():
    x = _spread((300, 260))
    qx = quantize(x, "e4m3", None, (128, 128))
    assert qx.values.shape == (3, 128, 3, 128)
    assert qx.scale.shape == (3, 1, 3, 1)
    assert torch.equal(qx.values, qx.values.to(torch.float8_e4m3fn).float())
    assert qx.values[2, 44:].abs().sum() == 0
    assert qx.values[:, :, 2, 4:].abs().sum() == 0
    amax = torch.tensor([[x[r:r + 128, c:c + 128].abs().max() for c in (0, 128, 256)] for r in (0, 128, 256)])
    # A true division, the per-tensor convention (torch's ``448.0 / amax`` is a reciprocal times 448: not the same).
    _exact(qx.scale.reshape(3, 3), torch.div(torch.full_like(amax, 448.0), amax))
    _exact(torch.div(qx.values, qx.scale).flatten(-2).flatten(-3, -2)[:300, :260], fake_quant(x, "e4m3", None,
                                                                                               (128, 128)))


@pytest.mark.parametrize(("block", "match"), [((128,), "blocks of the last dim"), ((0, 128), "blocks of the last dim"),
                                              (True, "blocks of the last dim")])
def test_bad_block_sizes_are_refused(block, match):
    with pytest.raises(ValueError, match=match):
        fake_quant(torch.ones(4, 4), "e4m3", None, block)
