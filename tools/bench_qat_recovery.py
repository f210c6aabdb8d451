"""Benchmark: how much of post-training quantization's loss do plain QAT and QAD win back in the same steps?

Trains a small Megatron MoE GPT in bf16 on the shipped English text (the teacher), then from its weights runs, for
the same steps, data and optimizer: bf16-continued, PTQ, plain QAT (LM loss) and QAD (KL to the frozen teacher), per
number format (NVFP4, FP8; experts quantized) and ``weight_amax_update``; prints held-out losses, each run's gap to
bf16-continued, the share of the PTQ gap it closed and its KL to the teacher
(``tools/qat_recovery.py``).

Usage:
  python tools/bench_qat_recovery.py --cpu [--quick]     # 4 gloo ranks, TP2 x EP2, Megatron SequentialMLP experts
  python tools/bench_qat_recovery.py --gpu               # every visible GPU (NCCL), TP1 x EP<gpus>, TE grouped
                                                         # experts: 4 layers, 16 experts top-2, hidden 512,
                                                         # 600 bf16 steps then 200 steps at lr 1e-4
Any knob of ``RecoveryConfig`` can be overridden, e.g. ``--set steps=40 lr=3e-4 amax_updates=static,dynamic``.
``--json FILE`` also writes the raw results.

``--study``: the QAD study (``tools/qad_study.py``, measurements in docs/qad.md): one teacher,
then PTQ and every variant of ``STUDY_VARIANTS`` (the default ``QADRecipe``, the former default, plain QAT, then
one change each: learning rate, schedule, which parameters train, Adam's eps and beta2, weight decay, temperature,
LM-loss mix, weight_amax_update; NVFP4 and FP8) for the same steps on the same batches, measured on held-out text
no run trained on (KL to the teacher and LM loss per batch, train-vs-held-out KL curves, parameter drift, routing
changes, gradient statistics). Knobs of ``StudyConfig`` go to ``--set``; ``--variants`` replaces the list (in
priority order), ``--budget SECONDS`` skips the variants that would end past it:
  python tools/bench_qat_recovery.py --cpu --study [--quick]   # 1 gloo rank, a small model
  python tools/bench_qat_recovery.py --gpu --study --budget 360 --json qad.json
                                                         # the GPU model above, 200 steps per variant
``--model moe64`` studies a model of 64 experts, top-8 (expert FFN 64; the same active expert FFN per token).
A variant's ``calib=<name>`` starts it from another calibration (``max``, ``mse``, ``fp8_sweep``, ``four_over_six``,
``percentile``, ``hist_mse``, ``per_expert``: max with one input amax per expert; PTQ is measured per format and
calibration), and method ``ptq`` measures the start
alone (docs/calibration.md):
  python tools/bench_qat_recovery.py --cpu --study --model moe64 --variants nvfp4/qad nvfp4/qad:calib=fp8_sweep \
      fp8/ptq:calib=percentile
``--glu swiglu`` (or ``geglu``) gives the study model gated experts (``tools/smooth_expert_inputs_study.py``'s
``--glu``); ``calib=smooth`` starts from max calibration after ``smooth_expert_inputs: {alpha: 0.5}``, which needs
them:
  python tools/bench_qat_recovery.py --cpu --study --glu swiglu --variants nvfp4/qad nvfp4/qad:calib=smooth
``--set data=legacy`` measures the way the recovery table does (held-out text at a fixed offset of the English text,
which a long pretraining reads too).
``--seeds 1234,4321,777`` runs the study once per seed (its own teacher, calibration and batches; ``--json`` then
holds ``{seed: results}``) and ends with each variant's median and range over the seeds:
  python tools/bench_qat_recovery.py --gpu --study --seeds 1234,4321,777 --variants nvfp4/qad \
      nvfp4/qad:input_amax_update=learned,amax_lr_mult=100 --json qad_seeds.json
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
# The study (StudyConfig). CPU: a model small enough for 2 shared cores on which NVFP4 PTQ still visibly hurts.
CPU_STUDY = {"tp": 1, "ep": 1, "experts": "sequential", "num_layers": 2, "hidden": 64, "ffn_hidden": 256,
             "num_experts": 4, "topk": 2, "seq": 64, "batch": 8, "pretrain_steps": 300, "pretrain_lr": 3e-3,
             "steps": 100, "eval_batches": 8, "corpus": "code"}
QUICK_STUDY = {"tp": 1, "ep": 1, "experts": "sequential", "num_layers": 2, "hidden": 32, "ffn_hidden": 64,
               "num_experts": 4, "topk": 2, "seq": 32, "batch": 2, "pretrain_steps": 4, "steps": 4, "eval_batches": 2,
               "train_eval_batches": 2, "corpus": "text",
               "variants": ("nvfp4/qad", "nvfp4/qad:train=all,lr=1e-4,lr_decay_style=constant,warmup_fraction=0",
                            "fp8/qat:weight_amax_update=learned",
                            "nvfp4/qad:input_amax_update=learned,amax_lr_mult=100")}
# The GPU model of the recovery benchmark, batches of 32 x 256 bytes of Python source (no byte seen twice).
GPU_STUDY = {"tp": 1, "experts": "te", "num_layers": 4, "num_experts": 16, "topk": 2, "hidden": 512,
             "ffn_hidden": 1024, "seq": 256, "batch": 32, "pretrain_steps": 600, "pretrain_lr": 1e-3, "steps": 200,
             "eval_batches": 16, "train_eval_batches": 4, "calib_batches": 4, "corpus": "code"}

# --model: other study models, as changes to the study's model (the same active expert FFN per token as CPU_STUDY's
# 4 experts top-2 of 256: 8 x 64).
STUDY_MODELS = {"study": {}, "moe64": {"num_experts": 64, "topk": 8, "ffn_hidden": 64}}


def _worker(rank, world_size, overrides):
    from qat_recovery import RecoveryConfig, run_recovery

    return run_recovery(RecoveryConfig(**overrides))


def _study_worker(rank, world_size, overrides):
    from qad_study import StudyConfig, run_study

    return run_study(StudyConfig(**overrides), verbose=rank == 0)


def _parse_value(field, text: str):
    if field.default_factory is dict:
        return json.loads(text)
    if str(field.type).startswith("tuple") or isinstance(field.default, tuple):
        items = tuple(v for v in text.split(",") if v)
        return tuple(int(v) for v in items) if "int" in str(field.type) else items
    if isinstance(field.default, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(field.default, int):
        return int(text)
    if isinstance(field.default, float):
        return float(text)
    return text


def main(argv=None) -> int:
    """Runs the recovery table (or ``--study``) on the chosen ranks, prints the report and writes ``--json``."""
    from qad_study import GLUS  # the study models with gated experts
    from qat_recovery import RecoveryConfig, format_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cpu", action="store_true", help="4 gloo ranks on this machine")
    where.add_argument("--gpu", action="store_true", help="every visible GPU, NCCL")
    parser.add_argument("--quick", action="store_true", help="a few steps only (CI: checks that the tool runs)")
    parser.add_argument("--study", action="store_true", help="the QAD study (StudyConfig) instead of the recovery "
                                                             "table")
    parser.add_argument("--variants", nargs="+", metavar="SPEC", help="--study: the variants to run, in priority "
                                                                       "order (e.g. nvfp4/qad:lr=1e-4,train=all)")
    parser.add_argument("--budget", type=float, default=0.0, help="--study: seconds of the study (the teacher's "
                                                                  "training included); variants that would end past "
                                                                  "it are skipped (0: none)")
    parser.add_argument("--model", choices=sorted(STUDY_MODELS), help="--study: the model (default: study; moe64: "
                                                                       "64 experts top-8, expert FFN 64); --set "
                                                                       "overrides it")
    parser.add_argument("--glu", choices=sorted(GLUS), help="--study: the experts' MLP (default: none, the study "
                                                             "models' GELU; swiglu or geglu: gated_linear_unit)")
    parser.add_argument("--ranks", type=int, help="--cpu: gloo ranks (default: 4, or 1 with --study)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="RecoveryConfig (StudyConfig "
                                                                                  "with --study) overrides")
    parser.add_argument("--seeds", help="--study: comma-separated seeds, one study each, then the median and range "
                                        "of every variant over them (e.g. 1234,4321,777)")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)

    import torch
    from qad_study import StudyConfig, format_seeds, format_study, parse_variant, variant_calibration

    from modelopt_moe.launch import spawn

    if args.study:
        config_cls = StudyConfig
        overrides = dict(QUICK_STUDY if args.quick else CPU_STUDY) if args.cpu else dict(GPU_STUDY)
    else:
        config_cls = RecoveryConfig
        overrides = dict(QUICK if args.quick else CPU) if args.cpu else dict(GPU)
    if args.model:
        if not args.study:
            parser.error("--model needs --study")
        overrides.update(STUDY_MODELS[args.model])
    if args.glu:
        if not args.study:
            parser.error("--glu needs --study")
        overrides["model_overrides"] = GLUS[args.glu]
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            parser.error(f"--set {item}: unknown key {key!r}; expected one of {sorted(fields)}")
        overrides[key] = _parse_value(fields[key], value)
    if args.variants or args.budget:
        if not args.study:
            parser.error("--variants and --budget need --study")
        if args.variants:
            overrides["variants"] = tuple(args.variants)
        overrides["time_budget_s"] = args.budget
    seeds = None
    if args.seeds is not None:
        if not args.study:
            parser.error("--seeds needs --study")
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 1234,4321,777")
        if not seeds or len(set(seeds)) != len(seeds):
            parser.error(f"--seeds {args.seeds!r}: expected distinct integers, e.g. 1234,4321,777")
    if args.study and args.json and seeds is None:
        overrides["partial_json"] = args.json  # rewritten after every variant: a run cut short keeps what it measured
    if args.study:
        try:  # a typo in a variant fails here, not after the teacher's training
            for spec in overrides.get("variants", StudyConfig().variants):
                parse_variant(spec, overrides.get("recipe"))
        except ValueError as e:
            parser.error(str(e))
        smooth = [s for s in overrides.get("variants", ()) if variant_calibration(s) == "smooth"]
        if smooth and not overrides.get("model_overrides", {}).get("gated_linear_unit"):
            parser.error(f"--variants {' '.join(smooth)}: calib=smooth rescales gated experts' fc2 inputs; the study "
                         "models' experts are GELU, not gated: add --glu swiglu")
    if args.cpu:
        world, backend = args.ranks or (1 if args.study else 4), "gloo"
    else:
        if not torch.cuda.is_available():
            parser.error("--gpu: no CUDA device")
        world, backend = torch.cuda.device_count(), "nccl"
        overrides.setdefault("ep", world)
    start = time.perf_counter()
    worker = _study_worker if args.study else _worker
    if seeds is not None:
        result = {}
        for seed in seeds:
            result[seed] = spawn(worker, world, args=({**overrides, "seed": seed},), timeout=args.timeout,
                                 backend=backend)[0]
            print(f"seed {seed}:\n{format_study(result[seed])}\n", flush=True)
            if args.json:  # what the seeds so far measured, should a later one be cut short
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1, default=str)
        print(format_seeds(result))
    else:
        result = spawn(worker, world, args=(overrides,), timeout=args.timeout, backend=backend)[0]
        print(format_study(result) if args.study else format_report(result))
    print(f"({world} ranks, {backend}, {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
