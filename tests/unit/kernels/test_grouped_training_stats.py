"""Training statistics of N experts in one launch: the per-expert weight amax (bit-exact with the torch max) and
fake quant with quantization-error sums (values bit-exact with formats.fake_quant; counts exact; sums of squares to
1e-5 relative). Triton kernels run on CPU in the interpreter (conftest.py); the same functions fall back to torch.
"""

import pytest
import torch
from test_grouped_fake_quant import (  # noqa: E402 - sibling test module
    DTYPES,
    RAGGED,
    assert_bits_equal,
    distinct_amax,
    make_experts,
    needs_triton,
    reference,
)

from modelopt_moe import kernels as K
from modelopt_moe.kernels import launch, quant_stats, weight_amax
from modelopt_moe.numerics import fake_quant, quant_error_sums, relative_mse, underflow_pct


def torch_amax(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    a = w.float().abs().nan_to_num(nan=0.0, posinf=float("inf"))
    if per_channel:
        return a.amax(dim=1) if a.numel() else torch.zeros(a.shape[0])
    return a.amax() if a.numel() else torch.zeros(())


def assert_sums_match(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == torch.float64, what
    assert got.shape == want.shape, what
    assert torch.equal(got[..., :2], want[..., :2]), f"{what}: counts {got[..., :2]} vs {want[..., :2]}"
    torch.testing.assert_close(got[..., 2:], want[..., 2:], rtol=1e-5, atol=0, msg=what)


# ----------------------------------------------------------------------------------------------------------------
# Weight amax
# ----------------------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 5])
def test_weight_amax_is_exact_per_expert(dtype, n):
    weights = make_experts(RAGGED[:n], dtype, seed=n)  # expert i is scaled by 4**i: a wrong index shows
    got = K.grouped_weight_amax(weights)
    assert got.dtype == torch.float32
    assert got.shape == (n,)
    assert torch.equal(got, torch.stack([torch_amax(w, False) for w in weights]))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_weight_amax_per_channel_ignores_nan_and_keeps_inf(dtype):
    weights = make_experts([(6, 32), (6, 64), (6, 16), (6, 1024 + 48)], dtype)  # several column tiles
    weights[1][2, 7] = float("nan")
    weights[2][4, 3] = float("inf")
    weights[0][5].zero_()
    got = K.grouped_weight_amax(weights, per_channel=True)
    assert got.shape == (4, 6)
    assert torch.equal(got, torch.stack([torch_amax(w, True) for w in weights]))
    assert got[2, 4] == float("inf")
    assert got[0, 5] == 0.0
    assert torch.isfinite(got[1]).all()


@needs_triton
def test_weight_amax_empty_and_many_experts():
    weights = make_experts([(5, 32), (0, 32), (3, 32)], torch.float16)
    assert torch.equal(K.grouped_weight_amax(weights), torch.stack([torch_amax(w, False) for w in weights]))
    shapes = [(1 + (i * 7) % 150, 32) for i in range(37)]  # ragged: the binary search over the table
    g = torch.Generator().manual_seed(2)
    many = [(torch.randn(s, generator=g) * 1.3**i).to(torch.bfloat16) for i, s in enumerate(shapes)]
    assert torch.equal(K.grouped_weight_amax(many), torch.stack([torch_amax(w, False) for w in many]))


def test_weight_amax_validates():
    with pytest.raises(ValueError, match="one row count"):
        K.grouped_weight_amax([torch.ones(4, 16), torch.ones(3, 16)], per_channel=True)
    with pytest.raises(ValueError, match="contiguous"):
        K.grouped_weight_amax([torch.ones(16, 4).t()])


# ----------------------------------------------------------------------------------------------------------------
# Fake quant with statistics
# ----------------------------------------------------------------------------------------------------------------
STAT_FORMATS = [("e4m3", None), ("nvfp4", None), ("nvfp4_four_over_six", None), ("int4", None), ("int8", 16),
                ("mxfp4", None), ("mxfp8", None)]


@needs_triton
@pytest.mark.parametrize(("fmt", "block_size"), STAT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_weight_stats_values_bit_exact_and_sums_per_expert(fmt, block_size, dtype):
    weights = make_experts(RAGGED, dtype, seed=3)
    weights[2][1, 3] = float("nan")  # excluded from every sum
    amax = distinct_amax([w.nan_to_num() for w in weights], 0.5)
    values, stats = K.grouped_weight_fake_quant_stats(weights, amax, fmt, block_size)
    ref = reference(weights, amax, fmt, block_size)
    for i, (v, r) in enumerate(zip(values, ref, strict=True)):
        assert_bits_equal(v, r, f"expert {i}")
    assert_sums_match(stats, torch.stack([quant_error_sums(w, r) for w, r in zip(weights, ref, strict=True)]))


@needs_triton
def test_weight_stats_uniform_experts_and_per_channel_amax():
    weights = make_experts([(8, 64)] * 4, torch.bfloat16)  # one shape: the uniform path, many tiles each
    amax = torch.stack([w.float().abs().amax(dim=1) * 0.6 for w in weights])
    values, stats = K.grouped_weight_fake_quant_stats(weights, amax, "e4m3")
    ref = reference(weights, amax, "e4m3", None)
    for v, r in zip(values, ref, strict=True):
        assert_bits_equal(v, r)
    assert_sums_match(stats, torch.stack([quant_error_sums(w, r) for w, r in zip(weights, ref, strict=True)]))


@needs_triton
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "nvfp4_four_over_six"])
def test_input_stats_per_expert_rows(fmt, shared):
    splits = [5, 0, 11, 1, 7]
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.randn(m, 96, generator=g) * 3.0**i for i, m in enumerate(splits)]).to(torch.bfloat16)
    amax = torch.tensor(20.0) if shared else torch.tensor([0.5, 1.0, 40.0, 9.0, 300.0])
    y, stats = K.grouped_input_fake_quant_stats(x, torch.tensor(splits), amax, fmt)
    rows = torch.repeat_interleave(amax.expand(len(splits)) if shared else amax, torch.tensor(splits)).unsqueeze(-1)
    want_y = fake_quant(x, fmt, rows)
    assert_bits_equal(y, want_y)
    want = torch.stack([quant_error_sums(c, r) for c, r in zip(x.split(splits), want_y.split(splits), strict=True)])
    assert_sums_match(stats, want)
    assert stats[1].eq(0).all()  # the expert with no tokens


