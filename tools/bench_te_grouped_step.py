"""Benchmark: one Transformer Engine GroupedLinear forward+backward step, bf16 vs FP8 fake quant (GPU).

Prints a table: N experts of [1536 x 2048] (out x in), 16384 tokens split evenly, bf16 activations and weights.
Variants:
  bf16                  TE GroupedLinear, no quantization
  fp8 reuse             vectorized [N] amax, one-launch Triton kernels, inside ``mtq.reuse_quantized_weights``:
                        weights fake-quantized once per optimizer step, reused by the other micro-batches (the steady
                        state of gradient accumulation with ``plugins.megatron.get_forward_backward_func``)
  fp8 re-quantize       the same outside a scope (the default): weights fake-quantized on every forward, and again
                        in the backward (``backward.weight_operands: recompute``, the default)
  fp8 re-q, keep        the same with ``weight_operands: keep``: the forward's fake-quantized weights are kept for
                        the backward (one launch fewer, one more copy of the weights alive)
  te_fp8 reuse /        ``gemm: te_fp8``: the forward GEMM as a real FP8 GEMM in Transformer Engine with our static
  te_fp8 re-quantize    per-expert scales, backward on the fake-quant operands
  fp8 torch loop        per-expert amax and the torch reference, one expert at a time (what a per-expert Python
                        loop costs; NVIDIA Model Optimizer 0.47's layout)
  TE fp8 delayed /      Transformer Engine's own FP8 training of the same layer (``fp8_autocast`` with its delayed or
  TE fp8 current        current scaling recipe; FP8 forward, dgrad and wgrad GEMMs): the anchor for ``te_fp8``
  fp8 block re-quantize FP8 in blocks (``fp8_block_w8a8.yaml``: 128x128 weight blocks, 1x128 token groups, scales
                        from the data) on the one-launch kernels, weights fake-quantized on every forward
  fp8 block torch       the same with the torch reference, one expert at a time (the per-expert loop)
  TE fp8 block          Transformer Engine's own ``Float8BlockScaling`` training of the same layer (real FP8 GEMMs
                        on 128x128 / 1x128 blocks; runs on Hopper): the anchor for FP8 blocks
  mxfp8 / mxfp4         ``mxfp8_default.yaml`` / ``mxfp4_default.yaml`` fake quant on the one-launch kernels (TE's
    re-quantize         ``MXFP8BlockScaling`` needs a Blackwell GPU's MX GEMMs, so it has no row on Hopper)

``--backward quantized`` sets ``backward.mode: quantized`` for every quantized variant: the output gradient is
fake-quantized (E5M2, per tensor), and ``te_fp8`` then runs dgrad and wgrad as FP8 GEMMs too.

Every variant is built first, then timed in alternating rounds (host-bound timings drift between runs on shared
machines); the table gives the median over rounds and the range of the ratio to bf16 of the same round. Two timings:
*one step*, each step alone (synchronized before it: the GPU also waits for the host's first launches), and
*back-to-back*, 10 steps queued without a synchronization (what a training loop does: one step's host time overlaps
the previous step's GPU work), per step.

Usage (GPU machine): python3 tools/bench_te_grouped_step.py [--experts 32 128] [--tokens 16384] [--rounds 5]
                     [--backward dequantized|quantized] [--variants NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import warnings

import torch


def _time_ms(fn, warmup=5, iters=20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


VARIANTS = ("bf16", "fp8 reuse", "fp8 re-quantize", "fp8 re-q, keep", "te_fp8 reuse", "te_fp8 re-quantize",
            "fp8 torch loop", "TE fp8 delayed", "TE fp8 current", "fp8 block re-quantize", "fp8 block torch",
            "TE fp8 block", "mxfp8 re-quantize", "mxfp4 re-quantize")


def _time_back_to_back_ms(fn, steps=10, repeats=3) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def _variants(base, x, splits, backward: str, names):
    """The variants to time: name -> (layer, scope or None), for the names asked for (bf16 always)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    import modelopt_moe.quantization as mtq

    def quantized(layout, kernel, weight_operands="recompute", preset="fp8_default.yaml"):
        layer = copy.deepcopy(base)
        cfg = mtq.load_config(preset)
        if layout is not None:
            cfg.experts.weight_amax = layout
        cfg.backward.weight_operands = weight_operands
        cfg.backward.mode = backward
        cfg.kernel, cfg.gemm = ("auto", "te_fp8") if kernel == "te_fp8" else (kernel, "fake_quant")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(layer, cfg, lambda m: m(x, splits))
        return layer

    def reusing(kernel):
        layer = quantized("vectorized", kernel)
        return layer, lambda: mtq.reuse_quantized_weights(layer)

    def te_own(scaling):
        return copy.deepcopy(base), lambda: te.fp8_autocast(enabled=True, fp8_recipe=scaling())

    build = {
        "bf16": lambda: (base, None),
        "fp8 reuse": lambda: reusing("auto"),
        "fp8 re-quantize": lambda: (quantized("vectorized", "auto"), None),
        "fp8 re-q, keep": lambda: (quantized("vectorized", "auto", "keep"), None),
        "te_fp8 reuse": lambda: reusing("te_fp8"),
        "te_fp8 re-quantize": lambda: (quantized("vectorized", "te_fp8"), None),
        "fp8 torch loop": lambda: (quantized("per_expert", "torch"), None),
        "TE fp8 delayed": lambda: te_own(recipe.DelayedScaling),
        "TE fp8 current": lambda: te_own(recipe.Float8CurrentScaling),
        "fp8 block re-quantize": lambda: (quantized(None, "auto", preset="fp8_block_w8a8.yaml"), None),
        "fp8 block torch": lambda: (quantized(None, "torch", preset="fp8_block_w8a8.yaml"), None),
        "TE fp8 block": lambda: te_own(recipe.Float8BlockScaling),
        "mxfp8 re-quantize": lambda: (quantized(None, "auto", preset="mxfp8_default.yaml"), None),
        "mxfp4 re-quantize": lambda: (quantized(None, "auto", preset="mxfp4_default.yaml"), None),
    }
    return {name: build[name]() for name in VARIANTS if name == "bf16" or name in names}


