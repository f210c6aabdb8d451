"""Precision autoswitch on the framework-free grouped expert linear and nn.Linear: a planted outlier expert switches
its fprop to high precision while the others stay quantized, decisions reach the per-rank JSON-lines log and the
summary, unsampled steps dispatch exactly the ops of a model without autoswitch, and a sampled grouped GEMM measures
all experts in one launch per operand."""

import json
import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import modelopt_moe.quantization as mtq
from modelopt_moe import kernels as K
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization import ConfigError
from modelopt_moe.quantization.autoswitch import active_autoswitch_scopes, log_file
from modelopt_moe.quantization.config import to_config
from modelopt_moe.quantization.nn import GroupedLinear

N, IN, OUT = 4, 32, 16
SPLITS = [6, 3, 7, 8]
OUTLIER = 2


def _yaml(tmp_path, gemms="[fprop, dgrad, wgrad]", mode="dequantized", every=4):
    path = tmp_path / "autoswitch.yaml"
    path.write_text(
        "$import: fp8_default.yaml\n"
        "experts: {weight_amax: vectorized, input_amax: per_expert}\n"
        f"backward: {{mode: {mode}}}\n"
        "kernel: torch\n"
        "weight_amax_update: static\n"
        f"autoswitch: {{every: {every}, underflow_pct: 20.0, mse: 0.05, gemms: {gemms}, "
        f"log_dir: {tmp_path / 'logs'}}}\n")
    return mtq.load_config(path)


def _outlier_layer(cfg, kernel=None):
    """Expert OUTLIER has a heavy-tailed weight: one value 1e6 times the rest, so its per-expert FP8 scale flushes
    almost every other value to zero."""
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT)
    with torch.no_grad():
        layer.expert_weights()[OUTLIER][0, 0] = 1e5
    x = torch.randn(sum(SPLITS), IN)
    if kernel is not None:
        cfg.kernel = kernel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, SPLITS))
    return layer, x


def _records(tmp_path):
    return [json.loads(line) for line in log_file(tmp_path / "logs", 0).read_text().splitlines()]


def test_config_from_yaml_and_its_errors(tmp_path):
    cfg = _yaml(tmp_path)
    assert (cfg.autoswitch.every, cfg.autoswitch.underflow_pct, cfg.autoswitch.mse) == (4, 20.0, 0.05)
    with pytest.raises(ConfigError, match="underflow_pct, mse or both"):
        to_config({"autoswitch": {"every": 2}})
    with pytest.raises(ConfigError, match="autoswitch.gemms"):
        to_config({"autoswitch": {"every": 2, "mse": 0.1, "gemms": ["fprop", "xgrad"]}})
    with pytest.raises(ConfigError, match="autoswitch.every"):
        to_config({"autoswitch": {"every": 0, "mse": 0.1}})
    with pytest.raises(ConfigError, match="did you mean 'every'"):
        to_config({"autoswitch": {"evry": 2, "mse": 0.1}})
    with pytest.raises(ConfigError, match="high_precision"):
        to_config({"autoswitch": {"every": 2, "mse": 0.1}, "backward": {"mode": "high_precision"}})


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_planted_outlier_expert_switches_its_fprop_alone(tmp_path, kernel):
    if kernel == "triton" and not K.kernels_available("cpu"):
        pytest.skip("Triton interpreter not active")
    layer, x = _outlier_layer(_yaml(tmp_path), kernel)
    x = x.clone().requires_grad_(True)
    with mtq.autoswitch_step(layer, 8) as sampled:
        y = layer(x, SPLITS)
        g = torch.randn_like(y)
        y.backward(g)
    assert sampled
    assert active_autoswitch_scopes() == 0
    iq, wq = layer.input_quantizer, layer.weight_quantizer
    xs, gs = x.detach().split(SPLITS), g.split(SPLITS)
    for i, w in enumerate(layer.expert_weights()):
        w = w.detach()
        xq, w_q = fake_quant(xs[i], "e4m3", iq.amax[i]), fake_quant(w, "e4m3", wq.amax[i])
        rows = slice(sum(SPLITS[:i]), sum(SPLITS[:i + 1]))
        if i == OUTLIER:  # fprop in high precision; dgrad too (its weight crossed); wgrad keeps the quantized input
            assert torch.equal(y[rows].detach(), xs[i] @ w.t())
            torch.testing.assert_close(x.grad[rows], gs[i] @ w)
        else:
            assert torch.equal(y[rows].detach(), xq @ w_q.t())
            torch.testing.assert_close(x.grad[rows], gs[i] @ w_q)
        torch.testing.assert_close(layer.expert_weights()[i].grad, gs[i].t() @ xq)
    recs = _records(tmp_path)
    assert len(recs) == N * 3
    assert {r["step"] for r in recs} == {8}
    switched = {(r["expert"], r["gemm"]) for r in recs if r["switched"]}
    assert switched == {(OUTLIER, "fprop"), (OUTLIER, "dgrad")}
    outlier = next(r for r in recs if r["expert"] == OUTLIER and r["gemm"] == "fprop")
    assert outlier["operands"]["weight"]["underflow_pct"] > 90
    assert outlier["operands"]["input"]["underflow_pct"] < 20
    summary = {(r["expert"], r["gemm"]): (r["samples"], r["switched"]) for r in mtq.autoswitch_summary(
        tmp_path / "logs")}
    assert summary[(OUTLIER, "fprop")] == (1, 1)
    assert summary[(0, "fprop")] == (1, 0)


