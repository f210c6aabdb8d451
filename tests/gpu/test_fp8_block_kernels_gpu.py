"""FP8 block kernels natively on CUDA: 2-D weight blocks of N experts and token groups bit-exact against
formats.fake_quant per expert (on the GPU and on the CPU), CUDA graph capture and replay, torch.compile(fullgraph=True),
and no host synchronisation.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_fp8_block_kernels_gpu.py``. TRITON_INTERPRET must not
be set.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_kernel_checks import _compiled_triton, assert_bits_equal  # noqa: E402, F401  (autouse)

from modelopt_moe import kernels as K  # noqa: E402
from modelopt_moe.kernels import fp8_block_fake_quant  # noqa: E402
from modelopt_moe.numerics import fake_quant, scale_rows  # noqa: E402

FORMATS = [("e4m3", (128, 128)), ("e5m2", (128, 128)), ("e4m3", (64, 128)), ("e4m3", (32, 16))]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEV = "cuda"


def reference(weights, fmt, block_size):
    return [fake_quant(w, fmt, None, block_size) for w in weights]


def make_experts(shapes, dtype, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    # Expert magnitudes 2**(i % 13 - 6): distinct among neighbours, in range for every dtype.
    return [(torch.randn(s, generator=g, device=device) * 2.0 ** (i % 13 - 6)).to(dtype) for i, s in enumerate(shapes)]


# Realistic expert shapes (rows x K) per N, with partial blocks in the ragged case.
SHAPES = {1: [(1536, 2048)], 3: [(768, 1024), (200, 1000), (512, 1024)], 32: [(384, 512)] * 32,
          128: [(128, 256)] * 128, 256: [(64 + 16 * (i % 5), 256) for i in range(256)]}


@pytest.mark.parametrize("n", sorted(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_weights_bit_exact_per_expert(fmt, block_size, dtype, n):
    weights = make_experts(SHAPES[n], dtype, seed=n)
    assert fp8_block_fake_quant.takes_weights(fmt, block_size, weights)
    outs = K.grouped_weight_fake_quant(weights, None, fmt, block_size)
    for i, (o, r) in enumerate(zip(outs, reference(weights, fmt, block_size), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_gpu_kernel_matches_cpu_reference(fmt, block_size):
    weights = make_experts([(300, 260), (128, 512)], torch.bfloat16, seed=5)
    outs = K.grouped_weight_fake_quant(weights, None, fmt, block_size)
    for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
        assert_bits_equal(o, fake_quant(w.cpu(), fmt, None, block_size), f"expert {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_blocks_nan_inf_zero(dtype):
    weights = make_experts([(256, 384), (130, 129)], dtype, seed=3)
    w = weights[0]
    w[0, 0], w[1, 1], w[200, 300] = float("nan"), float("inf"), float("-inf")
    w[128:256, 0:128] = 0.0
    w[130, 5] = -0.0
    w[0:128, 256:384] *= 2.0 ** -30  # a tiny block: amax <= 2**-24
    outs = K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
    for i, (o, r) in enumerate(zip(outs, reference(weights, "e4m3", (128, 128)), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@pytest.mark.parametrize("variant", sorted(fp8_block_fake_quant.BLOCK2D_VARIANTS))
def test_every_2d_block_kernel_variant_is_bit_exact(variant, monkeypatch):
    """Each launch variant made the default (one line in the module): ragged experts (table search), uniform ones with
    full blocks (no masks) and with partial blocks, edge values, bf16 and fp32 (the default variant runs every dtype
    above); then replayed from a CUDA graph, with more blocks than a persistent grid has programs."""
    monkeypatch.setattr(fp8_block_fake_quant, "BLOCK2D_DEFAULT", variant)
    cases = [(SHAPES[3], torch.bfloat16), (SHAPES[3], torch.float32), ([(384, 512)] * 32, torch.bfloat16),
             ([(200, 260)] * 5, torch.bfloat16)]
    for shapes, dtype in cases:
        weights = make_experts(shapes, dtype, seed=len(shapes))
        w = weights[0]
        w[0, 0], w[1, 1], w[130, 5] = float("nan"), float("inf"), -0.0
        w[128:200, 128:256] = 0.0
        outs = K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
        for i, (o, r) in enumerate(zip(outs, reference(weights, "e4m3", (128, 128)), strict=True)):
            assert_bits_equal(o, r, f"{variant}, {dtype}, {len(shapes)} experts, expert {i}")
    weights = make_experts([(1536, 2048)] * 8, torch.bfloat16)
    K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
    with torch.no_grad():
        for i, w in enumerate(weights):
            w.copy_(torch.randn_like(w) * (i + 1))
    graph.replay()
    torch.cuda.synchronize()
    for i, (o, r) in enumerate(zip(outs, reference(weights, "e4m3", (128, 128)), strict=True)):
        assert_bits_equal(o, r, f"{variant}, replayed expert {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "k"), [(16384, 2048), (37, 7168), (1, 300)])
def test_token_groups_bit_exact(tokens, k, dtype):
    g = torch.Generator(device=DEV).manual_seed(tokens)
    x = (torch.randn(tokens, k, generator=g, device=DEV) * 4).to(dtype)
    x[0, 0], x[-1, -1] = float("nan"), float("inf")
    m = torch.tensor([tokens // 2, 0, tokens - tokens // 2], device=DEV)
    assert_bits_equal(K.grouped_input_fake_quant(x, m, None, "e4m3", 128), fake_quant(x, "e4m3", None, 128))
    p = torch.rand(tokens, generator=g, device=DEV)
    assert_bits_equal(K.grouped_input_fake_quant_scaled(x, m, None, "e4m3", p, 128),
                      scale_rows(fake_quant(x, "e4m3", None, 128), p))


def _graph_inputs():
    weights = make_experts([(512, 1024)] * 16, torch.bfloat16)
    m = torch.tensor([100, 0, 28] + [0] * 13, device=DEV)
    x = torch.randn(128, 1024, device=DEV, dtype=torch.bfloat16)
    return weights, m, x


@pytest.mark.parametrize("warmup", [True, False])
def test_cuda_graph_capture_and_replay(warmup):
    weights, m, x = _graph_inputs()
    fp8_block_fake_quant.clear_block_tables()

    def step():
        return K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128)), K.grouped_input_fake_quant(
            x, m, None, "e4m3", 128)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if warmup:
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs, y = step()
    with torch.no_grad():  # new values in the same storage, then replay
        for i, w in enumerate(weights):
            w.copy_(torch.randn_like(w) * (i + 1))
        x.copy_(torch.randn_like(x))
    torch.cuda.synchronize()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, r) in enumerate(zip(outs, reference(weights, "e4m3", (128, 128)), strict=True)):
            assert_bits_equal(o, r, f"replayed expert {i}")
        assert_bits_equal(y, fake_quant(x, "e4m3", None, 128))


def test_torch_compile_fullgraph():
    weights, m, x = _graph_inputs()

    def fn(x, m, *ws):
        outs = K.grouped_weight_fake_quant(list(ws), None, "e4m3", (128, 128))
        y = K.grouped_input_fake_quant(x, m, None, "e4m3", 128)
        return [o * 2 for o in outs], y + 1

    got_w, got_y = torch.compile(fn, fullgraph=True)(x, m, *weights)
    for o, r in zip(got_w, reference(weights, "e4m3", (128, 128)), strict=True):
        assert_bits_equal(o, r * 2)
    assert_bits_equal(got_y, fake_quant(x, "e4m3", None, 128) + 1)


@pytest.mark.parametrize("cached", [True, False])
def test_no_host_sync(cached):
    weights, m, x = _graph_inputs()
    fp8_block_fake_quant.clear_block_tables()
    if cached:
        K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = K.grouped_weight_fake_quant(weights, None, "e4m3", (128, 128))
        y = K.grouped_input_fake_quant(x, m, None, "e4m3", 128)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_bits_equal(outs[5], fake_quant(weights[5], "e4m3", None, (128, 128)))
    assert y.shape == x.shape
