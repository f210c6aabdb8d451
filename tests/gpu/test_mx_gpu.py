"""MXFP4 and MXFP8 kernels natively on CUDA: bit-exact against the reference ``numerics.mx`` per expert (on the GPU
and on the CPU), tokens and the scaled down-projection operand, edge values; and the reference against NVIDIA Model
Optimizer 0.47's own MX fake quant (its CUDA extension), where Model Optimizer is importable.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_mx_gpu.py``. TRITON_INTERPRET must not be set.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_kernel_checks import _compiled_triton, assert_bits_equal  # noqa: E402, F401  (autouse)

from modelopt_moe import kernels as K  # noqa: E402
from modelopt_moe.numerics import fake_quant, scale_rows  # noqa: E402

MX = ["mxfp4", "mxfp8"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEV = "cuda"
# Model Optimizer's element formats of the MX presets (num_bits).
MODELOPT_NUM_BITS = {"mxfp4": (2, 1), "mxfp8": (4, 3)}


def make_experts(shapes, dtype, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    # Expert magnitudes 2**(i % 13 - 6): distinct among neighbours, in range for every dtype.
    return [(torch.randn(s, generator=g, device=device) * 2.0 ** (i % 13 - 6)).to(dtype) for i, s in enumerate(shapes)]


# Realistic expert shapes (rows x K) per N; (96, 1000) and (64, 4100): partial last blocks (zero-padded).
SHAPES = {1: [(1536, 2048)], 3: [(768, 1024), (96, 1000), (512, 1024)], 32: [(384, 512)] * 32,
          4: [(64, 4100)] * 4}


@pytest.mark.parametrize("n", sorted(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_weights_bit_exact_per_expert(fmt, dtype, n):
    weights = make_experts(SHAPES[n], dtype, seed=n)
    outs = K.grouped_weight_fake_quant(weights, None, fmt)
    for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
        assert_bits_equal(o, fake_quant(w, fmt), f"expert {i}")


@pytest.mark.parametrize("fmt", MX)
def test_gpu_kernel_matches_cpu_reference_with_edge_values(fmt):
    """One contract across devices, edges included: NaN, +-Inf, an all-zero and an all-NaN block, -0.0."""
    weights = make_experts([(96, 256), (32, 256), (64, 200)], torch.bfloat16)
    w = weights[0]
    w[3, 5] = float("nan")
    w[7, 200], w[9, 17] = float("inf"), -float("inf")
    w[11, :32] = 0.0
    w[11, 3] = -0.0
    w[12, 32:64] = float("nan")
    outs = K.grouped_weight_fake_quant(weights, None, fmt)
    for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
        assert_bits_equal(o, fake_quant(w.cpu(), fmt), f"expert {i}")
        assert_bits_equal(o, fake_quant(w, fmt), f"expert {i} (reference on the GPU)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_input_and_scaled_input_per_expert(fmt, dtype):
    g = torch.Generator(device=DEV).manual_seed(11)
    n = 32
    m = torch.randint(0, 64, (n,), generator=g, device=DEV)
    m[0] = 0
    t = int(m.sum())
    x = (torch.randn(t, 1000, generator=g, device=DEV) * 3).to(dtype)  # 1000: a partial last block
    p = torch.rand(t, generator=g, device=DEV)
    splits = m.tolist()
    y = K.grouped_input_fake_quant(x, m, None, fmt)
    ys = K.grouped_input_fake_quant_scaled(x, m, None, fmt, p)
    for where in (DEV, "cpu"):
        ref = torch.cat([fake_quant(c, fmt) for c in x.to(where).split(splits)])
        assert_bits_equal(y, ref, f"reference on {where}")
        assert_bits_equal(ys, scale_rows(ref, p.to(where)), f"scaled, reference on {where}")


@pytest.mark.parametrize("fmt", MX)
def test_straight_through_backward_passes_the_gradients(fmt):
    weights = [w.requires_grad_() for w in make_experts([(256, 512)] * 8, torch.bfloat16)]
    outs = K.grouped_weight_fake_quant_ste(weights, None, fmt, ste="clipped")  # no amax: nothing clips
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    for i, (w, g) in enumerate(zip(weights, grads, strict=True)):
        assert_bits_equal(w.grad, g, f"expert {i}")


@pytest.mark.parametrize("fmt", MX)
def test_cuda_graph_capture_and_replay(fmt):
    weights = make_experts([(512, 1000)] * 16, torch.bfloat16)  # 1000: a partial last block
    m = torch.tensor([100, 0, 28] + [0] * 13, device=DEV)
    x = torch.randn(128, 1000, device=DEV, dtype=torch.bfloat16)

    def step():
        return K.grouped_weight_fake_quant(weights, None, fmt), K.grouped_input_fake_quant(x, m, None, fmt)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
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
    graph.replay()
    torch.cuda.synchronize()
    for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
        assert_bits_equal(o, fake_quant(w, fmt), f"replayed expert {i}")
    assert_bits_equal(y, fake_quant(x, fmt))


def _modelopt_mx_quantizer(fmt):
    """Model Optimizer's own TensorQuantizer for its MX preset's attributes (skips where it is not importable)."""
    mo = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.nn import TensorQuantizer

    cfg = mo.config.QuantizerAttributeConfig(
        num_bits=MODELOPT_NUM_BITS[fmt], block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)})
    return TensorQuantizer(cfg).to(DEV)


@pytest.mark.parametrize("fmt", MX)
def test_reference_and_kernel_equal_model_optimizers_cuda_mx_fake_quant(fmt):
    """Model Optimizer 0.47's MX fake quant (its CUDA extension, built with fast math) and ours give the same values,
    fp32 data of spread magnitudes, a partial last block, an Inf and an all-zero block. Compared as values (its sign
    of a zero is unset) and away from NaN (its MXFP4 leaves a NaN's result undefined) and from block maxima whose
    quotient by the element max lies within an ulp or two of a power of two (its fast-math division)."""
    theirs_q = _modelopt_mx_quantizer(fmt)
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(64, 1000, generator=g, device=DEV) * torch.logspace(-6, 6, 64, device=DEV).unsqueeze(-1)
    x[1, 40] = float("inf")
    x[2, -8] = -float("inf")  # in the partial last block
    x[3, :32] = 0.0
    with torch.no_grad():
        theirs = theirs_q(x)
    ours = fake_quant(x, fmt)
    assert torch.equal(ours, theirs), (ours != theirs).sum().item()
    assert torch.equal(K.grouped_weight_fake_quant([x], None, fmt)[0], theirs)
