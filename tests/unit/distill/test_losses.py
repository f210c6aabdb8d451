"""Distillation losses against torch's own softmax losses, and the teacher/student wrapper's contract: gradients and
parameters are the student's only."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import modelopt_moe.quantization as mtq
from modelopt_moe.distill import DistillationModel, logits_kl_loss, vocab_parallel_cross_entropy
from modelopt_moe.distill.losses import whole_tensor_kl
from modelopt_moe.quantization.conversion import unwrap_model


def _logits(seed=0, shape=(3, 5, 64), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype), (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kl_matches_torch_and_its_gradient(temperature, dtype):
    s, t = _logits(dtype=dtype)
    s1 = s.clone().requires_grad_(True)
    got = logits_kl_loss(s1, t, temperature=temperature)
    s2 = s.float().clone().requires_grad_(True)
    want = F.kl_div(F.log_softmax(s2 / temperature, -1), F.log_softmax(t.float() / temperature, -1),
                    log_target=True, reduction="none").sum(-1) * temperature**2
    assert got.dtype == torch.float32
    assert got.shape == s.shape[:-1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn(got.shape)
    got.backward(g)
    want.backward(g)
    assert s1.grad.dtype == dtype
    torch.testing.assert_close(s1.grad.float(), s2.grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_kl_of_equal_logits_is_zero_and_teacher_gets_no_gradient():
    s, _ = _logits()
    t = s.clone().requires_grad_(True)
    loss = logits_kl_loss(s.clone().requires_grad_(True), t)
    assert loss.abs().max() < 1e-5
    loss.sum().backward()
    assert t.grad is None


@pytest.mark.parametrize(("shape", "chunk_tokens"), [((3, 5, 64), None), ((3, 5, 64), 2), ((7, 1000), 3),
                                                     ((40, 120_000), None)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_chunked_kl_equals_the_whole_tensor_kl_and_its_gradient(shape, chunk_tokens, dtype, temperature):
    """Chunked over tokens (explicitly, or by default above 2**22 elements) or not, the loss and the gradient are the
    whole-tensor formula's; one chunk (small inputs) gives them bit for bit."""
    s, t = _logits(seed=3, shape=shape, dtype=dtype)
    a, b = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    got = logits_kl_loss(a, t, temperature=temperature, chunk_tokens=chunk_tokens)
    want = whole_tensor_kl(b, t, temperature)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    got.backward(g)
    want.backward(g)
    assert a.grad.dtype == dtype
    if chunk_tokens is None and s.numel() <= 1 << 22:
        assert torch.equal(got, want)
        assert torch.equal(a.grad, b.grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6 if dtype == torch.float32 else 2**-8, atol=1e-9)


def test_kl_saves_the_logits_alone_for_its_backward():
    """No fp32 copy of the logits, no softmax: what the backward keeps of size tokens x vocab is the two inputs."""
    s, t = _logits(shape=(4, 9, 128), dtype=torch.bfloat16)
    s.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        loss = logits_kl_loss(s, t, temperature=2.0)
    big = [x for x in saved if x.numel() >= s.numel()]
    assert [x.dtype for x in big] == [torch.bfloat16] * 2, [(x.dtype, x.shape) for x in saved]
    assert {x.data_ptr() for x in big} == {s.data_ptr(), t.data_ptr()}
    assert sum(x.numel() for x in saved if x.numel() < s.numel()) <= 4 * 36  # per-token maxima and sums
    loss.sum().backward()


def _top_k_kl(s, t, k, temperature):
    """Top-k KD written with torch's softmaxes: both distributions on the teacher's k most likely tokens alone."""
    idx = t.topk(k, dim=-1).indices
    log_q = torch.log_softmax(t.gather(-1, idx) / temperature, -1)
    log_p = torch.log_softmax(s.gather(-1, idx) / temperature, -1)
    return (log_q.exp() * (log_q - log_p)).sum(-1) * temperature**2


