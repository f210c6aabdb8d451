"""The top-p (nucleus) teacher distribution of the distillation KL: the kept tokens are the fewest most likely ones
whose teacher probability reaches ``p`` (ties with the last kept), found over the whole vocabulary; the loss and
gradient are the KL of both distributions renormalised there. The reference here sorts each row in float64; the
vocabulary-parallel and kernel paths are checked in tests/unit/kernels/test_kl_divergence.py and
tests/distributed/test_qad_megatron.py."""

import math
import re

import pytest
import torch

from modelopt_moe.distill import DistillationModel, logits_kl_loss
from modelopt_moe.distill.losses import _top_p_threshold

# The implementation compares fp32 sums; rows whose float64 nucleus mass lies this close to p are not compared.
MARGIN = 2e-6


def _teacher(dtype, seed=0, shape=(64, 300)):
    """Random logits at three scales with the cases that matter: a flat row, -inf padding, ties, a lone token."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * torch.tensor([0.3, 3.0, 12.0]).repeat(shape[0] // 3 + 1)[:shape[0], None]
    t[0] = 1.0  # every token tied
    t[1, 100:] = -math.inf  # vocabulary padding
    t[2, ::2] = t[2, 1::2]  # every value twice
    t[3, 1:] = -math.inf  # one token carries the whole mass
    t[4, :10] = t[4].max() + 1  # ten tied at the top
    return t.to(dtype)


def _reference_nucleus(t, p, temperature):
    """float64: the mask of the fewest most likely tokens reaching ``p`` (ties with the last kept), and per row
    whether its masses at the edge are further than MARGIN from ``p``."""
    q = torch.softmax(t.double() / temperature, -1)
    sorted_q, order = q.sort(-1, descending=True)
    n = (sorted_q.cumsum(-1) < p).sum(-1).clamp(max=t.shape[-1] - 1)  # index of the token that reaches p
    edge = t.gather(-1, order.gather(-1, n[:, None]))
    keep = t >= edge
    mass, below = (q * keep).sum(-1), (q * (t > edge)).sum(-1)
    return keep, (mass - p > MARGIN) & ((p - below > MARGIN) | (below == 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("temperature", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("p", [1e-9, 0.3, 0.9, 0.999])
def test_the_nucleus_is_the_fewest_most_likely_tokens_reaching_p(dtype, temperature, p):
    t = _teacher(dtype, seed=int(p * 1000 + temperature * 10))
    threshold = _top_p_threshold(t, p, temperature, None, rows=7)
    assert (threshold.dtype, threshold.shape) == (dtype, (t.shape[0],))
    assert (t == threshold[:, None]).any(-1).all()  # a logit of the row: ties with it are kept
    keep, clear = _reference_nucleus(t, p, temperature)
    assert clear.sum() >= 0.75 * t.shape[0], clear  # peaked rows near p = 0.999 have tail tokens under the margin
    assert torch.equal((t >= threshold[:, None])[clear], keep[clear])
    if p == 1e-9:
        assert (t >= threshold[:, None]).sum(-1)[[0, 3, 4]].tolist() == [300, 1, 10]  # the top tokens and their ties
    # chunking over tokens does not move it
    assert torch.equal(_top_p_threshold(t, p, temperature, None, rows=t.shape[0]), threshold)


def _masked_kl(s, t, keep, temperature):
    """KL of the two distributions renormalised on ``keep``, written with torch's log-softmax."""
    inf = torch.tensor(-math.inf)
    log_q = torch.log_softmax(torch.where(keep, t / temperature, inf), -1)
    log_p = torch.log_softmax(torch.where(keep, s / temperature, inf), -1)
    terms = torch.where(keep, log_q.exp() * (log_q - log_p), 0.0)
    return terms.sum(-1) * temperature**2


