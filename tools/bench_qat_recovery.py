"""Benchmark: how much of post-training quantization's loss do plain QAT and QAD win back in the same steps?

Trains a small Megatron MoE GPT in bf16 on the shipped English text (the teacher), then from its weights runs, for
the same steps, data and optimizer: bf16-continued, PTQ, plain QAT (LM loss) and QAD (KL to the frozen teacher), per
number format (NVFP4, FP8; experts quantized) and ``weight_amax_update``; prints held-out losses, each run's gap to
bf16-continued, the share of the PTQ gap it closed and its KL to the teacher
(``modelopt_moe.plugins.testing.qat_recovery``).

Usage:
  python tools/bench_qat_recovery.py --cpu [--quick]     # 4 gloo ranks, TP2 x EP2, Megatron SequentialMLP experts
  python tools/bench_qat_recovery.py --gpu               # every visible GPU (NCCL), TP1 x EP<gpus>, TE grouped
                                                         # experts: 4 layers, 16 experts top-2, hidden 512,
                                                         # 600 bf16 steps then 200 steps at lr 1e-4 (the issue's)
Any knob of ``RecoveryConfig`` can be overridden, e.g. ``--set steps=40 lr=3e-4 amax_updates=static,dynamic``.
``--json FILE`` also writes the raw results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

CPU = {"tp": 2, "ep": 2, "experts": "sequential", "pretrain_steps": 300, "ffn_hidden": 256, "steps": 20,
       "lr": 3e-4, "eval_batches": 8, "formats": ("nvfp4", "fp8")}
QUICK = {"tp": 2, "ep": 2, "experts": "sequential", "pretrain_steps": 3, "steps": 2, "eval_batches": 1,
         "formats": ("nvfp4",)}
GPU = {"tp": 1, "experts": "te", "num_layers": 4, "num_experts": 16, "topk": 2, "hidden": 512, "ffn_hidden": 1024,
       "seq": 256, "batch": 16, "pretrain_steps": 600, "pretrain_lr": 1e-3, "steps": 200, "lr": 1e-4,
       "eval_batches": 16, "formats": ("nvfp4", "fp8"), "amax_updates": ("static", "dynamic")}


def _worker(rank, world_size, overrides):
    from modelopt_moe.plugins.testing.qat_recovery import RecoveryConfig, run_recovery

    return run_recovery(RecoveryConfig(**overrides))


def _parse_value(field, text: str):
    if field.type in ("tuple[str, ...]",) or isinstance(field.default, tuple):
        return tuple(v for v in text.split(",") if v)
    if isinstance(field.default, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(field.default, int):
        return int(text)
    if isinstance(field.default, float):
        return float(text)
    return text


def main(argv=None) -> int:
    from modelopt_moe.plugins.testing.qat_recovery import RecoveryConfig, format_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cpu", action="store_true", help="4 gloo ranks on this machine")
    where.add_argument("--gpu", action="store_true", help="every visible GPU, NCCL")
    parser.add_argument("--quick", action="store_true", help="a few steps only (CI: checks that the tool runs)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="RecoveryConfig overrides")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)

    import torch

    from modelopt_moe.launch import spawn

    overrides = dict(QUICK if args.quick else CPU) if args.cpu else dict(GPU)
    fields = {f.name: f for f in dataclasses.fields(RecoveryConfig)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            parser.error(f"--set {item}: unknown key {key!r}; expected one of {sorted(fields)}")
        overrides[key] = _parse_value(fields[key], value)
    if args.cpu:
        world, backend = 4, "gloo"
    else:
        if not torch.cuda.is_available():
            parser.error("--gpu: no CUDA device")
        world, backend = torch.cuda.device_count(), "nccl"
        overrides.setdefault("ep", world)
    start = time.perf_counter()
    result = spawn(_worker, world, args=(overrides,), timeout=args.timeout, backend=backend)[0]
    print(format_report(result))
    print(f"({world} ranks, {backend}, {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
