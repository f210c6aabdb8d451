"""Tuning of the grouped weight fake-quant kernel (GPU): builds launch variants, checks each bit-exact against
``formats.fake_quant``, and times each on the shapes of ``tools/bench_expert_fake_quant.py`` (CUDA-graph replay,
L2 flushed, two rotating weight sets). Prints a table of the fraction of device copy bandwidth per variant.

Usage: ``python tools/tune_weight_kernel.py [--budget SECONDS] [--json PATH]``. Variants are option dicts for
``modelopt_moe.kernels.tuning.set_weight_kernel_config`` (see ``WEIGHT_KERNEL_DEFAULTS`` there); ``None`` is the
shipped configuration.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

GiB = 1 << 30
SHAPES = [  # (format, N, rows, cols): those of bench_expert_fake_quant.py
    ("e4m3", 32, 1536, 2048),
    ("e4m3", 128, 1536, 2048),
    ("e4m3", 8, 28672, 4096),
    ("e4m3", 256, 512, 1024),
    ("nvfp4", 128, 1536, 2048),
]
_BASE = {"tile": 4096, "warps": 4, "uniform": False, "even": False, "hw_cvt": False, "lean": False,
         "fast_max": False}  # the kernel before tuning
_U = {"uniform": True, "even": True}
_FAST = {**_U, "hw_cvt": True, "lean": True, "fast_max": True}
VARIANTS = {  # name -> overrides of _BASE (None: the shipped WEIGHT_KERNEL_DEFAULTS), most informative first
    "base": {},
    "fast": _FAST,
    "uni+even": _U,
    "uni+even+lean": {**_U, "lean": True},
    "fast t8192": {**_FAST, "tile": 8192},
    "fast t8192 w8": {**_FAST, "tile": 8192, "warps": 8},
    "fast t2048": {**_FAST, "tile": 2048},
    "fast t16384 w8": {**_FAST, "tile": 16384, "warps": 8},
    "uniform": {"uniform": True},
    "fast+search": {**_FAST, "uniform": False, "even": False},
    "base again": {},
    "shipped": None,
}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits, NaN at the same places matching whatever its payload."""
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return False
    iv = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return torch.equal(torch.where(an, 0, a).view(iv), torch.where(bn, 0, b).view(iv))


