"""The ``modelopt-moe`` console script: ``demo`` (the default) and ``export``.

``modelopt-moe export --checkpoint DIR --format compressed-tensors|modelopt --out DIR`` reads a distributed checkpoint
saved by ``modelopt_moe.plugins.megatron.save_sharded_checkpoint`` at any TP / EP layout (the model it rebuilds is
recorded beside it by ``modelopt_moe.export.save_hf_config``, or given with ``--hf-config``) and writes a servable
Hugging Face checkpoint, with a progress bar per layer (see docs/export.md).

``modelopt-moe demo [flags]`` (or just ``modelopt-moe [flags]``, or ``make demo``): quantize a real Megatron-Core
MoE GPT on N CPU processes (gloo) and compare its loss. It spawns ``--world-size`` processes (default 4: TP=2,
EP=2), builds a small Megatron-Core MoE GPT with ``SequentialMLP`` experts, trains it
for a few steps on real English text (byte-level, ``pydoc_data.topics`` from the standard library) so the loss
means something, measures the LM loss on held-out batches, quantizes with
``mtq.quantize(model, mtq.load_config(path), forward_loop)`` (max calibration on ``--num-calib-batches``
batches), prints ``mtq.print_quant_summary(model)`` and the loss before and after quantization (rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from modelopt_moe.launch import spawn

DEFAULT_CONFIG = "configs/fp8_per_expert.yaml"
_DEMO_DESCRIPTION = "The demo: quantize a real Megatron-Core MoE GPT on N CPU processes (gloo) and compare its loss."

# Disjoint sample ranges of the corpus for training, calibration and evaluation (text_batches offsets, in samples).
_TRAIN_OFFSET, _CALIB_OFFSET, _EVAL_OFFSET = 0, 4000, 6000


def check_layout(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--tp`` and ``--ep`` must divide ``--world-size`` (an argparse error otherwise)."""
    for name in ("tp", "ep"):
        size = getattr(args, name)
        if size < 1 or args.world_size % size:
            p.error(f"--{name} {size} must be >= 1 and divide --world-size {args.world_size}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelopt-moe [demo]", description=_DEMO_DESCRIPTION,
                                epilog="Other command: modelopt-moe export (see modelopt-moe export --help).")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="quantization config YAML; a bare file name also finds the shipped presets "
                        "(default: %(default)s)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: %(default)s)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (default: %(default)s)")
    p.add_argument("--world-size", type=int, default=4, help="number of processes (default: %(default)s)")
    p.add_argument("--num-calib-batches", type=int, default=8, help="calibration batches (default: %(default)s)")
    p.add_argument("--num-eval-batches", type=int, default=4, help="evaluation batches (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=30,
                   help="Adam steps before quantizing, so the model is not random (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence (default: %(default)s)")
    p.add_argument("--num-experts", type=int, default=4, help="experts per MoE layer (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234, help="weight seed (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run (default: %(default)s)")
    args = p.parse_args(argv)
    check_layout(p, args)
    if args.num_experts % args.ep:
        p.error(f"--num-experts {args.num_experts} must be a multiple of --ep {args.ep}")
    if args.seq_len % args.tp:
        p.error(f"--seq-len {args.seq_len} must be a multiple of --tp {args.tp} (sequence parallelism)")
    for name in ("num_calib_batches", "num_eval_batches", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.train_steps < 0:
        p.error("--train-steps must be >= 0")
    return args


def _quiet() -> None:
    """Keep the demo's output readable: Megatron warns about GPU-only settings and deprecations on every rank."""
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)


@contextlib.contextmanager
def _gpus_hidden() -> Iterator[None]:
    """Hide GPUs from the processes started inside (they inherit the environment), then restore it.

    The demo is a CPU/gloo run: on a GPU machine Megatron would otherwise place the model on the GPU, which the
    gloo collectives and four ranks sharing one device do not support.
    """
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _demo_rank(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of the demo; every rank runs the same collectives, rank 0 prints."""
    _quiet()
    import torch

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.testing import megatron_models as mm

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    bs, seq = opts["batch_size"], opts["seq_len"]
    mm.init_model_parallel(opts["tp"], opts["ep"], seed=opts["seed"])
    model = mm.build_moe_gpt(num_experts=opts["num_experts"], seq_len=seq, seed=opts["seed"])
    layout = mm.parallel_layout()
    say(f"Megatron-Core MoE GPT: {sum(p.numel() for p in model.parameters())} parameters on rank 0, "
        f"TP={layout['tp']} EP={layout['ep']} DP={layout['dp']}, {opts['num_experts']} experts")

    if opts["train_steps"]:
        # Every rank sees the same batches, so data-parallel replicas compute identical gradients and stay equal
        # without an all-reduce; only the sequence-parallel parameters need their TP reduction.
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        model.train()
        for i, batch in enumerate(mm.text_batches(bs, seq, opts["train_steps"], offset=_TRAIN_OFFSET)):
            opt.zero_grad(set_to_none=True)
            loss = mm.lm_loss(model, batch)
            loss.backward()
            mm.allreduce_sequence_parallel_grads(model)
            opt.step()
            if i == 0 or (i + 1) % 10 == 0 or i + 1 == opts["train_steps"]:
                say(f"  train step {i + 1:3d}/{opts['train_steps']}: loss {loss.item():.4f}")
        del opt

    model.eval()
    eval_batches = mm.text_batches(bs, seq, opts["num_eval_batches"], offset=_EVAL_OFFSET)
    calib_batches = mm.text_batches(bs, seq, opts["num_calib_batches"], offset=_CALIB_OFFSET)

    @torch.no_grad()
    def eval_loss() -> float:
        return sum(mm.lm_loss(model, b).item() for b in eval_batches) / len(eval_batches)

    @torch.no_grad()
    def forward_loop(m: torch.nn.Module) -> None:
        for b in calib_batches:
            mm.lm_loss(m, b)

    loss_before = eval_loss()
    start = time.perf_counter()
    model = mtq.quantize(model, mtq.load_config(opts["config"]), forward_loop)
    quant_s = time.perf_counter() - start
    mtq.print_quant_summary(model)  # prints on rank 0 only; every rank calls it (no rank-dependent branches)
    loss_after = eval_loss()
    mm.destroy_model_parallel()
    return {"loss_before": loss_before, "loss_after": loss_after, "quantize_s": quant_s}


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``modelopt-moe``): ``export ...``, ``demo ...`` or the demo's flags alone; returns the
    process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:
        from modelopt_moe.plugins.export_cli import export_main

        return export_main(argv[1:])
    return demo_main(argv[1:] if argv[:1] == ["demo"] else argv)


def demo_main(argv: list[str] | None = None) -> int:
    """``modelopt-moe demo``; returns the process exit code."""
    args = _parse_args(argv)
    # Only the import is silenced here: main() may run inside another program (tests), whose warning filters and
    # loggers must stay as they were. The ranks are fresh processes and silence themselves (_quiet).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt_moe.quantization as mtq

    try:  # validate the config here, before starting processes, so a typo fails fast with a clear message
        mtq.load_config(args.config)
    except mtq.ConfigError as e:
        print(f"modelopt-moe: {e}", file=sys.stderr)
        return 2
    print(f"modelopt-moe demo: config {args.config}, {args.world_size} gloo processes (TP={args.tp}, EP={args.ep}), "
          f"{args.num_calib_batches} calibration batches of {args.batch_size}x{args.seq_len} bytes", flush=True)
    opts = {k: getattr(args, k) for k in (
        "config", "tp", "ep", "num_calib_batches", "num_eval_batches", "train_steps", "batch_size", "seq_len",
        "num_experts", "seed")}
    # Under `python -m modelopt_moe.plugins.cli` this file runs as `__main__`, which spawned children do not
    # re-import: hand them the function through its importable module name instead.
    rank_fn = importlib.import_module("modelopt_moe.plugins.cli")._demo_rank
    with _gpus_hidden():
        results = spawn(rank_fn, args.world_size, args=(opts,), timeout=args.timeout)
    r0 = results[0]
    # The LM loss is computed by Megatron's vocab-parallel cross-entropy: every rank must report the same number.
    spread = max(abs(r["loss_after"] - r0["loss_after"]) for r in results)
    print(f"\nquantized in {r0['quantize_s']:.1f} s (calibration on {args.num_calib_batches} batches)")
    print(f"eval LM loss (nats/byte) before quantization: {r0['loss_before']:.4f}")
    print(f"eval LM loss (nats/byte) after  quantization: {r0['loss_after']:.4f} "
          f"({r0['loss_after'] - r0['loss_before']:+.4f})")
    if spread > 1e-4:
        print(f"warning: ranks disagree on the loss by {spread:.2e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
