"""Where a whole Megatron MoE training step spends its GPU time: bf16 vs the quantized variants, by kernel category.

Builds the variants of ``tools/bench_megatron_step.py`` (same model, same options), runs a few steps of one mode of
each under ``torch.profiler`` and prints, per variant:
  step ms           the step's wall time without the profiler (CUDA events, median of ``--steps`` steps)
  GPU busy ms       the union of the kernels' intervals per step (from the profile): the step minus this is the time
                    the GPU waited for the host
  by category       the kernels' summed time per step in each category (GEMM, attention, our fake-quant kernels, TE's
                    FP8 casts, MoE dispatch, optimizer, ...), and the difference to bf16
and the kernels of each quantized variant whose time per step differs most from bf16's. With ``--host N`` it also
runs the steps under ``cProfile`` and lists the N Python functions whose own host time per step (``tottime``) grows
most from bf16 to each quantized variant (cProfile slows every Python call, so read the ranks, not the sums).

Usage (GPU machine): python3 tools/profile_megatron_step.py [--profile-mode re-quantize] [bench_megatron_step options]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_megatron_step as bench  # noqa: E402  (the benchmark's model, variants and steps)

# First match wins: attention kernels also carry GEMM-like names, our kernels carry "quant".
CATEGORIES = (
    ("fake quant (ours)", r"_grouped_\w*(fake_quant|clip_grad|amax)|_fake_quant"),
    ("attention", r"flash|fmha|attn|sdpa|cudnn"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_"),
    ("TE FP8 cast", r"cast|quantize|fp8|transpose"),
    ("optimizer", r"adam|multi_tensor|l2norm"),
    ("communication", r"nccl"),
    ("MoE dispatch", r"permut|sort|topk|scatter|gather|index|histc|cumsum|bincount|router"),
    ("norm/act/rope/loss", r"norm|swiglu|silu|glu|rope|rotary|softmax|cross_entropy|logsumexp"),
    ("copy/fill", r"memcpy|memset|copy|fill|cat"),
    ("elementwise/reduce", r"elementwise|vectorized|reduce|unrolled"),
)


def category(kernel: str) -> str:
    """The category of the kernel named ``kernel`` (the first pattern of :data:`CATEGORIES` that matches)."""
    low = kernel.lower()
    return next((name for name, pattern in CATEGORIES if re.search(pattern, low)), "other")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile(step, steps: int) -> tuple[dict[str, float], float]:
    """``({kernel name: us per step}, GPU busy us per step)`` over ``steps`` calls of ``step``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    bench._synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        bench._synchronize()
    kernels, intervals = collections.Counter(), []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.time_range.elapsed_us() / steps
            intervals.append((e.time_range.start, e.time_range.end))
    return dict(kernels), _busy_us(intervals) / steps