def test_metrics_from_sums():
    x = torch.tensor([0.0, 1e-6, 1.0, -2.0, float("nan")])
    y = torch.tensor([0.0, 0.0, 1.0, -1.5, 0.0])
    s = quant_error_sums(x, y)
    assert s[:2].tolist() == [3.0, 1.0]  # NaN excluded; one of three non-zero values underflows
    assert underflow_pct(s).item() == pytest.approx(100 / 3)
    assert relative_mse(s).item() == pytest.approx((1e-12 + 0.25) / (1e-12 + 1 + 4))
    zero = quant_error_sums(torch.zeros(3), torch.zeros(3))
    assert underflow_pct(zero).item() == 0.0
    assert relative_mse(zero).item() == 0.0


def test_torch_fallbacks_match(monkeypatch):
    weights = make_experts(RAGGED[:3], torch.bfloat16)
    amax = distinct_amax(weights)
    fast = (K.grouped_weight_amax(weights), K.grouped_weight_fake_quant_stats(weights, amax, "e4m3"))
    monkeypatch.setattr(weight_amax, "kernels_available", lambda device: False)
    monkeypatch.setattr(quant_stats, "kernels_available", lambda device: False)
    slow = (K.grouped_weight_amax(weights), K.grouped_weight_fake_quant_stats(weights, amax, "e4m3"))
    assert torch.equal(fast[0], slow[0])
    for a, b in zip(fast[1][0], slow[1][0], strict=True):
        assert_bits_equal(a, b)
    assert_sums_match(fast[1][1], slow[1][1])


@needs_triton
def test_torch_compile_fullgraph_traces_the_stats_ops():
    weights = make_experts([(4, 32), (2, 32)], torch.float32)
    amax = distinct_amax(weights)

    def fn(w0, w1, amax, x, m):
        (a, b), s = K.grouped_weight_fake_quant_stats([w0, w1], amax, "e4m3")
        y, t = K.grouped_input_fake_quant_stats(x, m, amax, "e4m3")
        return K.grouped_weight_amax([w0, w1]), a, b, s, y, t

    x = torch.randn(4, 32)
    m = torch.tensor([3, 1])
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*weights, amax, x, m)
    assert torch.equal(got[0], torch.stack([torch_amax(w, False) for w in weights]))
    assert got[3].shape == (2, 4)
    assert got[5].shape == (2, 4)
    launch.clear_table_cache()
