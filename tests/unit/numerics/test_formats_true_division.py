"""formats.fake_quant divides with IEEE true division (its documented contract), never a reciprocal multiply.

torch evaluates ``float / tensor`` as ``reciprocal(tensor) * float`` and, on CUDA, ``tensor / float`` as a multiply by
the reciprocal; both round twice, and the second made the NVFP4 reference differ between CPU and GPU. The Triton
kernels divide with ``div_rn``, so the reference must too.
"""

import pytest
import torch

from modelopt_moe.numerics import fake_quant

# amax = 3: 127 / 3 rounds to 42.333332 by true division but to 42.333336 as reciprocal(3) * 127.
X = torch.tensor([-1.1192601919174194, 1.066943645477295, 0.8137732148170471, 0.7891730666160583])


def _true(num: float, den: torch.Tensor) -> torch.Tensor:
    return torch.div(torch.full_like(den, num), den)


@pytest.mark.parametrize(("fmt", "bound"), [("int8", 127.0), ("int4", 7.0)])
def test_int_scale_is_true_division(fmt, bound):
    amax = torch.tensor(3.0)
    scale = _true(bound, amax)
    expected = torch.div(torch.clamp(torch.round(X * scale), -bound, bound), scale)
    assert torch.equal(fake_quant(X, fmt, amax), expected)
    if fmt == "int8":  # the reciprocal multiply gives other bits here, so this test can tell them apart
        recip = bound / amax
        assert not torch.equal(torch.div(torch.clamp(torch.round(X * recip), -bound, bound), recip), expected)


@pytest.mark.parametrize(
    ("fmt", "dtype", "bound"), [("e4m3", torch.float8_e4m3fn, 448.0), ("e5m2", torch.float8_e5m2, 57344.0)]
)
def test_fp8_scale_is_true_division(fmt, dtype, bound):
    amax = torch.tensor(3.0)
    scale = _true(bound, amax)
    x = torch.linspace(-3, 3, 4097)
    q = torch.clamp(x * scale, -bound, bound).to(dtype).float()
    assert torch.equal(fake_quant(x, fmt, amax), torch.div(q, scale))


def test_nvfp4_global_and_block_scales_are_true_division():
    torch.manual_seed(0)
    x = torch.randn(64, 64) * torch.logspace(-2, 2, 64)[:, None]
    amax = torch.tensor(7.3)
    sg = torch.div(amax, torch.tensor(2688.0))
    blocks = x.unflatten(-1, (-1, 16))
    bmax = blocks.abs().amax(-1, keepdim=True)
    sb = torch.clamp(torch.div(torch.div(bmax, torch.full_like(bmax, 6.0)), sg), 0, 448).to(torch.float8_e4m3fn).float()
    s = sb * sg
    from modelopt_moe.numerics import round_to_e2m1

    expected = (round_to_e2m1(torch.where(s > 0, torch.div(blocks, s), blocks * 0.0)) * s).flatten(-2)
    assert torch.equal(fake_quant(x, "nvfp4", amax), expected)
