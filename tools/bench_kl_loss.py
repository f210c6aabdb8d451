"""Benchmark: memory and time of the distillation KL (``logits_kl_loss``) forward + backward on bf16 logits, one
rank: its Triton kernels (``kernel``, on CUDA) and its torch reference chunked over tokens (``chunked``), against the
whole-tensor formula it replaced (fp32 logits, exponentials and softmaxes of ``[tokens, vocab]``, both softmaxes saved
for the backward). Prints a table; works on CPU (no kernel row) and GPU.

* peak: the most memory allocated during forward + backward above the two logits tensors and the gradient (one
  logits tensor), in GiB and in units of one logits tensor. GPU: ``torch.cuda.max_memory_allocated``; CPU: the
  allocations ``torch.profiler`` records (``profile_memory=True``), summed in time order.
* time: median of ``--repeats`` forward + backward after one warm-up (without the profiler), in rounds that run every
  implementation once on the same logits.
* ``--top-k`` / ``--top-p``: the error of the top-k or top-p (nucleus) teacher distribution against the exact KL
  (loss and gradient) on synthetic logits: a Gaussian teacher of the given scale (its entropy is printed) and a
  student that is the teacher plus Gaussian noise of 0.3 (``--noise``), as a quantized copy of it would be; with the
  teacher's tokens kept per token (mean).

Usage: ``python tools/bench_kl_loss.py [--device cuda] [--tokens 4096,8192,16384,32768] [--vocab 151936,248320]
[--top-k 64,1024,4096] [--top-p 0.9,0.99]``; ``--quick`` for a few-second run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from modelopt_moe.distill import logits_kl_loss
from modelopt_moe.distill.losses import whole_tensor_kl
from modelopt_moe.kernels import kernels_available

GiB = 1 << 30


# "chunked": the torch reference, chunked over tokens; "kernel": the Triton kernels (CUDA only: the CPU interpreter
# is for exactness tests, not timings). On CUDA, logits_kl_loss's default is the kernel path.
IMPLS = {"whole-tensor": lambda s, t: whole_tensor_kl(s, t),
         "chunked": lambda s, t: logits_kl_loss(s, t, kernel="torch"),
         "kernel": lambda s, t: logits_kl_loss(s, t, kernel="triton")}


def impls_for(device: str) -> list[str]:
    """The implementations measured on ``device``: the kernel path where compiled Triton runs (CUDA)."""
    return [name for name in IMPLS if name != "kernel" or (device != "cpu" and kernels_available(device))]


def _step(impl, student, teacher):
    student.grad = None
    IMPLS[impl](student, teacher).sum().backward()


def _cpu_peak(fn) -> int:
    """Peak bytes allocated by ``fn`` on the CPU above what was allocated before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, n in events:
        current += n
        peak = max(peak, current)
    return peak


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _peak(impl: str, student, teacher, device: str) -> int:
    """Peak bytes allocated by one forward + backward above what was allocated before it (after a warm-up on GPU)."""
    if device == "cpu":
        return _cpu_peak(lambda: _step(impl, student, teacher))
    _step(impl, student, teacher)
    student.grad = None
    _sync(device)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(impl, student, teacher)
    _sync(device)
    return torch.cuda.max_memory_allocated() - start


def measure_all(impls: list[str], tokens: int, vocab: int, device: str = "cpu", repeats: int = 3) -> dict:
    """Peak memory above the logits and their gradient, and the median time of forward + backward, of each KL
    implementation on the same random bf16 logits ``[tokens, vocab]``: the peaks one implementation at a time, the
    times in ``repeats`` rounds that run every implementation once (so drifts of a shared machine hit all alike).
    ``{"oom": True}`` for an implementation that does not fit."""
    g = torch.Generator(device=device).manual_seed(0)
    student = (torch.randn(tokens, vocab, generator=g, device=device) * 3).bfloat16().requires_grad_(True)
    teacher = (torch.randn(tokens, vocab, generator=g, device=device) * 3).bfloat16()
    logits_bytes = student.numel() * student.element_size()
    out, times = {}, {}
    for impl in impls:
        try:
            above = _peak(impl, student, teacher, device) - logits_bytes  # the gradient is one logits tensor
            out[impl] = {"oom": False, "peak_gib": above / GiB, "x_logits": above / logits_bytes}
            times[impl] = []
        except torch.OutOfMemoryError:
            out[impl] = {"oom": True}
            torch.cuda.empty_cache()
        finally:
            student.grad = None
    for _ in range(repeats):
        for impl in times:
            _sync(device)
            t0 = time.perf_counter()
            _step(impl, student, teacher)
            _sync(device)
            times[impl].append(time.perf_counter() - t0)
            student.grad = None
    for impl, ts in times.items():
        out[impl]["ms"] = 1e3 * statistics.median(ts)
    return out


def measure(impl: str, tokens: int, vocab: int, device: str = "cpu", repeats: int = 3) -> dict:
    """:func:`measure_all` of one implementation."""
    return measure_all([impl], tokens, vocab, device, repeats)[impl]


