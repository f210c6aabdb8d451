"""Quantized Megatron expert layers apply the router probability after the down projection's input quantization, in
every implementation, amax layout, backward mode and kernel path, on 4 gloo ranks (TP=2, EP=2, bf16).

For each case one MoE layer's experts are called directly, with inputs captured from a forward of the model: Megatron's
``SequentialMLP`` (per-expert views), ``TEGroupedMLP`` with the project's grouped linears on the torch path and on the
kernel path (Triton interpreter), and ``SequentialMLP`` on the kernel path (each expert's linear through the one-expert
kernels). Their outputs and the gradients of the tokens, the router probabilities and every
expert weight (and bias) must be identical, bit for bit; and equal (output bit for bit, gradients to fp32 rounding) to
a reference written here with ``numerics.fake_quant``: per expert ``scale_rows(Q(act), prob) @ Q(w2)^T + prob * b2``
with ``act = glu(Q(x) @ Q(w1)^T + b1)``.
"""

import pytest
import torch
from autograd_paths import KERNEL_NODES, REFERENCE_NODE, graph_nodes
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, TP, EP, EXPERTS, SEED = 4, 2, 2, 8, 1234
# name -> (expert kind, kernel)
KINDS = {"sequential": ("sequential", "torch"), "grouped": ("grouped", "torch"),
         "grouped_kernel": ("grouped", "triton"), "sequential_kernel": ("sequential", "triton")}
# case -> (preset, weight amax layout, input amax layout, backward mode, ste, build overrides)
GLU = {"gated_linear_unit": True}
CASES = {
    "fp8": ("fp8_default.yaml", "vectorized", "per_expert", "dequantized", "pass_through", GLU),
    "fp8_shared": ("fp8_default.yaml", "shared", "shared", "dequantized", "pass_through", GLU),
    "fp8_per_expert": ("fp8_default.yaml", "per_expert", "per_expert", "dequantized", "pass_through", GLU),
    "fp8_clipped": ("fp8_default.yaml", "vectorized", "per_expert", "dequantized", "clipped", GLU),
    "fp8_high_precision": ("fp8_default.yaml", "vectorized", "per_expert", "high_precision", "clipped", GLU),
    "fp8_quantized": ("fp8_default.yaml", "vectorized", "per_expert", "quantized", "pass_through", GLU),
    "nvfp4": ("nvfp4_default.yaml", "vectorized", "per_expert", "dequantized", "pass_through", GLU),
    "fp8_glu_bias": ("fp8_default.yaml", "per_expert", "shared", "dequantized", "clipped",
                     {**GLU, "add_bias_linear": True}),
    "fp8_gelu": ("fp8_default.yaml", "vectorized", "shared", "dequantized", "pass_through", {}),
}
REFERENCE_GRADS = ("dequantized",)  # the reference's gradients are those of the dequantized mode


class _STE(torch.autograd.Function):
    """``fake_quant`` with a pass-through or clipped (``|x| <= amax``) straight-through gradient."""

    @staticmethod
    def forward(ctx, x, fmt, amax, clipped):
        from modelopt_moe.numerics import fake_quant

        ctx.save_for_backward(x)
        ctx.amax, ctx.clipped = amax, clipped
        return fake_quant(x.detach(), fmt, amax)

    @staticmethod
    def backward(ctx, grad):
        from modelopt_moe.numerics import clip_limit

        (x,) = ctx.saved_tensors
        if not ctx.clipped:
            return grad, None, None, None
        return grad * (x.abs() <= clip_limit(ctx.amax)), None, None, None