def test_top_p_kl_is_the_kl_on_the_teachers_nucleus_and_never_the_default():
    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(6, 7, 200, generator=g) * 3, torch.randn(6, 7, 200, generator=g) * 3
    keep, clear = _reference_nucleus(t.reshape(-1, 200), 0.9, 1.5)
    assert clear.all()
    a, b = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    got = logits_kl_loss(a, t, temperature=1.5, top_p=0.9, chunk_tokens=4)
    want = _masked_kl(b, t, keep.reshape(t.shape), 1.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert 1 < keep.sum(-1).float().mean() < 200
    exact = logits_kl_loss(s, t, temperature=1.5)
    assert not torch.allclose(got, exact)
    assert torch.equal(logits_kl_loss(s, t, temperature=1.5, top_p=1.0), exact)  # p = 1: the exact KL
    assert torch.equal(logits_kl_loss(s, t, temperature=1.5, top_p=1), exact)
    assert logits_kl_loss(s[:0], t[:0], top_p=0.9).shape == (0, 7)  # no tokens: nothing to find
    # a nucleus of one token: both renormalised distributions are that token, the KL is 0 and so is its gradient
    c = s.clone().requires_grad_(True)
    one = logits_kl_loss(c, t, temperature=1.5, top_p=1e-9)
    one.sum().backward()
    assert torch.equal(one, torch.zeros_like(one))
    assert torch.equal(c.grad, torch.zeros_like(c.grad))


def test_top_p_kl_takes_minus_inf_logits_as_the_exact_kl_does():
    """A student -inf inside the nucleus gives +inf; a teacher -inf is outside every nucleus; a teacher all -inf
    has no distribution (NaN), as for the exact KL."""
    g = torch.Generator().manual_seed(7)
    s, t = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g) * 2
    t[0, 10:] = -math.inf
    s[1, int(t[1].argmax())] = -math.inf
    t[2, :] = -math.inf
    s[3, int(t[3].argmin())] = -math.inf  # far outside the nucleus: no effect
    got = logits_kl_loss(s, t, top_p=0.5)
    keep, _ = _reference_nucleus(t[[0, 3]], 0.5, 1.0)
    torch.testing.assert_close(got[[0, 3]], _masked_kl(s[[0, 3]], t[[0, 3]], keep, 1.0), rtol=1e-5, atol=1e-6)
    assert got[1] == math.inf
    assert got[2].isnan()


def test_distillation_model_takes_top_p():
    torch.manual_seed(0)
    student, teacher = torch.nn.Embedding(32, 40), torch.nn.Embedding(32, 40)
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = logits_kl_loss(student(tokens), teacher(tokens), top_p=0.7)
        assert torch.equal(DistillationModel(student, teacher, top_p=0.7)(tokens), want)
        assert not torch.equal(DistillationModel(student, teacher)(tokens), want)
    with pytest.raises(ValueError, match=r"DistillationModel: top_k=5 and top_p=0.7: give one of them, not both"):
        DistillationModel(student, teacher, top_k=5, top_p=0.7)
    with pytest.raises(ValueError, match=r"DistillationModel: top_p must be a number in \(0, 1\] or None, got 0"):
        DistillationModel(student, teacher, top_p=0)


@pytest.mark.parametrize("top_p", [0, 0.0, -0.1, 1.5, math.nan, True, "0.9"], ids=repr)
def test_a_top_p_outside_0_1_is_refused_by_name(top_p):
    with pytest.raises(ValueError, match=re.escape(f"logits_kl_loss: top_p must be a number in (0, 1] or None, "
                                                   f"got {top_p!r}")):
        logits_kl_loss(torch.zeros(2, 4), torch.zeros(2, 4), top_p=top_p)


def test_top_k_and_top_p_together_are_refused():
    with pytest.raises(ValueError, match="logits_kl_loss: top_k=3 and top_p=0.9: give one of them, not both"):
        logits_kl_loss(torch.zeros(2, 4), torch.zeros(2, 4), top_k=3, top_p=0.9)
