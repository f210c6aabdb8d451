"""The distillation KL on its Triton kernels (kernels/kl_divergence.py), in the Triton interpreter (conftest.py sets
TRITON_INTERPRET=1), against the torch reference path of the same public call (``logits_kl_loss(...,
kernel="torch")``); the same check runs natively on CUDA in tests/gpu/test_kl_kernel_gpu.py.

Tolerances (the kernels do each element's arithmetic as the reference does, but sum in another order): the loss to
``rtol=1e-6, atol=1e-6`` (its terms, ``log Z`` of a few units, round to about 1e-7 in fp32); the gradient to
``atol=1e-6 * max |grad|`` (each ``p = exp(s) / Z`` differs by the rounding of ``Z``), plus one bf16 / fp16 ulp
(``rtol=2**-7``) where the gradient is rounded to those.
"""

import sys
import warnings

import pytest
import torch

from modelopt_moe.distill import logits_kl_loss
from modelopt_moe.kernels import kernels_available
from modelopt_moe.launch import spawn

pytestmark = pytest.mark.skipif(not kernels_available("cpu"),
                                reason="Triton interpreter not active (needs triton and TRITON_INTERPRET=1)")


def _logits(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype), (torch.randn(shape, generator=g) * scale).to(dtype)


def _both(s, t, **kw):
    """(loss, student gradient) on the kernels and on the torch reference, for one random incoming gradient."""
    out = []
    for kernel in ("triton", "torch"):
        x = s.clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy in the interpreter: -inf - -inf outside the top k
            loss = logits_kl_loss(x, t, kernel=kernel, **kw)
            loss.backward(torch.randn(loss.shape, generator=torch.Generator().manual_seed(9)))
        out.append((loss.detach(), x.grad))
    return out


def _assert_close(got, want):
    (loss, grad), (ref_loss, ref_grad) = got, want
    assert (loss.dtype, loss.shape) == (torch.float32, ref_loss.shape)
    assert (grad.dtype, grad.shape, grad.is_contiguous()) == (ref_grad.dtype, ref_grad.shape, True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, equal_nan=True)
    finite = ref_grad.float()[ref_grad.float().isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    rtol = 0.0 if grad.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=1e-6 * scale, equal_nan=True)