def _reference(experts, x, tokens_per_expert, probs, clipped):
    """The engines' expert computation from the SequentialMLP's weights and quantizers (see the module docstring)."""
    import torch.nn.functional as F

    from modelopt_moe.numerics import scale_rows

    cfg, out = experts.config, []
    q1, q2 = experts.linear_fc1, experts.linear_fc2

    def fq(t, q, i):
        return _STE.apply(t, q.fmt, q.expert_amax(i), clipped)

    for i, (xi, pi) in enumerate(zip(x.split(tokens_per_expert), probs.split(tokens_per_expert), strict=True)):
        e = experts.local_experts[i]
        h = fq(xi, q1.input_quantizer, i) @ fq(e.linear_fc1.weight, q1.weight_quantizer, i).t()
        if e.linear_fc1.bias is not None:
            h = h + e.linear_fc1.bias
        if cfg.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            act = cfg.activation_func(gate) * (up + cfg.glu_linear_offset)
        else:
            act = F.gelu(h) if cfg.activation_func is F.gelu else cfg.activation_func(h)
        y = scale_rows(fq(act, q2.input_quantizer, i), pi) @ fq(e.linear_fc2.weight, q2.weight_quantizer, i).t()
        if e.linear_fc2.bias is not None:
            y = (y + e.linear_fc2.bias * pi.unsqueeze(-1)).to(y.dtype)
        out.append(y)
    return torch.cat(out)


def _expert_params(experts, kind):
    """``{(gemm, param, local expert): tensor}`` of either expert kind."""
    out = {}
    for gemm in ("linear_fc1", "linear_fc2"):
        for i in range(experts.num_local_experts):
            for p in ("weight", "bias"):
                if kind == "sequential":
                    t = getattr(getattr(experts.local_experts[i], gemm), p)
                else:
                    t = getattr(getattr(experts, gemm), f"{p}{i}", None)
                if t is not None:
                    out[(gemm, p, i)] = t
    return out


def _run(experts, kind, inputs, grad):
    hidden, tokens, probs = (t.detach().clone() for t in inputs)
    hidden.requires_grad_(True)
    probs.requires_grad_(True)
    params = _expert_params(experts, kind)
    for p in params.values():
        p.grad = None
    out, bias = experts(hidden, tokens, probs)
    nodes = graph_nodes(out)
    out.backward(grad)
    return {"out": out.detach(), "bias": bias, "hidden": hidden.grad, "probs": probs.grad,
            **{k: p.grad for k, p in params.items()}}, nodes


def _captured_inputs(experts, model, batch, mm):
    """The positional arguments ``experts`` gets in a forward of ``model`` (hidden states, tokens per expert,
    probs)."""
    captured = []
    hook = experts.register_forward_pre_hook(lambda mod, args: captured.append(args) and None)
    with torch.no_grad():
        mm.lm_loss(model, batch)
    hook.remove()
    return captured[0]


def _worker(rank, world_size):
    import warnings

    warnings.filterwarnings("ignore")
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

    mm.init_model_parallel(TP, EP, seed=SEED)
    batches = mm.text_batches(2, 32, 3)
    results = {}
    for case, (preset, w_layout, in_layout, mode, ste, overrides) in CASES.items():
        models = {}
        for name, (kind, kernel) in KINDS.items():
            m = mm.build_moe_gpt(num_layers=1, num_experts=EXPERTS, seed=SEED, experts=kind,
                                 params_dtype=torch.bfloat16, **overrides).eval()
            with torch.no_grad():  # biases are built as zeros: give them values
                for n, p in mm.iter_params_with_global_names(m):
                    if n.endswith("bias") and "norm" not in n:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
            cfg = mtq.load_config(preset)
            cfg.experts.weight_amax, cfg.experts.input_amax = w_layout, in_layout
            cfg.backward.mode, cfg.backward.ste, cfg.kernel = mode, ste, kernel
            models[name] = mtq.quantize(m, cfg, lambda mod: [mm.lm_loss(mod, b) for b in batches[:2]])
        experts = {name: m.decoder.layers[0].mlp.experts for name, m in models.items()}
        inputs = _captured_inputs(experts["sequential"], models["sequential"], batches[2], mm)
        grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(rank)).to(inputs[0].dtype)
        for m in models.values():
            m.train()
        runs, paths = {}, {}
        for name in models:
            runs[name], paths[name] = _run(experts[name], KINDS[name][0], inputs, grad)
        hidden, tokens, probs = (t.detach().clone() for t in inputs)
        hidden.requires_grad_(True)
        probs.requires_grad_(True)
        seq = experts["sequential"]
        params = _expert_params(seq, "sequential")
        for p in params.values():
            p.grad = None
        ref_out = _reference(seq, hidden, tokens.tolist(), probs, ste == "clipped")
        ref_out.backward(grad)
        runs["reference"] = {"out": ref_out.detach(), "hidden": hidden.grad, "probs": probs.grad,
                             **{k: p.grad for k, p in params.items()}}
        runs["tokens"] = tokens.tolist()
        runs["amax_equal"] = all(
            torch.equal(getattr(experts["sequential"], g).input_quantizer.amax,
                        getattr(experts[name], g).input_quantizer.amax)
            for g in ("linear_fc1", "linear_fc2") for name in ("grouped", "grouped_kernel"))
        runs["paths"] = paths
        results[case] = runs
    mm.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, WORLD, timeout=seconds(900))