def test_top_k_kl_is_the_kl_on_the_teachers_top_k_and_never_the_default():
    s, t = _logits(seed=5, shape=(6, 7, 200))
    a, b = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    got = logits_kl_loss(a, t, temperature=1.5, top_k=10, chunk_tokens=4)
    want = _top_k_kl(b, t, 10, 1.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    exact = logits_kl_loss(s, t, temperature=1.5)
    assert torch.equal(logits_kl_loss(s, t, temperature=1.5, top_k=200), exact)  # all tokens: the exact KL
    assert not torch.allclose(got, exact)
    student, teacher = _TinyLM(0), _TinyLM(1)
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = logits_kl_loss(student(tokens), teacher(tokens), top_k=5)
        assert torch.equal(DistillationModel(student, teacher, top_k=5)(tokens), want)
    with pytest.raises(ValueError, match="top_k must be a positive integer or None, got 0"):
        DistillationModel(student, teacher, top_k=0)


def _infinite_logits(dtype=torch.float32):
    """Logits with -inf where teachers and students have them in practice, one case a token."""
    s, t = _logits(seed=11, shape=(8, 50), dtype=dtype)
    inf = float("inf")
    t[0, 40:] = -inf  # vocabulary padding masked out
    t[1, 3:] = -inf  # a truncated (top-3) teacher
    t[2, :5] = s[2, :5] = -inf  # both rule the same tokens out
    t[3, int(s[3].argmax())] = -inf  # the teacher rules out the student's favourite
    s[4, int(t[4].argmax())] = -inf  # the student rules out the teacher's favourite: KL = +inf
    t[5, 1:] = -inf  # one token carries the teacher's whole mass: KL = -log p_s of it
    t[6, :] = -inf  # no teacher distribution at all: NaN, documented
    return s, t  # row 7: finite


def _kl_of_probabilities(s, t, temperature):
    """KL(p_t || p_s) summed where p_t > 0 alone (0 * log 0 = 0), from torch's log-softmaxes; and the gradient's
    ``T (p_s - p_t)``."""
    log_pt, log_ps = torch.log_softmax(t.float() / temperature, -1), torch.log_softmax(s.float() / temperature, -1)
    pt = log_pt.exp()
    kl = torch.where(pt > 0, pt * (log_pt - log_ps), 0.0).sum(-1) * temperature**2
    kl[t.float().isneginf().all(-1)] = float("nan")
    return kl, (log_ps.exp() - pt) * temperature


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_a_teacher_logit_of_minus_inf_is_a_probability_of_zero(dtype, temperature):
    """A teacher logit of -inf (masked vocabulary padding, a truncated teacher) contributes 0 to the loss and to the
    gradient, whatever the student's logit; a student -inf where the teacher's probability is not 0 gives +inf with a
    finite gradient; a token whose teacher logits are all -inf gives NaN. Chunked or not, and on the whole-tensor
    formula alike."""
    s, t = _infinite_logits(dtype)
    want, want_grad = _kl_of_probabilities(s, t, temperature)
    results = []
    for run in (lambda x: logits_kl_loss(x, t, temperature=temperature),
                lambda x: logits_kl_loss(x, t, temperature=temperature, chunk_tokens=3),
                lambda x: whole_tensor_kl(x, t, temperature)):
        x = s.clone().requires_grad_(True)
        loss = run(x)
        loss.backward(torch.ones_like(loss))
        results.append((loss.detach(), x.grad))
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert loss.isinf().tolist() == [False] * 4 + [True] + [False] * 3
        assert loss.isnan().tolist() == [False] * 6 + [True, False]
        valid = [0, 1, 2, 3, 4, 5, 7]
        torch.testing.assert_close(x.grad[valid].float(), want_grad[valid], rtol=1e-2 if dtype == torch.bfloat16
                                   else 1e-5, atol=1e-6)
        assert x.grad[valid][t[valid].isneginf() & s[valid].isneginf()].eq(0).all()
        assert x.grad[6].isnan().all()
    one_chunk, chunked, whole = results
    torch.testing.assert_close(one_chunk, whole, rtol=0, atol=0, equal_nan=True)  # one chunk: bit for bit
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_top_k_kl_takes_minus_inf_logits_as_the_exact_kl_does():
    """The top-k KL (and the stored top-k teacher logits, -inf outside the stored ids): a student -inf inside the
    teacher's top k gives +inf (not a large finite number), a teacher with fewer than k finite logits (its -inf tied
    with the k-th, kept) gives the KL of its probabilities, and no NaN comes of a -inf."""
    s, t = _infinite_logits()
    s[4] = _logits(seed=12, shape=(50,))[0]
    s[4, int(t[4].topk(2).indices[1])] = -float("inf")  # the teacher's second most likely token
    got = logits_kl_loss(s, t, temperature=1.5, top_k=3)
    assert got[4] == float("inf")
    rows = [0, 1, 2, 3, 7]  # at least k finite teacher logits: the top-k KL
    torch.testing.assert_close(got[rows], _top_k_kl(s[rows], t[rows], 3, 1.5))
    # One finite teacher logit: every -inf ties with the k-th and is kept, the exact KL of the probabilities.
    torch.testing.assert_close(got[5], _kl_of_probabilities(s[5], t[5], 1.5)[0])
    x = s.clone().requires_grad_(True)
    logits_kl_loss(x, t, temperature=1.5, top_k=3).backward(torch.ones(8))
    assert x.grad[[0, 1, 2, 3, 4, 5, 7]].isfinite().all()


def test_cross_entropy_matches_torch():
    s, _ = _logits()
    labels = torch.randint(0, 64, s.shape[:-1], generator=torch.Generator().manual_seed(2))
    a = s.clone().requires_grad_(True)
    b = s.clone().requires_grad_(True)
    got = vocab_parallel_cross_entropy(a, labels)
    want = F.cross_entropy(b.reshape(-1, 64), labels.reshape(-1), reduction="none").reshape(labels.shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: logits_kl_loss(torch.zeros(2, 4), torch.zeros(2, 5)), "shape"),
    (lambda: logits_kl_loss(torch.zeros(2, 4), torch.zeros(2, 4), temperature=0.0), "temperature"),
    (lambda: logits_kl_loss(torch.zeros(2, 4), torch.zeros(2, 4), top_k=0), "top_k must be a positive integer"),
    (lambda: logits_kl_loss(torch.zeros(2, 4), torch.zeros(2, 4), chunk_tokens=1.5), "chunk_tokens must be"),
    (lambda: vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long)), "labels"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