def adversarial_experts(dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """4 experts of [256 x 256]: every bf16 bit pattern (NaN, Inf, subnormals, ties at scale 1), random normals at
    two magnitudes with NaN/Inf/-0 planted, and a constant block; amax chosen to hit scale 1 and generic scales."""
    g = torch.Generator(device="cuda").manual_seed(123)
    allbits = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    e0 = allbits.to(dtype).view(256, 256)
    e1 = torch.randn(256, 256, device="cuda", generator=g).to(dtype)
    e1[3, 7], e1[5, 100], e1[9, 33], e1[10, 0] = float("nan"), float("inf"), -float("inf"), -0.0
    e2 = (torch.randn(256, 256, device="cuda", generator=g) * 1e-3).to(dtype)
    e3 = torch.full((256, 256), 0.75, device="cuda").to(dtype)
    e3[:, ::3] = -1.25
    amax = torch.tensor([448.0, 3.7, 2e-3, 1.0], device="cuda")
    return [e0.contiguous(), e1, e2, e3], amax


def check(fmt: str, grouped_weight_fake_quant, fake_quant) -> bool:
    """Whether the kernel's ``fmt`` output equals ``fake_quant``'s bit for bit on the adversarial experts."""
    ok = True
    for dtype in (torch.bfloat16,):
        ws, amax = adversarial_experts(dtype)
        for am in (amax, amax[:1].expand(4).contiguous() * 0 + 6.0):
            out = grouped_weight_fake_quant(ws, am, fmt)
            for i, w in enumerate(ws):
                ok &= bits_equal(out[i], fake_quant(w, fmt, am[i]))
    return ok


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted), as bench_expert_fake_quant.py measures."""
    import triton.testing

    src = torch.empty(GiB, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def main() -> None:
    """Checks every variant bit-exact, times the exact ones on each shape within ``--budget``, prints the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=150.0, help="seconds of timing before stopping")
    p.add_argument("--json", default=None)
    p.add_argument("--variants", default=None, help="comma-separated subset of variant names")
    args = p.parse_args()
    import triton.testing

    from modelopt_moe.kernels import clear_table_cache, grouped_weight_fake_quant, tuning
    from modelopt_moe.numerics import fake_quant

    t_start = time.time()
    names = args.variants.split(",") if args.variants else list(VARIANTS)

    def set_variant(name):
        ov = VARIANTS[name]
        tuning.reset_weight_kernel_config()
        if ov is not None:
            tuning.set_weight_kernel_config("*", **{**_BASE, **ov})
        clear_table_cache()

    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)

    exact = {}
    for name in names:
        set_variant(name)
        t0 = time.time()
        exact[name] = all(check(fmt, grouped_weight_fake_quant, fake_quant) for fmt in ("e4m3", "e5m2", "nvfp4"))
        print(f"  check {name:<18} {'bit-exact' if exact[name] else 'MISMATCH'}  ({time.time() - t0:.1f} s)",
              flush=True)

    res: dict[str, dict[str, float]] = {n: {} for n in names}
    data = {}
    for _fmt, n, r, k in SHAPES:
        if (n, r, k) not in data:
            sets = []
            for s in range(2):
                g = torch.Generator(device="cuda").manual_seed(s)
                sets.append([torch.randn(r, k, device="cuda", dtype=torch.bfloat16, generator=g) * (1 + i % 7)
                             for i in range(n)])
            data[(n, r, k)] = (sets, torch.stack([w.float().abs().amax() for w in sets[0]]))
    for name in names:
        if time.time() - t_start > args.budget:
            print(f"  budget spent: {name} and later not timed", flush=True)
            break
        if not exact[name]:
            continue
        set_variant(name)
        for fmt, n, r, k in SHAPES:
            key = f"{fmt} {n}x[{r}x{k}]"
            sets, amax = data[(n, r, k)]
            nbytes = 4 * n * r * k
            out = grouped_weight_fake_quant(sets[0], amax, fmt)
            if not (bits_equal(out[0], fake_quant(sets[0][0], fmt, amax[0]))
                    and bits_equal(out[-1], fake_quant(sets[0][-1], fmt, amax[-1]))):
                print(f"  {key} {name}: MISMATCH on benchmark data", flush=True)
                exact[name] = False
                continue
            del out
            graphs = []
            for ws in sets:
                grouped_weight_fake_quant(ws, amax, fmt)
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    grouped_weight_fake_quant(ws, amax, fmt)
                graphs.append(gr)
            state = {"i": 0}

            def replay(graphs=graphs, state=state):
                state["i"] ^= 1
                graphs[state["i"]].replay()

            ms = triton.testing.do_bench(replay, warmup=10, rep=60, return_mode="median")
            res[name][key] = nbytes / (ms * 1e-3) / bw
            print(f"  {key:<24} {name:<18} {ms * 1e3:8.1f} us  {res[name][key]:.3f} of copy", flush=True)
            del graphs
            torch.cuda.empty_cache()

    keys = [f"{f} {n}x[{r}x{k}]" for f, n, r, k in SHAPES]
    print(f"\n{'variant':<18} {'exact':>5} " + " ".join(f"{k.split(' ')[0] + ' N=' + k.split(' ')[1].split('x')[0]:>10}"
                                               for k in keys))
    for name in names:
        row = " ".join(f"{res[name].get(k, float('nan')):>10.3f}" for k in keys)
        print(f"{name:<18} {'yes' if exact[name] else 'NO':>5} {row}")
    print(f"total {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bw": bw, "exact": exact, "res": res}, f, indent=1)


if __name__ == "__main__":
    main()