def _bits_equal(a, b):
    return a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_every_implementation_gives_the_same_output_and_gradients(results, case):
    # The quantized mode fake-quantizes each GEMM's output gradient with that tensor's own amax: one per expert in
    # SequentialMLP, one for all experts in a grouped GEMM; there, the grouped paths are compared with each other.
    first = "grouped" if CASES[case][3] == "quantized" else "sequential"
    for r in results:
        runs = r[case]
        assert runs["amax_equal"]
        base = runs[first]
        # the router gets a gradient
        assert base["probs"] is not None
        assert base["probs"].abs().sum() > 0
        for name in ("sequential", "grouped", "grouped_kernel"):
            other = runs[name]
            assert other["bias"] is None  # a returned bias is added by the down projection itself
            if name == first or (first == "grouped" and name == "sequential"):
                continue
            for key in base:
                if key != "bias":
                    assert _bits_equal(base[key], other[key]), (case, name, key)
        assert _bits_equal(runs["sequential"]["out"], base["out"])


@pytest.mark.parametrize("case", list(CASES))
def test_output_is_the_engines_computation(results, case):
    """``prob`` multiplies the down projection's fake-quantized input, bit for bit like the reference; in the
    dequantized mode the gradients too (to fp32 rounding: the reference's GEMM gradients are autograd's)."""
    mode = CASES[case][3]
    for r in results:
        runs = r[case]
        ref, seq = runs["reference"], runs["sequential"]
        assert _bits_equal(seq["out"], ref["out"]), case
        if mode not in REFERENCE_GRADS:
            continue
        for key, want in ref.items():
            if key == "out":
                continue
            got = seq[key]
            scale = want.float().abs().max().clamp(min=1e-30)
            assert ((got.float() - want.float()).abs().max() / scale).item() <= 1e-2, (case, key)


def test_high_precision_and_quantized_modes_keep_the_forward_value(results):
    for r in results:
        for case in ("fp8_high_precision", "fp8_quantized"):
            assert _bits_equal(r[case]["sequential"]["out"], r[case]["reference"]["out"]), case
        # ... while their gradients differ from the dequantized mode's
        assert not torch.equal(r["fp8_high_precision"]["sequential"]["probs"], r["fp8_clipped"]["sequential"]["probs"])


@pytest.mark.parametrize("case", list(CASES))
def test_sequential_experts_on_the_kernels_give_the_torch_paths_bits(results, case):
    """``SequentialMLP`` with ``kernel: triton``: each expert's weight and tokens go through the one-expert kernels
    (no reference fake quant left in the graph), with the torch path's output and gradients bit for bit."""
    for r in results:
        runs = r[case]
        fast, ref = runs["sequential_kernel"], runs["sequential"]
        assert fast.keys() == ref.keys()
        for key in ref:
            if key != "bias":
                assert _bits_equal(ref[key], fast[key]), (case, key)
        torch_nodes, kernel_nodes = runs["paths"]["sequential"], runs["paths"]["sequential_kernel"]
        assert not KERNEL_NODES & torch_nodes, case
        # The graph holds each fake quant's straight-through node, except in the high-precision mode (its operands are
        # built outside autograd: the bits above are its check).
        shows_path = CASES[case][3] != "high_precision"
        assert (REFERENCE_NODE in torch_nodes) == shows_path, case
        if shows_path:
            assert KERNEL_NODES & kernel_nodes, (case, kernel_nodes)
            # only an expert without tokens fake-quantizes its empty tensor with the reference
            assert REFERENCE_NODE not in kernel_nodes or 0 in runs["tokens"], case