class _TinyLM(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 32)
        self.config = {"name": f"lm{seed}"}

    def forward(self, tokens):
        return self.proj(self.emb(tokens))


def test_distillation_model_trains_the_student_only():
    student, teacher = _TinyLM(0), _TinyLM(1)
    model = DistillationModel(student, teacher, temperature=2.0, lm_loss_weight=0.5)
    tokens = torch.randint(0, 32, (2, 6))
    labels = torch.randint(0, 32, (2, 6))
    assert {id(p) for p in model.parameters()} == {id(p) for p in student.parameters()}
    assert all(k.startswith("module.") for k in model.state_dict())
    assert model.config == student.config
    assert unwrap_model(model) is student
    model.train()
    assert not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    loss = model(tokens, labels=labels)
    with torch.no_grad():
        s, t = student(tokens), teacher(tokens)
    want = logits_kl_loss(s, t, temperature=2.0) + 0.5 * vocab_parallel_cross_entropy(s, labels)
    torch.testing.assert_close(loss, want)
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert torch.equal(model(tokens), logits_kl_loss(student(tokens), teacher(tokens), temperature=2.0))
    model.bfloat16()  # a Float16Module-style cast reaches the student only
    assert student.proj.weight.dtype == torch.bfloat16
    assert teacher.proj.weight.dtype == torch.float32
    clone = copy.deepcopy(model)
    assert clone.teacher is not teacher
    assert isinstance(pickle.loads(pickle.dumps(model)), DistillationModel)


def test_quantized_student_distils_from_its_own_bf16_copy():
    """The QAD setup: the student is the quantized copy of the teacher; before training its KL is small but not 0."""
    teacher = _TinyLM(0)
    student = copy.deepcopy(teacher)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    mtq.quantize(student, mtq.NVFP4_DEFAULT_CFG, lambda m: m(tokens))
    model = DistillationModel(student, teacher)
    kl0 = model(tokens).mean().item()
    assert kl0 > 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)  # a QAD learning rate: Adam's steps are about lr each
    for _ in range(20):
        opt.zero_grad()
        model(tokens).mean().backward()
        opt.step()
    assert model(tokens).mean().item() < kl0
