"""``backward.weight_operands: recompute`` (the default): the grouped expert GEMM saves only the place of its
fake-quantized weights and the backward fake-quantizes the unchanged weights again, with the same bits as keeping
them; weights changed between forward and backward are an error, never a gradient through other operands; inside a
reuse block nothing is recomputed."""

import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.kernels import kernels_available
from modelopt_moe.quantization.nn import GroupedLinear, weight_recompute
from modelopt_moe.quantization.nn import expert_weights as experts_mod

pytestmark = pytest.mark.skipif(not kernels_available("cpu"), reason="needs the Triton interpreter on CPU")

SPLITS = [3, 0, 5, 2]


def _layer(weight_operands: str, preset: str = "fp8_default.yaml", ste: str = "clipped"):
    torch.manual_seed(0)
    layer = GroupedLinear(len(SPLITS), 32, 16, bias=True)
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax, cfg.experts.input_amax = "vectorized", "per_expert"
    cfg.backward.ste, cfg.backward.weight_operands, cfg.kernel = ste, weight_operands, "triton"
    x = torch.randn(sum(SPLITS), 32, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    return layer


def _count_launches(monkeypatch) -> list[int]:
    calls = [0]
    original = experts_mod.grouped_weight_fake_quant

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(experts_mod, "grouped_weight_fake_quant", counted)
    return calls


def _step(layer, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SPLITS), 32, generator=g).requires_grad_(True)
    y = layer(x, torch.tensor(SPLITS))
    y.backward(torch.randn(y.shape, generator=g))
    grads = [w.grad.clone() for w in layer.expert_weights()]
    layer.zero_grad()
    return y.detach(), x.grad, grads


@pytest.mark.parametrize(("preset", "ste"), [("fp8_default.yaml", "clipped"), ("nvfp4_default.yaml", "pass_through")])
def test_recompute_gives_the_bits_of_keeping_the_operands(monkeypatch, preset, ste):
    keep = _step(_layer("keep", preset, ste))
    packed = []
    original_pack = weight_recompute.RecomputedWeights._pack

    def pack(self, t):
        out = original_pack(self, t)
        packed.append(isinstance(out, weight_recompute._Saved))
        return out

    monkeypatch.setattr(weight_recompute.RecomputedWeights, "_pack", pack)
    layer = _layer("recompute", preset, ste)
    calls = _count_launches(monkeypatch)
    got = _step(layer)
    assert calls[0] == 2  # the forward's launch and the backward's
    assert sum(packed) == len(SPLITS)  # each expert GEMM (the empty one too) saved its weight by place only
    assert torch.equal(got[0], keep[0])
    assert torch.equal(got[1], keep[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], keep[2], strict=True))


def test_keep_launches_once(monkeypatch):
    layer = _layer("keep")
    calls = _count_launches(monkeypatch)
    _step(layer)
    assert calls[0] == 1


def test_weights_changed_between_forward_and_backward_raise():
    layer = _layer("recompute")
    x = torch.randn(sum(SPLITS), 32, requires_grad=True)
    y = layer(x, torch.tensor(SPLITS))
    with torch.no_grad():
        layer.weight2.add_(1.0)  # in place between forward and backward
    with pytest.raises(RuntimeError, match="changed between the forward and the backward"):
        y.sum().backward()


def test_inside_a_reuse_block_the_cached_values_serve_the_backward(monkeypatch):
    layer = _layer("recompute")
    calls = _count_launches(monkeypatch)
    with mtq.reuse_quantized_weights(layer):
        for seed in range(3):  # three micro-batches of one step
            _step(layer, seed)
    assert calls[0] == 1
