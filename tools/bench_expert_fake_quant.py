"""Benchmark: fake quant of all N expert weights (GPU). Prints a table; finishes in about a minute on an H200.

For each configuration it times (median, ``triton.testing.do_bench`` with L2 flushed between runs, rotating weight
sets) and compares with the measured device copy bandwidth (bytes read + written by a large ``copy_``):

* ``grouped``: :func:`modelopt_moe.kernels.grouped_weight_fake_quant`, one launch for all N experts; timed eagerly
  (includes Python validation and the N output views, which dominate at large N) and replayed from a CUDA graph
  (device time only);
* ``torch loop``: :func:`formats.fake_quant` per expert (what a Python loop over experts costs);
* ``compiled``: ``torch.compile(formats.fake_quant)`` on weights stacked beforehand ([N, R, K], amax [N, 1, 1]),
  the best a single generic fused kernel does (the stacking copy itself is not timed; formats with a calibrated
  amax only);
* ``Model Optimizer 0.47 loop`` (where ``modelopt`` imports): its own ``TensorQuantizer`` per expert for MXFP4,
  MXFP8 and FP8 128x128 blocks (its MX presets run its CUDA extension; static blocks are max-calibrated first), with
  the number of values that differ from ours.

Then NVFP4 with static block scales (``nvfp4 static``: each expert's ``[rows, K / 16]`` block amaxes, as the FP8
scale sweep or 4-over-6 leaves them): :func:`modelopt_moe.kernels.grouped_static_blocks_fake_quant`, eager and from a
CUDA graph, against ``NVFP4.fake_quant_static`` per expert (``torch loop``, the path such experts took before the
kernel); the bytes count the block amaxes read.

Then the tokens of N experts (``input`` rows): :func:`modelopt_moe.kernels.grouped_input_fake_quant` on one
``[T, K]`` matrix split unevenly over N experts, each expert's rows with its own amax, eager (host included) and
from a CUDA graph, against ``formats.fake_quant`` per expert on its rows (``torch loop``).

With ``--block2d-variants`` it times only the launch variants of the FP8 2-D block kernel
(:data:`modelopt_moe.kernels.fp8_block_fake_quant.BLOCK2D_VARIANTS`) on the 2-D block configurations: every variant
is built and checked bit for bit first (against the reference and the default variant), then all variants and a
torch copy of the same bytes are timed in alternating rounds (the order rotating each round), replayed from CUDA
graphs and eagerly (the launcher alone, host included); the table gives each variant's fraction of the copy (median
and range over the rounds, each round's copy against that round's variant), its registers, spills and shared memory.

Usage: ``python tools/bench_expert_fake_quant.py [--quick] [--sweep] [--block2d-variants [--rounds R]]``
(``--sweep`` also tries tile sizes and warp counts of the grouped kernel and prints the best).
"""

from __future__ import annotations

import argparse
import statistics

import torch

