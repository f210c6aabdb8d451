"""The distillation KL's Triton kernels natively on CUDA at a realistic shape (2,048 tokens x Qwen3's 151,936
vocabulary, bf16 logits): loss and gradient equal the torch reference path's (``logits_kl_loss(..., kernel="torch")``),
``kernel="auto"`` takes the kernels on CUDA, the peak memory above the logits and their gradient stays under a quarter
of one logits tensor, and forward + backward take less time than the whole-tensor KL's.

Tolerances: on the GPU Triton's fp32 ``exp`` is the hardware approximation (``ex2.approx`` of ``x * log2(e)``, a few
ulp; torch's is correctly rounded to about 1 ulp) and the sums run in another order, so the loss is compared to
``rtol=atol=1e-5`` and the gradient to ``1e-5 * max |grad|`` plus one bf16 ulp (``rtol=2**-7``). The interpreter tests
(tests/unit/kernels/test_kl_divergence.py) hold the kernels to 1e-6.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_kl_kernel_gpu.py``. TRITON_INTERPRET must not be set.
"""

import statistics
import sys
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_kernel_checks import _compiled_triton  # noqa: E402, F401  (autouse)

from modelopt_moe.distill import logits_kl_loss  # noqa: E402
from modelopt_moe.distill.losses import whole_tensor_kl  # noqa: E402

TOKENS, VOCAB = 2048, 151936


@pytest.fixture(scope="module")
def logits():
    g = torch.Generator(device="cuda").manual_seed(0)
    s = (torch.randn(TOKENS, VOCAB, generator=g, device="cuda") * 3).bfloat16()
    t = (torch.randn(TOKENS, VOCAB, generator=g, device="cuda") * 3).bfloat16()
    return s, t


def _run(s, t, **kw):
    x = s.clone().requires_grad_(True)
    loss = logits_kl_loss(x, t, **kw)
    loss.backward(torch.linspace(0.5, 1.5, loss.numel(), device="cuda").reshape(loss.shape))
    return loss.detach(), x.grad


def _assert_close(got, want):
    (loss, grad), (ref_loss, ref_grad) = got, want
    assert (grad.dtype, grad.shape) == (ref_grad.dtype, ref_grad.shape)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    scale = ref_grad.float().abs().max().item()
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2**-7, atol=1e-5 * scale)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kernel_kl_equals_the_torch_reference_at_qwen3_vocabulary(logits, temperature):
    s, t = logits
    got = _run(s, t, temperature=temperature, kernel="triton")
    _assert_close(got, _run(s, t, temperature=temperature, kernel="torch"))
    auto = _run(s, t, temperature=temperature)  # the default on CUDA: the kernels, the same launch
    assert torch.equal(auto[0], got[0])
    assert torch.equal(auto[1], got[1])
    assert "modelopt_moe.kernels.kl_divergence_kernels" in sys.modules


def test_kernel_top_k_kl_equals_the_torch_reference(logits):
    s, t = logits
    s, t = s[:256], t[:256]
    _assert_close(_run(s, t, top_k=4096, temperature=1.5, kernel="triton"),
                  _run(s, t, top_k=4096, temperature=1.5, kernel="torch"))


def test_kernel_top_p_kl_equals_the_torch_reference(logits):
    s, t = logits
    s, t = s[:256], t[:256]
    _assert_close(_run(s, t, top_p=0.9, temperature=1.5, kernel="triton"),
                  _run(s, t, top_p=0.9, temperature=1.5, kernel="torch"))


def test_kernel_kl_of_minus_inf_logits_equals_the_torch_reference(logits):
    """A teacher -inf (vocabulary padding, a truncated teacher) counts as a probability of 0, a student -inf under a
    teacher probability gives +inf, on the hardware ``exp`` as on the reference; exact, top-k and top-p."""
    s, t = logits[0][:64].clone(), logits[1][:64].clone()
    t[:, VOCAB - 2000:] = -float("inf")
    t[1::4, 100:] = -float("inf")
    s[2::4, :50] = t[2::4, :50] = -float("inf")
    s[3::4, t[3::4].argmax(-1)] = -float("inf")
    for kw in ({}, {"top_k": 100}, {"top_p": 0.9}):
        got = _run(s, t, temperature=1.5, kernel="triton", **kw)
        _assert_close(got, _run(s, t, temperature=1.5, kernel="torch", **kw))
        assert got[0][3::4].isinf().all()
        assert got[0][0::4].isfinite().all()
        assert got[1].isfinite().all()


def _step(fn, s, t):
    s.grad = None
    fn(s, t).sum().backward()


def _peak_above_inputs(fn, s, t) -> int:
    """Bytes allocated at the peak of forward + backward above the two logits and the gradient."""
    _step(fn, s, t)
    s.grad = None
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(fn, s, t)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    s.grad = None
    return peak - s.numel() * s.element_size()


def test_kernel_kl_peak_memory_above_logits_and_gradient_is_under_a_quarter_of_one_logits_tensor(logits):
    s, t = logits[0].clone().requires_grad_(True), logits[1]
    one = s.numel() * s.element_size()
    kernel = _peak_above_inputs(lambda a, b: logits_kl_loss(a, b, kernel="triton"), s, t)
    torch_ref = _peak_above_inputs(lambda a, b: logits_kl_loss(a, b, kernel="torch"), s, t)
    assert kernel <= 0.25 * one, (kernel / one, torch_ref / one)
    assert torch_ref <= 0.25 * one, (kernel / one, torch_ref / one)


def test_kernel_kl_is_faster_than_the_whole_tensor_kl(logits):
    """Forward + backward, median of 5 alternating rounds after a warm-up: the kernels beat the whole-tensor KL (and
    the torch reference chunked over tokens)."""
    s, t = logits[0].clone().requires_grad_(True), logits[1]
    impls = {"kernel": lambda a, b: logits_kl_loss(a, b, kernel="triton"),
             "torch": lambda a, b: logits_kl_loss(a, b, kernel="torch"), "whole": whole_tensor_kl}
    times = {name: [] for name in impls}
    for fn in impls.values():  # warm-up: Triton compiles, the allocator settles
        _step(fn, s, t)
    for _ in range(5):
        for name, fn in impls.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(fn, s, t)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    assert ms["kernel"] < ms["whole"], ms
    assert ms["kernel"] < ms["torch"], ms
