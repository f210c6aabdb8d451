"""What the CUDA kernel tests share: the check that compiled Triton kernels run, and a bit-for-bit comparison.

Import ``_compiled_triton`` into a test module to make it autouse there.
"""

import pytest
import torch

from modelopt_moe import kernels as K

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(autouse=True, scope="module")
def _compiled_triton():
    if not K.kernels_available("cuda"):
        pytest.fail("Triton kernels not available on CUDA (triton missing, or TRITON_INTERPRET=1 in this process)")


def assert_bits_equal(actual, expected, what=""):
    """Same dtype, shape and bits (NaNs at the same places), naming the first element that differs."""
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    expected = expected.to(actual.device)
    an, en = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(an, en), f"{what}: NaN positions differ"
    a = torch.where(an, torch.zeros_like(actual), actual).contiguous().view(_INT_VIEW[actual.dtype])
    e = torch.where(en, torch.zeros_like(expected), expected).contiguous().view(_INT_VIEW[actual.dtype])
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: "
                              f"{actual[tuple(bad[0])].item()!r} vs {expected[tuple(bad[0])].item()!r}")
