"""Benchmark: one Transformer Engine GroupedLinear forward+backward step, bf16 vs FP8 fake quant (GPU).

Prints a table: N experts of [1536 x 2048] (out x in), 16384 tokens split evenly, bf16 activations and weights.
Variants:
  bf16                  TE GroupedLinear, no quantization
  fp8 kernel + cache    vectorized [N] amax, one-launch Triton kernels, weights fake-quantized once per optimizer
                        step (micro-batches reuse them: the steady state of gradient accumulation)
  fp8 kernel, no cache  the same, weights fake-quantized every step
  fp8 torch loop        per-expert quantizers and the torch reference, one expert at a time (what a per-expert
                        Python loop costs; NVIDIA Model Optimizer 0.47's layout)

Usage (GPU machine): python3 tools/bench_te_grouped_step.py [--experts 32 128] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import copy
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


def _variants(base, x, splits):
    import modelopt_moe.quantization as mtq

    def quantized(layout, kernel, cache):
        layer = copy.deepcopy(base)
        cfg = mtq.load_config("fp8_default.yaml")
        cfg.experts.weight_amax, cfg.kernel = layout, kernel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(layer, cfg, lambda m: m(x, splits))
        if not cache:
            layer._weight_cache = lambda: None
        return layer

    return {
        "bf16": base,
        "fp8 kernel + cache": quantized("vectorized", "auto", True),
        "fp8 kernel, no cache": quantized("vectorized", "auto", False),
        "fp8 torch loop": quantized("per_expert", "torch", False),
    }


def main():
    import transformer_engine.pytorch as te

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--in-features", type=int, default=2048)
    args = parser.parse_args()

    rows = []
    for n in args.experts:
        torch.manual_seed(0)
        base = te.GroupedLinear(n, args.in_features, args.out_features, bias=False, params_dtype=torch.bfloat16,
                                device="cuda")
        splits = [args.tokens // n] * n
        x = torch.randn(args.tokens, args.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.tokens, args.out_features, device="cuda", dtype=torch.bfloat16)
        bf16_ms = None
        for name, layer in _variants(base, x.detach(), splits).items():
            def step(layer=layer, x=x, splits=splits, grad=grad):
                layer(x, splits).backward(grad)

            ms = _time_ms(step)
            bf16_ms = bf16_ms or ms
            rows.append((n, name, ms, ms / bf16_ms))
            del layer
        del base
        torch.cuda.empty_cache()

    print(f"\nTE GroupedLinear fwd+bwd, {args.tokens} tokens, experts [{args.out_features} x {args.in_features}] "
          f"bf16, {torch.cuda.get_device_name(0)}")
    print(f"{'N':>5} {'variant':<22} {'ms':>9} {'x bf16':>8}")
    for n, name, ms, ratio in rows:
        print(f"{n:>5} {name:<22} {ms:>9.3f} {ratio:>8.2f}")


if __name__ == "__main__":
    main()