def main():
    """Times forward and backward of each variant over alternating rounds and prints medians and ratios to bf16."""
    import transformer_engine.pytorch as te

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backward", choices=("dequantized", "quantized"), default="dequantized")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()

    rows = []
    for n in args.experts:
        torch.manual_seed(0)
        base = te.GroupedLinear(n, args.in_features, args.out_features, bias=False, params_dtype=torch.bfloat16,
                                device="cuda")
        splits = [args.tokens // n] * n
        x = torch.randn(args.tokens, args.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.tokens, args.out_features, device="cuda", dtype=torch.bfloat16)
        variants = _variants(base, x.detach(), splits, args.backward, args.variants)
        times = {name: [] for name in variants}
        queued = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (layer, scope) in variants.items():
                def step(layer=layer, x=x, splits=splits, grad=grad):
                    layer(x, splits).backward(grad)

                with scope() if scope else contextlib.nullcontext():
                    times[name].append(_time_ms(step))
                    queued[name].append(_time_back_to_back_ms(step))
        for name in variants:
            row = [n, name]
            for ms in (times[name], queued[name]):
                base_ms = times["bf16"] if ms is times[name] else queued["bf16"]
                ratios = [t / b for t, b in zip(ms, base_ms, strict=True)]
                row += [statistics.median(ms), statistics.median(ratios), min(ratios), max(ratios)]
            rows.append(tuple(row))
        del variants, base
        torch.cuda.empty_cache()

    print(f"\nTE GroupedLinear fwd+bwd, {args.tokens} tokens, experts [{args.out_features} x {args.in_features}] "
          f"bf16, backward {args.backward}, {torch.cuda.get_device_name(0)}, {args.rounds} alternating rounds")
    print(f"{'':>26} {'one step':-^44} {'back-to-back':-^44}")
    print(f"{'N':>5} {'variant':<20} " + f"{'ms (median)':>12} {'x bf16 (median)':>16} {'x bf16 range':>14} " * 2)
    for n, name, *cols in rows:
        line = f"{n:>5} {name:<20}"
        for ms, ratio, lo, hi in (cols[:4], cols[4:]):
            line += f" {ms:>12.3f} {ratio:>16.2f} {lo:>6.2f}..{hi:<6.2f}"
        print(line)


if __name__ == "__main__":
    main()
