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

Usage: ``python tools/bench_expert_fake_quant.py [--quick] [--sweep]`` (``--sweep`` also tries tile sizes and warp
counts of the grouped kernel and prints the best).
"""

from __future__ import annotations

import argparse
import statistics

import torch

GiB = 1 << 30
CONFIGS = [  # (format, N, rows, cols, block size: None for the format's own scale layout)
    ("e4m3", 32, 1536, 2048, None),
    ("e4m3", 128, 1536, 2048, None),
    ("e4m3", 8, 28672, 4096, None),
    ("e4m3", 256, 512, 1024, None),
    ("nvfp4", 128, 1536, 2048, None),
    ("mxfp4", 128, 1536, 2048, None),
    ("mxfp8", 128, 1536, 2048, None),
    ("e4m3", 128, 1536, 2048, (128, 128)),
    ("e4m3", 8, 28672, 4096, (128, 128)),
]
INPUT_CONFIGS = [  # (format, N, tokens, features, block size)
    ("e4m3", 128, 32768, 2048, None),
    ("e4m3", 128, 4096, 2048, None),
    ("nvfp4", 128, 32768, 2048, None),
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
    return f"{fmt} " + ("x".join(map(str, block)) if isinstance(block, tuple) else f"1x{block}")


def data_scaled(fmt: str, block) -> bool:
    """Whether the format takes no amax (its scales come from each block of the data)."""
    return fmt in DYNAMIC or block is not None


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
    graphs = []
    for args in arg_sets:
        fn(args)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(args)
        graphs.append(g)
    results["grouped (CUDA graph replay)"] = bench(rotating(lambda g: g.replay(), graphs))
    return results


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
        for method, ms in results.items():
            rows_out.append((name, method, ms, nbytes / (ms * 1e-3) / 1e9, nbytes / (ms * 1e-3) / bw))
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
        for method, ms in results.items():
            rows_out.append((name, method, ms, nbytes / (ms * 1e-3) / 1e9, nbytes / (ms * 1e-3) / bw))
        del sets, out
        torch.cuda.empty_cache()
    return rows_out


def main() -> None:
    """Spot-checks the grouped kernel against the reference, then times every configuration and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the grouped kernel (no torch baselines)")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile size / num_warps of the grouped kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    from modelopt_moe.kernels import clear_table_cache, grouped_weight_fake_quant, kernels_available, tuning
    from modelopt_moe.numerics import fake_quant

    if not kernels_available("cuda"):
        raise SystemExit("Triton kernels unavailable on CUDA (is TRITON_INTERPRET=1 set?)")
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    compiled = torch.compile(fake_quant, dynamic=True)

    rows_out = []
    for fmt, n, r, k, block in CONFIGS:
        sets, amax = make_sets(n, r, k)
        amax_i = [None] * n if data_scaled(fmt, block) else amax
        amax_all = None if data_scaled(fmt, block) else amax
        nbytes = 2 * n * r * k * 2  # bf16 read + write
        name = f"{label(fmt, block)} N={n} [{r}x{k}]"

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
                amax3 = amax.view(-1, 1, 1)

                def comp(ws, fmt=fmt, amax3=amax3):
                    return compiled(ws, fmt, amax3)

                got = comp(stacked[0])  # compiles outside the timing
                # Inductor does not promise formats.py's bits (it may fuse or reorder): report, do not assert.
                mismatch = (got != torch.stack(out)).float().mean().item()
                results[f"compiled (pre-stacked) [{mismatch:.1e} bits differ]"] = bench(rotating(comp, stacked))
                del stacked
        for method, ms in results.items():
            rows_out.append((name, method, ms, nbytes / (ms * 1e-3) / 1e9, nbytes / (ms * 1e-3) / bw))
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