def test_quantized_backward_measures_and_switches_the_gradient(tmp_path):
    """backward.mode=quantized fake-quantizes the output gradient (e5m2, its own per-tensor amax): a gradient with one
    value 1e12 times the rest underflows, so dgrad and wgrad take the original gradient (every expert: it is one
    tensor); the weight and input operands stay as their own decisions say."""
    layer, x = _outlier_layer(_yaml(tmp_path, mode="quantized"))
    x = x.clone().requires_grad_(True)
    with mtq.autoswitch_step(layer, 0):
        y = layer(x, SPLITS)
        g = torch.randn_like(y)
        g[0, 0] = 1e12
        y.backward(g)
    wq = layer.weight_quantizer
    rows = slice(0, SPLITS[0])  # expert 0: its weight did not cross, the gradient did
    w_q = fake_quant(layer.weight0.detach(), "e4m3", wq.amax[0])
    torch.testing.assert_close(x.grad[rows], g[rows] @ w_q)
    recs = [r for r in _records(tmp_path) if r["gemm"] in ("dgrad", "wgrad")]
    assert recs
    assert all(r["switched"] and r["operands"]["grad"]["underflow_pct"] > 20 for r in recs)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count_step(layer, x, step=None):
    for p in layer.parameters():
        p.grad = None
    with _CountOps() as counter:
        if step is None:
            layer(x, SPLITS).sum().backward()
        else:
            with mtq.autoswitch_step(layer, step):
                layer(x, SPLITS).sum().backward()
    return counter.ops


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_unsampled_steps_dispatch_exactly_the_ops_of_a_model_without_autoswitch(tmp_path, kernel):
    if kernel == "triton" and not K.kernels_available("cpu"):
        pytest.skip("Triton interpreter not active")
    cfg = _yaml(tmp_path)
    with_as, x = _outlier_layer(cfg, kernel)
    cfg.autoswitch = None
    without, _ = _outlier_layer(cfg, kernel)
    _count_step(without, x), _count_step(with_as, x, 3)  # warm the split-size caches
    base = _count_step(without, x)
    for step in (1, 5, 7):  # every=4: not sampled
        assert _count_step(with_as, x, step) == base
    assert not log_file(tmp_path / "logs", 0).exists()
    assert _count_step(with_as, x, 4) != base  # a sampled step does measure


def test_sampled_grouped_step_measures_all_experts_in_one_launch_per_operand(tmp_path, monkeypatch):
    if not K.kernels_available("cpu"):
        pytest.skip("Triton interpreter not active")
    from modelopt_moe.kernels import quant_stats

    layer, x = _outlier_layer(_yaml(tmp_path), "triton")
    launches = Counter()
    for name in ("_launch_weight_stats", "_launch_input_stats"):
        real = getattr(quant_stats, name)
        monkeypatch.setattr(quant_stats, name, lambda *a, _r=real, _n=name: launches.update([_n]) or _r(*a))
    with mtq.autoswitch_step(layer, 0):
        layer(x, SPLITS).sum().backward()
    assert launches == {"_launch_weight_stats": 1, "_launch_input_stats": 1}
    assert {r["expert"] for r in _records(tmp_path)} == set(range(N))


def test_dense_linear_is_one_gemm_without_expert(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    with torch.no_grad():
        model[1].weight[0, 0] = 1e5
    x = torch.randn(4, 32)
    cfg = _yaml(tmp_path, gemms="[fprop]")
    mtq.quantize(model, cfg, lambda m: m(x))
    with mtq.autoswitch_step(model, 0):
        model(x).sum().backward()
    recs = _records(tmp_path)
    assert [(r["layer"], r["expert"], r["gemm"], r["switched"]) for r in recs] == [
        ("0", None, "fprop", False), ("1", None, "fprop", True)]