def truncation_error(tokens: int, vocab: int, scale: float, noise: float, device: str = "cpu", *,
                     top_k: int | None = None, top_p: float | None = None) -> dict:
    """Relative error of the top-k or top-p KL against the exact one: of the mean loss and of the gradient (L2
    norms); and the teacher's tokens the truncation keeps, per token (mean)."""
    g = torch.Generator(device=device).manual_seed(1)
    teacher = torch.randn(tokens, vocab, generator=g, device=device) * scale
    student = teacher + torch.randn(tokens, vocab, generator=g, device=device) * noise
    out = {}
    for name, kw in (("exact", {}), ("truncated", {"top_k": top_k, "top_p": top_p})):
        s = student.bfloat16().requires_grad_(True)
        loss = logits_kl_loss(s, teacher.bfloat16(), **kw)
        loss.sum().backward()
        out[name] = (float(loss.detach().mean()), s.grad.float())
    entropy = -(torch.softmax(teacher, -1) * torch.log_softmax(teacher, -1)).sum(-1).mean()
    (kl, grad), (kl_t, grad_t) = out["exact"], out["truncated"]
    kept = float(_kept(teacher.bfloat16().double(), top_k, top_p).float().mean())
    return {"entropy": float(entropy), "kl": kl, "kl_k": kl_t, "loss_err": abs(kl_t - kl) / kl,
            "grad_err": float((grad_t - grad).norm() / grad.norm()), "kept": kept}


def _kept(teacher: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Per token, the teacher's tokens a top-k or top-p truncation keeps (ties with the last kept included), counted
    in float64 from the sorted probabilities."""
    if top_k is not None:
        edge = teacher.topk(top_k, dim=-1).values[:, -1:]
    else:
        sorted_q, order = torch.softmax(teacher, -1).sort(-1, descending=True)
        last = (sorted_q.cumsum(-1) < top_p).sum(-1, keepdim=True).clamp(max=teacher.shape[-1] - 1)
        edge = teacher.gather(-1, order.gather(-1, last))
    return (teacher >= edge).sum(-1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> None:
    """Prints the memory and time table, then the top-k and top-p error tables when `--top-k` / `--top-p` are
    given."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=_ints, default=None, help="comma-separated (default: 4k-32k on GPU, 256,512 "
                   "on CPU)")
    p.add_argument("--vocab", type=_ints, default=[151936, 248320], help="comma-separated (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top-k", type=_ints, default=[], help="comma-separated k: the top-k error table")
    p.add_argument("--top-p", type=lambda text: [float(x) for x in text.split(",") if x], default=[],
                   help="comma-separated p: the top-p error table")
    p.add_argument("--top-k-tokens", type=int, default=256, help="tokens of the top-k and top-p tables")
    p.add_argument("--scales", type=float, nargs="+", default=[3.0, 6.0], help="teacher logit scales (top-k and "
                   "top-p tables)")
    p.add_argument("--noise", type=float, default=0.3)
    p.add_argument("--quick", action="store_true", help="a few-second run: 64 tokens x 32768 vocabulary")
    args = p.parse_args(argv)
    tokens = args.tokens or ([4096, 8192, 16384, 32768] if args.device != "cpu" else [256, 512])
    vocabs = args.vocab
    if args.quick:
        tokens, vocabs, args.repeats, args.top_k_tokens = [64], [32768], 1, 16
    name = torch.cuda.get_device_name() if args.device != "cpu" else f"CPU, {torch.get_num_threads()} threads"
    print(f"logits_kl_loss forward + backward, bf16 logits, one rank ({name}, torch {torch.__version__})")
    print("peak: memory allocated above the two logits tensors and the gradient")
    print(f"{'tokens':>7} {'vocab':>7} {'impl':>12} {'peak GiB':>9} {'x logits':>9} {'ms':>9} {'time vs whole':>14}")
    for vocab in vocabs:
        for n in tokens:
            rows = measure_all(impls_for(args.device), n, vocab, args.device, args.repeats)
            for impl, r in rows.items():
                if r["oom"]:
                    print(f"{n:>7} {vocab:>7} {impl:>12} {'OOM':>9}")
                    continue
                ref = rows["whole-tensor"]
                ratio = "" if ref["oom"] else f"{r['ms'] / ref['ms']:.2f}x"
                print(f"{n:>7} {vocab:>7} {impl:>12} {r['peak_gib']:>9.3f} {r['x_logits']:>9.3f} {r['ms']:>9.1f} "
                      f"{ratio:>14}", flush=True)
    for kind, values in (("k", args.top_k), ("p", args.top_p)):
        if not values:
            continue
        print(f"\ntop-{kind} teacher distribution against the exact KL ({args.top_k_tokens} tokens, student = "
              f"teacher + N(0, {args.noise}^2))")
        print(f"{'vocab':>7} {'scale':>6} {'entropy':>8} {kind:>6} {'kept':>9} {'exact KL':>9} {f'top-{kind} KL':>9} "
              f"{'loss err':>9} {'grad err':>9}")
        for vocab in vocabs:
            for scale in args.scales:
                for v in values:
                    e = truncation_error(args.top_k_tokens, vocab, scale, args.noise, args.device,
                                         **{f"top_{kind}": v})
                    print(f"{vocab:>7} {scale:>6.1f} {e['entropy']:>8.2f} {v:>6g} {e['kept']:>9.1f} {e['kl']:>9.4f} "
                          f"{e['kl_k']:>9.4f} {e['loss_err']:>9.2%} {e['grad_err']:>9.2%}", flush=True)


if __name__ == "__main__":
    main()