# A vocabulary of 1000 is no multiple of the kernels' block (1024 columns, 4 rows a program); 5000 takes two blocks
# of 4096 columns, one row a program.
@pytest.mark.parametrize("shape", [(3, 5, 1000), (3, 5000)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_kernel_kl_and_gradient_equal_the_torch_reference(shape, dtype, temperature):
    s, t = _logits(shape, dtype)
    got, want = _both(s, t, temperature=temperature)
    _assert_close(got, want)
    assert "modelopt_moe.kernels.kl_divergence_kernels" in sys.modules  # the kernels ran, not the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_top_k_kl_equals_the_torch_reference(dtype):
    """The top-k KL on the kernels (the threshold mask): ties with the k-th logit kept, and a teacher that is -inf
    outside its stored top tokens (stored teacher logits), as on the reference."""
    s, t = _logits((4, 3, 700), dtype, seed=2)
    t[0, 0, :40] = t[0, 0].max()  # 40 tokens tied at the top of one row, more than k
    t[1, 1, 30:] = -float("inf")  # what StoredTeacherLogits gives outside the stored ids
    for k in (1, 17, 30):
        _assert_close(*_both(s, t, temperature=1.5, top_k=k))
    _assert_close(*_both(s[:1], t[:1], temperature=1.5, top_k=700))  # every token: the exact KL


def test_kernel_kl_with_infinite_and_very_negative_logits_equals_the_torch_reference():
    """-inf and -3e38 logits give the reference's values: 0 probability where finite, Inf where the student gives a
    teacher token probability 0, a finite KL where the teacher gives a token probability 0 (its -inf counts 0)."""
    s, t = _logits((6, 300), torch.float32, seed=4)
    s[0, :10] = -float("inf")  # the student rules out tokens the teacher likes: KL = +inf
    s[1, :] = -3e38  # every logit hugely negative: the max subtraction keeps it finite
    t[1, :] = -3e38
    s[2, 5:] = -1e30  # one token carries the student's mass
    t[3, 0] = -float("inf")  # a teacher probability of 0: counts 0
    s[4, 7] = t[4, 7] = -float("inf")
    got, want = _both(s, t, temperature=2.0)
    _assert_close(got, want)
    assert want[0][0].isinf()
    assert want[0][[1, 2, 3, 4, 5]].isfinite().all()


def _minus_inf_logits(dtype, seed=12, shape=(8, 700)):
    """Logits with -inf where teachers and students have them in practice, one case a token (row 7: finite)."""
    s, t = _logits(shape, torch.float32, seed=seed)
    inf = float("inf")
    t[0, 600:] = -inf  # vocabulary padding masked out (the last TP rank's slice, at TP = 2)
    t[1, 3:] = -inf  # a truncated (top-3) teacher
    t[2, :50] = s[2, :50] = -inf  # both rule the same tokens out
    t[3, int(s[3].argmax())] = -inf  # the teacher rules out the student's favourite
    s[4, int(t[4].argmax())] = -inf  # the student rules out the teacher's favourite: KL = +inf
    t[5, 1:] = -inf  # one token carries the teacher's whole mass
    t[6, :] = -inf  # no teacher distribution: NaN
    return s.to(dtype), t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_kernel_kl_of_a_teacher_with_minus_inf_logits_equals_the_torch_reference(dtype, temperature):
    """A teacher -inf counts as a probability of 0 on the kernels as on the reference (loss and gradient, no NaN),
    exact, top-k and top-p; a student -inf under a teacher probability gives +inf; a teacher row all -inf NaN."""
    s, t = _minus_inf_logits(dtype)
    got, want = _both(s, t, temperature=temperature)
    _assert_close(got, want)
    assert [x.isinf().item() for x in want[0]] == [False] * 4 + [True] + [False] * 3
    assert [x.isnan().item() for x in want[0]] == [False] * 6 + [True, False]
    assert got[1][[0, 1, 2, 3, 4, 5, 7]].isfinite().all()
    for kw in ({"top_k": 3}, {"top_k": 20}, {"top_p": 0.9}):
        got, want = _both(s, t, temperature=temperature, **kw)
        _assert_close(got, want)
        assert want[0][4] == float("inf")  # the teacher's favourite is in every top k and nucleus
        assert got[1][[0, 1, 2, 3, 4, 5, 7]].isfinite().all()


def test_kernel_takes_rows_with_a_stride_and_refuses_a_strided_vocabulary():
    """A slice of the vocabulary (rows strided in memory, as one TP rank's view of gathered logits) runs on the
    kernels without a copy; logits strided along the vocabulary are refused by name with ``kernel="triton"``, and
    ``kernel`` takes auto | triton | torch alone."""
    s, t = _logits((4, 256), torch.bfloat16, seed=5)
    base = s.clone().requires_grad_(True)
    loss = logits_kl_loss(base[:, 10:210], t[:, 30:230], kernel="triton")  # rows 256 elements apart, both
    loss.sum().backward()
    ref = s[:, 10:210].contiguous().requires_grad_(True)
    ref_loss = logits_kl_loss(ref, t[:, 30:230].contiguous(), kernel="torch")
    ref_loss.sum().backward()
    _assert_close((loss.detach(), base.grad[:, 10:210].contiguous()), (ref_loss.detach(), ref.grad))
    assert not base.grad[:, :10].any()
    assert not base.grad[:, 210:].any()
    with pytest.raises(ValueError, match=r"student logits of shape \(4, 128\) have stride \(1, 4\)"):
        logits_kl_loss(s.t().contiguous().t()[:, :128], t[:, :128], kernel="triton")
    with pytest.raises(ValueError, match="kernel must be one of"):
        logits_kl_loss(s, t, kernel="cuda")


def test_custom_ops_trace_with_fake_tensors():
    """The two ops have fake implementations (shapes and dtypes without running): torch.compile can trace them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from modelopt_moe.kernels.kl_divergence import softmax_kl_grad, softmax_kl_sums

    with FakeTensorMode():
        s, t = torch.empty(5, 77, dtype=torch.bfloat16), torch.empty(5, 77, dtype=torch.bfloat16)
        maxima, scale = torch.empty(2, 5), torch.empty(5)
        sums = softmax_kl_sums(s, t, maxima, 1.0, None, chunk_rows=5, triton=True)
        grad = softmax_kl_grad(s, t, maxima, sums, scale, 1.0, t[:, 0], chunk_rows=5, triton=True)
    assert (tuple(sums.shape), sums.dtype) == ((3, 5), torch.float32)
    assert (tuple(grad.shape), grad.dtype) == ((5, 77), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_top_p_kl_equals_the_torch_reference(dtype):
    """The top-p KL on the kernels: the nucleus is the same threshold mask as top-k's, so ties at its edge, a teacher
    -inf outside some tokens and a nucleus of one token give the reference's loss and gradient."""
    s, t = _logits((4, 3, 700), dtype, seed=3)
    t[0, 0, :40] = t[0, 0].max()  # 40 tokens tied at the top of one row
    t[1, 1, 30:] = -float("inf")
    for p in (1e-6, 0.5, 0.95):
        _assert_close(*_both(s, t, temperature=1.5, top_p=p))


def _vocab_parallel_kernel_kl(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    s, t = _logits((2, 7, 1000), torch.bfloat16, seed=6)
    t[1, 2, :5] = t[1, 2].max()  # ties at the top
    shard = slice(rank * 1000 // world_size, (rank + 1) * 1000 // world_size)
    out = {}
    for name, kw in (("exact", {}), ("top_k", {"top_k": 20}), ("top_p", {"top_p": 0.9})):
        part = s[..., shard].clone().requires_grad_(True)
        whole = s.clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            kl_part = logits_kl_loss(part, t[..., shard], temperature=1.5, tp_group=group, kernel="triton", **kw)
            kl_whole = logits_kl_loss(whole, t, temperature=1.5, kernel="torch", **kw)
            g = torch.randn(kl_part.shape, generator=torch.Generator().manual_seed(8))
            kl_part.backward(g)
            kl_whole.backward(g)
        out[name] = ((kl_part.detach(), part.grad), (kl_whole.detach(), whole.grad[..., shard].contiguous()))
    return out


def test_kernel_kl_is_vocab_parallel_at_tp2():
    """At TP=2 (2 gloo ranks, each with its half of a 1000-token vocabulary, on the kernels): every rank's loss is the
    gathered logits' loss on the torch reference, and its gradient is its slice of the whole gradient; with the top
    k and the top p too (the teacher's global top k or nucleus, whatever shard holds it)."""
    outs = spawn(_vocab_parallel_kernel_kl, 2, timeout=120)
    for rank_out in outs:
        assert list(rank_out) == ["exact", "top_k", "top_p"]
        for got, want in rank_out.values():
            _assert_close(got, want)
    assert not torch.allclose(outs[0]["top_p"][0][0], outs[0]["exact"][0][0])


def _vocab_parallel_minus_inf_kl(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    s, t = _minus_inf_logits(torch.bfloat16, seed=13)
    t[2, 350:] = -float("inf")  # rank 1's whole slice of one token: the other rank's carries its distribution
    shard = slice(rank * 700 // world_size, (rank + 1) * 700 // world_size)
    out = {}
    for kernel in ("triton", "torch"):
        for name, kw in (("exact", {}), ("top_k", {"top_k": 3}), ("top_p", {"top_p": 0.8})):
            part = s[..., shard].clone().requires_grad_(True)
            whole = s.clone().requires_grad_(True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                kl_part = logits_kl_loss(part, t[..., shard], temperature=1.5, tp_group=group, kernel=kernel, **kw)
                kl_whole = logits_kl_loss(whole, t, temperature=1.5, kernel="torch", **kw)
                g = torch.randn(kl_part.shape, generator=torch.Generator().manual_seed(8))
                kl_part.backward(g)
                kl_whole.backward(g)
            out[kernel, name] = ((kl_part.detach(), part.grad),
                                 (kl_whole.detach(), whole.grad[..., shard].contiguous()))
    return out


def test_kernel_kl_of_minus_inf_teacher_logits_is_vocab_parallel_at_tp2():
    """At TP = 2 with -inf teacher logits (a rank's whole slice of a token among them, as vocabulary padding makes
    them): on the kernels and on the torch path, every rank's loss is the gathered logits' and its gradient its
    slice of the whole gradient, exact, top-k and top-p; no NaN but the token whose teacher logits are all -inf."""
    for rank_out in spawn(_vocab_parallel_minus_inf_kl, 2, timeout=120):
        for (loss, grad), want in rank_out.values():
            _assert_close((loss, grad), want)
            assert loss.isnan().tolist() == [False] * 6 + [True, False]
            assert grad[[0, 1, 2, 3, 4, 5, 7]].isfinite().all()


def test_kernel_kl_saves_the_logits_alone_for_its_backward():
    """On the kernels as on the reference: what the backward keeps of size tokens x vocab is the two inputs."""
    s, t = _logits((4, 9, 128), torch.bfloat16, seed=7)
    s.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        loss = logits_kl_loss(s, t, temperature=2.0, kernel="triton")
    big = [x for x in saved if x.numel() >= s.numel()]
    assert [x.dtype for x in big] == [torch.bfloat16] * 2, [(x.dtype, x.shape) for x in saved]
    assert {x.data_ptr() for x in big} == {s.data_ptr(), t.data_ptr()}
    loss.sum().backward()
    assert s.grad.dtype == torch.bfloat16


def test_auto_takes_the_torch_reference_on_cpu():
    """``kernel="auto"`` (the default) runs the kernels on CUDA only: on CPU, even under the interpreter, the torch
    reference's bits."""
    s, t = _logits((3, 400), torch.bfloat16, seed=8)
    assert torch.equal(logits_kl_loss(s, t, temperature=1.3), logits_kl_loss(s, t, temperature=1.3, kernel="torch"))


def test_torch_compile_fullgraph_traces_the_kernel_kl():
    """``torch.compile(fullgraph=True)`` traces the loss on the kernels (the custom ops, forward and backward) with
    the eager call's bits."""
    s, t = _logits((4, 300), torch.bfloat16, seed=10)
    a, b = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    compiled = torch.compile(lambda x, y: logits_kl_loss(x, y, temperature=1.5, kernel="triton"), fullgraph=True,
                             backend="eager")
    got = compiled(a, t)
    want = logits_kl_loss(b, t, temperature=1.5, kernel="triton")
    got.sum().backward()
    want.sum().backward()
    assert torch.equal(got, want)
    assert torch.equal(a.grad, b.grad)