GiB = 1 << 30
CONFIGS = [  # (format, N, rows, cols, block size: None for the format's own scale layout, "channel" per row)
    ("e4m3", 32, 1536, 2048, None),
    ("e4m3", 128, 1536, 2048, None),
    ("e4m3", 128, 1536, 2048, "channel"),
    ("e4m3", 8, 28672, 4096, None),
    ("e4m3", 256, 512, 1024, None),
    ("nvfp4", 128, 1536, 2048, None),
    ("nvfp4_four_over_six", 128, 1536, 2048, None),
    ("mxfp4", 128, 1536, 2048, None),
    ("mxfp8", 128, 1536, 2048, None),
    ("e4m3", 128, 1536, 2048, (128, 128)),
    ("e4m3", 8, 28672, 4096, (128, 128)),
]
INPUT_CONFIGS = [  # (format, N, tokens, features, block size)
    ("e4m3", 128, 32768, 2048, None),
    ("e4m3", 128, 4096, 2048, None),
    ("nvfp4", 128, 32768, 2048, None),
    ("nvfp4_four_over_six", 128, 32768, 2048, None),
    ("mxfp4", 128, 32768, 2048, None),
    ("mxfp8", 128, 32768, 2048, None),
    ("e4m3", 128, 32768, 2048, 128),
]
STATIC_CONFIGS = [  # NVFP4 with static block scales: (N, rows, cols)
    (128, 1536, 2048),
    (32, 1536, 2048),
]
# Formats whose scales come from the data (no calibrated amax): MX, and FP8 with a block size.
DYNAMIC = ("mxfp4", "mxfp8")
# Model Optimizer 0.47's quantizer attributes for the same formats (its presets' shapes), for its per-expert loop.
MODELOPT_ATTRS = {
    ("mxfp4", None): {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    ("mxfp8", None): {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    ("e4m3", (128, 128)): {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}},
}


def label(fmt: str, block) -> str:
    """A configuration's format as the table names it (``e4m3 128x128``: FP8 in 2-D blocks)."""
    if block is None:
        return fmt
    if block == "channel":
        return f"{fmt} per channel"
    return f"{fmt} " + ("x".join(map(str, block)) if isinstance(block, tuple) else f"1x{block}")


def data_scaled(fmt: str, block) -> bool:
    """Whether the format takes no amax (its scales come from each block of the data)."""
    return fmt in DYNAMIC or block not in (None, "channel")


def modelopt_loop(fmt: str, block, weights):
    """Model Optimizer 0.47's fake quant of each expert with its own ``TensorQuantizer`` (static blocks calibrated
    first, by its max calibrator), as a no-argument call; None where it is not importable or has no such format."""
    attrs = MODELOPT_ATTRS.get((fmt, block))
    if attrs is None:
        return None
    try:
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer
    except ImportError:
        return None
    quantizers = [TensorQuantizer(QuantizerAttributeConfig(**attrs)).cuda() for _ in weights]
    with torch.no_grad():
        if "type" not in attrs["block_sizes"]:  # static blocks: max-calibrate each expert's block amaxes
            for q, w in zip(quantizers, weights, strict=True):
                q.disable_quant()
                q.enable_calib()
                q(w)
                q.load_calib_amax()
                q.enable_quant()
                q.disable_calib()

    def call(ws):
        with torch.no_grad():
            return [q(w) for q, w in zip(quantizers, ws, strict=True)]
    return call


def bench(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` (do_bench flushes L2 before every call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(GiB, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def make_sets(n: int, rows: int, cols: int, max_bytes: int = 3 * GiB):
    """As many weight sets (lists of N separate tensors) as fit in ``max_bytes`` (at least 1, at most 3)."""
    set_bytes = n * rows * cols * 2
    n_sets = max(1, min(3, max_bytes // set_bytes))
    sets = []
    for s in range(n_sets):
        g = torch.Generator(device="cuda").manual_seed(s)
        sets.append([torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g) * (1 + i % 7)
                     for i in range(n)])
    amax = torch.stack([w.float().abs().amax() for w in sets[0]])
    return sets, amax


def rotating(fn, sets):
    """A no-argument call of ``fn`` on the next of ``sets`` each time (so no set stays in L2 between calls)."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(sets[state["i"]])

    return call


def eager_and_graph(fn, arg_sets) -> dict[str, float]:
    """Median ms of ``fn`` called eagerly (host included) and replayed from CUDA graphs (device time only: no
    Python checks or view creation), rotating over ``arg_sets``."""
    results = {"grouped (eager, host-inclusive)": bench(rotating(fn, arg_sets))}
    graphs = graphs_of(fn, arg_sets)
    results["grouped (CUDA graph replay)"] = bench(rotating(lambda g: g.replay(), graphs))
    return results


def table_rows(name: str, results: dict[str, float], nbytes: int, bw: float) -> list[tuple]:
    """One row per method of ``results`` (median ms): the config, the method, ms, GB/s and the fraction of copy
    bandwidth ``bw``, for ``nbytes`` moved per call."""
    return [(name, method, ms, nbytes / (ms * 1e-3) / 1e9, nbytes / (ms * 1e-3) / bw) for method, ms in results.items()]


def uneven_splits(n: int, tokens: int, seed: int = 0) -> list[int]:
    """``n`` split sizes summing to ``tokens``, uneven as a router's (some experts get none)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(n, generator=g) ** 3
    sizes = (weights / weights.sum() * tokens).floor().long()
    sizes[0] += tokens - int(sizes.sum())
    return sizes.tolist()


def bench_inputs(bw: float, quick: bool) -> list[tuple]:
    """Rows of the input (token) kernel: eager, CUDA graph and (without ``quick``) the per-expert torch loop."""
    from modelopt_moe.kernels import grouped_input_fake_quant
    from modelopt_moe.numerics import fake_quant

    rows_out = []
    for fmt, n, t, k, block in INPUT_CONFIGS:
        splits = uneven_splits(n, t)
        m = torch.tensor(splits, device="cuda")
        xs = [torch.randn(t, k, device="cuda", dtype=torch.bfloat16) * (1 + s) for s in range(3)]
        if data_scaled(fmt, block):
            amax = [None] * n
        else:
            amax = torch.stack([c.float().abs().amax() if c.numel() else torch.ones((), device="cuda")
                                for c in xs[0].split(splits)])
        nbytes = 2 * t * k * 2
        name = f"input {label(fmt, block)} N={n} [{t}x{k}]"

        def grouped(x, fmt=fmt, m=m, amax=amax, block=block):
            return grouped_input_fake_quant(x, m, None if isinstance(amax, list) else amax, fmt, block)

        out = grouped(xs[0])
        for i in (0, n - 1):
            lo = sum(splits[:i])
            chunk = xs[0][lo:lo + splits[i]]
            assert torch.equal(out[lo:lo + splits[i]], fake_quant(chunk, fmt, amax[i], block)), f"{name}: expert {i}"
        results = eager_and_graph(grouped, xs)
        if not quick:
            def loop(x, fmt=fmt, splits=splits, amax=amax, block=block):
                return torch.cat([fake_quant(c, fmt, amax[i], block) for i, c in enumerate(x.split(splits))])

            results["torch loop"] = bench(rotating(loop, xs), rep_ms=100)
        rows_out += table_rows(name, results, nbytes, bw)
        del xs, out
        torch.cuda.empty_cache()
    return rows_out


def bench_static_blocks(bw: float, quick: bool) -> list[tuple]:
    """Rows of the table for NVFP4 with static block scales (the block amaxes at 0.5-1.5 of each block's max)."""
    from modelopt_moe.kernels import grouped_static_blocks_fake_quant
    from modelopt_moe.numerics.nvfp4 import NVFP4

    rows_out = []
    for n, r, k in STATIC_CONFIGS:
        sets, amax = make_sets(n, r, k)
        g = torch.Generator(device="cuda").manual_seed(0)
        blocks = torch.stack([w.float().abs().unflatten(-1, (-1, 16)).amax(-1) for w in sets[0]])
        blocks = blocks * (0.5 + torch.rand(blocks.shape, generator=g, device="cuda"))
        nbytes = 2 * n * r * k * 2 + blocks.numel() * 4  # bf16 read + write, fp32 block amaxes read
        name = f"nvfp4 static N={n} [{r}x{k}]"

        def grouped(ws, amax=amax, blocks=blocks):
            return grouped_static_blocks_fake_quant(ws, amax, blocks, "nvfp4", 448.0)

        out = grouped(sets[0])
        for i in (0, n - 1):
            ref = NVFP4.fake_quant_static(sets[0][i], amax[i], blocks[i])
            assert torch.equal(out[i], ref), f"{name}: expert {i} mismatch"
        results = eager_and_graph(grouped, sets)
        if not quick:
            def loop(ws, amax=amax, blocks=blocks):
                return [NVFP4.fake_quant_static(w, amax[i], blocks[i]) for i, w in enumerate(ws)]

            results["torch loop"] = bench(rotating(loop, sets), rep_ms=100)
        rows_out += table_rows(name, results, nbytes, bw)
        del sets, out
        torch.cuda.empty_cache()
    return rows_out


def graphs_of(fn, arg_sets) -> list:
    """One CUDA graph of ``fn`` per argument set (each called once first, outside capture)."""
    graphs = []
    for args in arg_sets:
        fn(args)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(args)
        graphs.append(g)
    return graphs


def bench_block2d_variants(rounds: int, rep_ms: int = 40) -> None:
    """Times every launch variant of the FP8 2-D block kernel against a torch copy of the same bytes, in alternating
    rounds, and prints a table per configuration and the best variant in a CUDA graph."""
    from modelopt_moe.kernels import fp8_block_fake_quant as fb
    from modelopt_moe.numerics import fake_quant

    names = list(fb.BLOCK2D_VARIANTS)
    worst = {name: float("inf") for name in names}  # the lowest median graph fraction over the configurations
    for fmt, n, r, k, block in [c for c in CONFIGS if isinstance(c[4], tuple)]:
        sets, _ = make_sets(n, r, k)
        name_cfg = f"{label(fmt, block)} N={n} [{r}x{k}]"
        calls = {}
        resources = {}
        default = fb.weight_blocks_fake_quant(sets[0], fmt, block, variant=fb.BLOCK2D_DEFAULT)
        for i in (0, n - 1):
            lo = i * r * k
            assert torch.equal(default[lo:lo + r * k].view(r, k), fake_quant(sets[0][i], fmt, None, block)), \
                f"{name_cfg}: default variant, expert {i}"
        for name in names:  # build (compile, check, capture) every variant before any timing
            def fn(ws, name=name, fmt=fmt, block=block):
                return fb.weight_blocks_fake_quant(ws, fmt, block, variant=name)

            assert torch.equal(fn(sets[0]), default), f"{name_cfg}: variant {name} differs from the default"
            resources[name] = fb.block2d_resources(sets[0], fmt, block, name) or {}
            calls[name] = (rotating(fn, sets), rotating(lambda g: g.replay(), graphs_of(fn, sets)))
        srcs = [torch.cat([w.reshape(-1) for w in ws]) for ws in sets[:2]]  # the same bytes, contiguous
        dst = torch.empty_like(srcs[0])

        def copy(src, dst=dst):
            return dst.copy_(src)

        copy_calls = (rotating(copy, srcs), rotating(lambda g: g.replay(), graphs_of(copy, srcs)))
        fracs = {(name, mode): [] for name in names for mode in (0, 1)}
        ms = {(name, mode): [] for name in names for mode in (0, 1)}
        copy_ms = {0: [], 1: []}
        for rnd in range(rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for mode in (1, 0):  # graph, eager
                c = bench(copy_calls[mode], rep_ms)
                copy_ms[mode].append(c)
                for name in order:
                    t = bench(calls[name][mode], rep_ms)
                    ms[(name, mode)].append(t)
                    fracs[(name, mode)].append(c / t)
        med = statistics.median
        print(f"\n2-D block kernel variants, {name_cfg}: {rounds} alternating rounds; fraction of a torch copy of the "
              f"same bytes (graph {med(copy_ms[1]):.3f} ms, eager {med(copy_ms[0]):.3f} ms), median [min-max]")
        print(f"{'variant':<32} {'chunk':>5} {'warps':>5} {'prog/SM':>7} {'stages':>6} {'regs':>5} {'spills':>6} "
              f"{'smem':>7} {'graph':>18} {'graph ms':>9} {'eager':>18} {'eager ms':>9}")
        for name in names:
            v, res = fb.BLOCK2D_VARIANTS[name], resources[name]
            cols = []
            for mode in (1, 0):
                f = fracs[(name, mode)]
                cols.append(f"{med(f):.2f} [{min(f):.2f}-{max(f):.2f}]")
                cols.append(f"{med(ms[(name, mode)]):.3f}")
            worst[name] = min(worst[name], med(fracs[(name, 1)]))
            mark = " (default)" if name == fb.BLOCK2D_DEFAULT else ""
            print(f"{name + mark:<32} {v.chunk or 'all':>5} {v.warps:>5} {v.programs_per_sm:>7} {v.stages:>6} "
                  f"{res.get('n_regs', '?'):>5} {res.get('n_spills', '?'):>6} {res.get('shared', '?'):>7} "
                  f"{cols[0]:>18} {cols[1]:>9} {cols[2]:>18} {cols[3]:>9}")
        del sets, srcs, dst, calls, copy_calls, default
        fb.clear_block_tables()
        torch.cuda.empty_cache()
    best = max(names, key=worst.get)
    print(f"\nbest in a CUDA graph (highest lowest-over-configurations median): {best} ({worst[best]:.2f} of copy); "
          f"to make it the default: BLOCK2D_DEFAULT = {best!r} in modelopt_moe/kernels/fp8_block_fake_quant.py")


def main() -> None:
    """Spot-checks the grouped kernel against the reference, then times every configuration and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the grouped kernel (no torch baselines)")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile size / num_warps of the grouped kernel")
    parser.add_argument("--block2d-variants", action="store_true",
                        help="only the launch variants of the FP8 2-D block kernel, in alternating rounds")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --block2d-variants (default 5)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    from modelopt_moe.kernels import clear_table_cache, grouped_weight_fake_quant, kernels_available, tuning
    from modelopt_moe.numerics import fake_quant

    if not kernels_available("cuda"):
        raise SystemExit("Triton kernels unavailable on CUDA (is TRITON_INTERPRET=1 set?)")
    if args.block2d_variants:
        print(f"device: {torch.cuda.get_device_name()}")
        bench_block2d_variants(args.rounds)
        return
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    compiled = torch.compile(fake_quant, dynamic=True)

    rows_out = []
    for fmt, n, r, k, block in CONFIGS:
        sets, amax = make_sets(n, r, k)
        name = f"{label(fmt, block)} N={n} [{r}x{k}]"
        if block == "channel":  # one amax per row: [N, rows] for the kernel, [rows, 1] per expert
            amax, block = torch.stack([w.float().abs().amax(dim=1) for w in sets[0]]), None
        amax_i = [None] * n if data_scaled(fmt, block) else [a.unsqueeze(-1) if a.dim() else a for a in amax]
        amax_all = None if data_scaled(fmt, block) else amax
        nbytes = 2 * n * r * k * 2  # bf16 read + write

        def grouped(ws, fmt=fmt, amax=amax_all, block=block):
            return grouped_weight_fake_quant(ws, amax, fmt, block)

        # Correctness spot check against the reference before timing.
        out = grouped(sets[0])
        for i in (0, n - 1):
            assert torch.equal(out[i], fake_quant(sets[0][i], fmt, amax_i[i], block)), f"{name}: expert {i} mismatch"
        results = eager_and_graph(grouped, sets)
        if args.sweep:
            best = None
            for tile in (1024, 2048, 4096, 8192):
                for warps in (2, 4, 8):
                    tuning.set_weight_kernel_config("*", tile=tile, warps=warps)
                    clear_table_cache()
                    t = bench(rotating(grouped, sets), rep_ms=100)
                    print(f"    sweep {name}: tile {tile:6d} warps {warps}: {t:.3f} ms  "
                          f"{nbytes / (t * 1e-3) / bw:.3f} of copy")
                    best = min(best or (t, tile, warps), (t, tile, warps))
            tuning.reset_weight_kernel_config()
            clear_table_cache()
            print(f"    best: tile {best[1]} warps {best[2]}: {best[0]:.3f} ms")
        if not args.quick:
            def loop(ws, fmt=fmt, amax=amax_i, block=block):
                return [fake_quant(w, fmt, amax[i], block) for i, w in enumerate(ws)]

            results["torch loop"] = bench(rotating(loop, sets), rep_ms=100)
            theirs = modelopt_loop(fmt, block, sets[0])
            if theirs is not None:
                differ = sum(int((a != b).sum()) for a, b in zip(theirs(sets[0]), out, strict=True))
                results[f"Model Optimizer 0.47 loop [{differ} values differ]"] = bench(rotating(theirs, sets[:1]),
                                                                                       rep_ms=100)
            if not data_scaled(fmt, block):
                stacked = [torch.stack(ws) for ws in sets[:1]]  # one stacked set (memory); L2 is flushed anyway
                amax3 = amax.view(n, -1, 1)

                def comp(ws, fmt=fmt, amax3=amax3):
                    return compiled(ws, fmt, amax3)

                got = comp(stacked[0])  # compiles outside the timing
                # Inductor does not promise formats.py's bits (it may fuse or reorder): report, do not assert.
                mismatch = (got != torch.stack(out)).float().mean().item()
                results[f"compiled (pre-stacked) [{mismatch:.1e} bits differ]"] = bench(rotating(comp, stacked))
                del stacked
        rows_out += table_rows(name, results, nbytes, bw)
        del sets, out
        torch.cuda.empty_cache()

    rows_out += bench_static_blocks(bw, args.quick)
    input_rows = bench_inputs(bw, args.quick)
    print(f"\n{'config':<40} {'method':<48} {'median ms':>10} {'GB/s':>8} {'of copy':>8}")
    for name, method, ms, gbs, frac in rows_out + input_rows:
        print(f"{name:<40} {method:<48} {ms:>10.3f} {gbs:>8.0f} {frac:>8.2f}")
    for what, rows in (("weight", rows_out), ("input", input_rows)):
        for kind in ("eager", "CUDA graph"):
            fracs = [f for _, m, _, _, f in rows if m.startswith("grouped") and kind in m]
            print(f"grouped {what} kernel ({kind}): median {statistics.median(fracs):.2f} of copy bandwidth")


if __name__ == "__main__":
    main()