def host_profile(step, steps: int) -> dict[str, tuple[float, float, float]]:
    """``{function: (calls, own ms, cumulative ms per step, whether it is this project's)}`` of ``steps`` calls of
    ``step`` under cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    bench._synchronize()
    prof.disable()
    out = {}
    for (file, line, fn), (_, calls, tottime, cumtime, _) in pstats.Stats(prof).stats.items():
        key = f"{fn} ({'/'.join(Path(file).parts[-2:])}:{line})"
        out[key] = (calls / steps, tottime * 1e3 / steps, cumtime * 1e3 / steps, "modelopt_moe" in file)
    return out


def host_report(hosts: dict[str, dict], top: int) -> str:
    """Each quantized variant's host time over bf16: the Python functions that add the most, and this project's own."""
    base = hosts.get("bf16", {})
    lines = []
    for n, funcs in hosts.items():
        if n == "bf16":
            continue
        total = sum(v[1] for v in funcs.values()) - sum(v[1] for v in base.values())
        lines.append(f"\n{n} - bf16, host (cProfile) ms per step: {total:+.2f}; functions by own time added "
                     "(calls, own ms, cumulative ms per step):")
        diff = {k: v[1] - base.get(k, (0, 0.0))[1] for k, v in funcs.items()}
        for k in sorted(diff, key=lambda k: -diff[k])[:top]:
            calls, own, cum, _ = funcs[k]
            lines.append(f"  {diff[k]:+8.3f}  {calls:>7.0f} {own:>8.3f} {cum:>8.3f}  {k[:120]}")
        lines.append(f"{n}: this project's functions by cumulative ms per step (calls, own ms, cumulative ms):")
        ours = [k for k, v in funcs.items() if v[3]]
        for k in sorted(ours, key=lambda k: -funcs[k][2])[:top]:
            calls, own, cum, _ = funcs[k]
            lines.append(f"  {calls:>7.0f} {own:>8.3f} {cum:>8.3f}  {k[:120]}")
    return "\n".join(lines)


def by_category(kernels: dict[str, float]) -> dict[str, float]:
    """Kernel microseconds summed per category."""
    out = collections.Counter()
    for name, us in kernels.items():
        out[category(name)] += us
    return dict(out)


def report(results: dict[str, tuple[float, dict[str, float], float]], top: int) -> str:
    """The table (ms per step) of every variant and category, with differences to bf16 and the top kernels."""
    names = list(results)
    cats = [c for c, _ in CATEGORIES] + ["other"]
    base = results.get("bf16")
    lines = [f"{'ms per step':<22}" + "".join(f"{n:>14}" for n in names)]

    def row(label, values):
        lines.append(f"{label:<22}" + "".join(f"{v:>14.2f}" for v in values))

    row("step (no profiler)", [results[n][0] for n in names])
    row("GPU busy", [results[n][2] / 1e3 for n in names])
    row("GPU idle", [results[n][0] - results[n][2] / 1e3 for n in names])
    cat_ms = {n: by_category(results[n][1]) for n in names}
    for c in cats:
        if any(cat_ms[n].get(c, 0) > 0 for n in names):
            row(c, [cat_ms[n].get(c, 0.0) / 1e3 for n in names])
    if base is None:
        return "\n".join(lines)
    for n in names:
        if n == "bf16":
            continue
        lines.append(f"\n{n} - bf16, ms per step: step {results[n][0] - base[0]:+.2f}, GPU busy "
                     f"{(results[n][2] - base[2]) / 1e3:+.2f}; the kernels that differ most:")
        diff = {k: results[n][1].get(k, 0.0) - base[1].get(k, 0.0) for k in set(results[n][1]) | set(base[1])}
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[:top]:
            lines.append(f"  {diff[k] / 1e3:+8.3f}  [{category(k)}] {k[:110]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Profiles each variant's step in ``--profile-mode`` and prints the kernel table (and the host report)."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile-mode", choices=bench.MODES, default="re-quantize")
    p.add_argument("--top", type=int, default=12, help="kernels listed per quantized variant")
    p.add_argument("--host", type=int, default=0, help="also list this many Python functions (cProfile)")
    own, rest = p.parse_known_args(argv)
    args = bench.parse_args(rest + ["--modes", own.profile_mode])
    if not torch.cuda.is_available():
        raise SystemExit("profile_megatron_step.py needs a CUDA GPU")
    try:
        device = bench.init_distributed(args.seed)
        modes = {own.profile_mode: 1 if own.profile_mode == "re-quantize" else args.micro_batches}
        calib = bench.random_batches(args, args.calib_batches, device, args.seed + 1)
        steps = bench.Steps(modes, bench.random_batches(args, max(modes.values()), device, args.seed + 2),
                            bench.schedules())
        residency = bench.Residency(args.resident or None)
        variants = [bench.prepare(name, args, calib, steps, residency)[0] for name in dict.fromkeys(args.variants)
                    if name not in bench.MODELOPT_PRESETS or not bench.modelopt_unavailable(name)]
        results, hosts = {}, {}
        for variant in variants:
            residency.activate(variant)
            step = steps(variant, own.profile_mode)
            for _ in range(max(args.warmup, 1)):
                step()
            wall = statistics.median(bench.time_steps(step, 1) for _ in range(args.steps))
            kernels, busy = profile(step, args.steps)
            results[variant.name] = (wall, kernels, busy)
            if own.host:
                hosts[variant.name] = host_profile(step, args.steps)
        print(f"\n{bench.header(args, device, residency, len(variants))}\nmode {own.profile_mode} "
              f"({modes[own.profile_mode]} micro-batches per step), {args.steps} profiled steps per variant")
        print(report(results, own.top))
        if hosts:
            print(host_report(hosts, own.host))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
