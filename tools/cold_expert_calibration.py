"""Per-expert input amax of a short calibration against a long one, with and without ``moe_calib_experts_ratio``
(CPU, one process; docs/calibration.md).

The model: the tests' small Megatron MoE GPT (``tests/megatron_harness``: 2 layers, 16 SequentialMLP experts, top-2,
Megatron's initialization, not trained), FP8 with per-expert input amaxes. The reference: max calibration on 64
sequences of 32 tokens of English text with the model's own routing. Each variant calibrates on 1 sequence of 32
tokens; per expert input quantizer (fc1, fc2 of both layers: 64 expert amaxes) it prints the experts that saw no
token and the relative error ``|amax - amax_ref| / amax_ref`` (median and max), as a Markdown table.

``--model moe64``: the QAD study's 64-expert model instead (``tools/qad_study.py``: 2 layers, hidden 64, 64
SequentialMLP experts, top-8, expert FFN 64), its bf16 teacher trained as the study trains it (300 steps of Python
source at lr 3e-3, ``--pretrain-steps`` to change), FP8 experts (the study's quantization) with per-expert input
amaxes. The reference: max calibration on ``--long-batches`` (128) batches of 8 x 64 tokens that follow the
pretraining text, with the model's own routing (the study trains without a load-balancing loss: some experts get no
token even there, and their inputs are left out of the errors). The short calibrations: ``--short-seqs`` sequences
of 64 tokens after those, with the model's routing and with ``moe_calib_experts_ratio`` 0.25, 0.5 and 1.0; then the
long calibration at ratio 1.0. 256 expert amaxes (fc1 and fc2 inputs of 64 experts in 2 layers). It also prints the
teacher's tokens per expert on the reference data (the spread of the model's routing: min, median, max, coefficient of
variation).

``--gpu`` (with ``--model moe64``): the GPU study model's 64-expert twin instead (``bench_qat_recovery.GPU_STUDY``
with ``STUDY_MODELS["moe64"]``: 4 layers, hidden 512, 64 Transformer Engine grouped experts, top-8, expert FFN 64),
on one GPU (NCCL), its teacher trained 600 steps at lr 1e-3 on batches of 32 x 256 bytes of Python source; the short
calibration takes ``--short-seqs`` sequences of 256 tokens, the reference ``--long-batches`` batches of 32 x 256.

``--aux-loss [COEFF]``: the teacher trains with Megatron's load-balancing auxiliary loss
(``moe_router_load_balancing_type="aux_loss"``, ``moe_aux_loss_coeff`` COEFF, 1e-2 without a value): Megatron's router
attaches it to the routing probabilities and Megatron's schedule scales its gradient, as in any Megatron training. The
tool prints Megatron's own record of it (the normalised balance loss per layer, 1.0 for an even split, averaged over
the training steps). Calibration runs in eval mode without gradients, where Megatron's router adds no aux loss.

Usage: ``python tools/cold_expert_calibration.py`` (from the repository root, about a minute);
``python tools/cold_expert_calibration.py --model moe64 [--seed 1234] [--short-seqs 1] [--long-batches 128]
[--aux-loss [1e-2]] [--gpu]``;
``--quick``: a few steps only (checks that the tool runs).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = {"short, model's routing": None, "short, ratio 0.25 (4 of 16)": 0.25, "short, ratio 1.0": 1.0,
            "long, ratio 1.0": 1.0}


def _input_amaxes(model) -> tuple[torch.Tensor, torch.Tensor]:
    amax, rows = [], []
    for layer in model.decoder.layers:
        for gemm in ("linear_fc1", "linear_fc2"):
            q = getattr(layer.mlp.experts, gemm).input_quantizer
            amax.append(q.amax.clone())
            rows.append(q.calibrated_rows.clone())
    return torch.cat(amax), torch.cat(rows)


def _run(rank, world_size):
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

    mm.init_model_parallel(1, 1, seed=1)
    long_data, short_data = mm.text_batches(8, 32, 8), mm.text_batches(1, 32, 1, offset=100)

    def calibrate(ratio, data):
        model = mm.build_moe_gpt(num_experts=16, seed=3).eval()
        cfg = mtq.load_config("fp8_default.yaml")
        cfg.experts.input_amax = "per_expert"
        algorithm = {"method": "max"} if ratio is None else {"method": "max", "moe_calib_experts_ratio": ratio}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, {**cfg.model_dump(), "algorithm": algorithm},
                         lambda m: [mm.lm_loss(m, b) for b in data])
        return _input_amaxes(model)

    ref, ref_rows = calibrate(None, long_data)
    out = {"reference unseen": int((ref_rows == 0).sum())}
    for name, ratio in VARIANTS.items():
        amax, rows = calibrate(ratio, long_data if name.startswith("long") else short_data)
        err = ((amax - ref).abs() / ref).flatten()
        out[name] = (int((rows == 0).sum()), float(err.median()), float(err.max()))
    mm.destroy_model_parallel()
    return out


def _tokens_per_expert(rows: torch.Tensor, num_layers: int) -> torch.Tensor:
    """The tokens each expert received (``[layers, experts]``), from the fc1 input counts of :func:`_input_amaxes`'s
    rows (fc1 and fc2 of each layer in turn)."""
    return rows.reshape(num_layers, 2, -1)[:, 0]


def _balance_loss_per_layer(steps: int) -> list[float] | None:
    """Megatron's record of the load-balancing loss (``aux_loss / coeff``, 1.0 for an even split) per MoE layer,
    averaged over ``steps`` training steps of one micro-batch each; None where the router computed none. Clears the
    record."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker

    entry = get_moe_metrics_tracker().metrics.get("load_balancing_loss")
    destroy_moe_metrics_tracker()
    return None if entry is None else (entry.values.double() / steps).tolist()


# a trained model's short calibrations: the model's routing (None), then these moe_calib_experts_ratio values
TRAINED_RATIOS = (None, 0.25, 0.5, 1.0)
QUICK = {"pretrain_steps": 2, "long_batches": 2}


def _run_trained(rank, world_size, opts):
    """The short and long calibrations of a trained study model (``opts["model"]``, a key of
    ``bench_qat_recovery.STUDY_MODELS``)."""
    import megatron_harness.models as mm
    from bench_qat_recovery import CPU_STUDY, GPU_STUDY, STUDY_MODELS
    from megatron_harness.configs import expert_quant_config
    from qad_study import StudyConfig, study_data, study_model, train_teacher

    import modelopt_moe.quantization as mtq

    coeff = opts["aux_loss_coeff"]
    # Megatron's own load-balancing loss: its router attaches it while training, its schedule scales the gradient
    balance = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": coeff} if coeff else {}
    base = GPU_STUDY if opts["gpu"] else CPU_STUDY
    cfg = StudyConfig(**{**base, **STUDY_MODELS[opts["model"]], "seed": opts["seed"],
                         "pretrain_steps": opts["pretrain_steps"] or base["pretrain_steps"],
                         "steps": opts["long_batches"] + 1, "model_overrides": balance})
    mm.init_model_parallel(1, 1, seed=cfg.seed)
    data = study_data(cfg)
    teacher, losses = train_teacher(cfg, data["pretrain"])
    balance_loss = _balance_loss_per_layer(cfg.pretrain_steps)
    if coeff and balance_loss is None:
        raise RuntimeError(f"--aux-loss {coeff}: Megatron's router recorded no load-balancing loss while training")
    weights = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    del teacher
    long_data = data["recover"][:-1]  # the batches after the pretraining text
    short_data = [{k: v if k == "attention_mask" else v[:opts["short_seqs"]] for k, v in data["recover"][-1].items()}]

    def calibrate(ratio, batches):
        model = study_model(cfg, weights).eval()
        qcfg = expert_quant_config("fp8", "dynamic")
        qcfg["experts"] = {**qcfg["experts"], "input_amax": "per_expert"}
        algorithm = "max" if ratio is None else {"method": "max", "moe_calib_experts_ratio": ratio}

        def forward_loop(m):
            device = next(m.parameters()).device
            with torch.no_grad():
                for b in batches:
                    m(*(b[k].to(device) for k in ("tokens", "position_ids", "attention_mask")))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, {**qcfg, "algorithm": algorithm}, forward_loop)
        return _input_amaxes(model)

    ref, ref_rows = calibrate(None, long_data)
    n = cfg.num_experts
    out = {"model": f"{cfg.num_layers} layers, hidden {cfg.hidden}, {n} experts top-{cfg.topk}, expert FFN "
                    f"{cfg.ffn_hidden}; teacher {cfg.pretrain_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
                    + (f", load-balancing aux loss coeff {coeff:g}" if coeff else ", no load-balancing loss"),
           "balance loss": balance_loss,
           "tokens per expert": _tokens_per_expert(ref_rows, cfg.num_layers).tolist(),
           "inputs": ref.numel(), "reference unseen": int((ref_rows == 0).sum()),
           "reference": f"{len(long_data)} x {cfg.batch} x {cfg.seq} tokens", "rows": []}
    runs = [(f"short ({opts['short_seqs']} x {cfg.seq} tokens), "
             + ("model's routing" if r is None else f"ratio {r} ({max(cfg.topk, round(r * n))} of {n} experts)"),
             r, short_data) for r in TRAINED_RATIOS] + [("long, ratio 1.0", 1.0, long_data)]
    cold = None  # the expert inputs the reference saw and the short calibration with the model's routing did not
    for name, ratio, batches in runs:
        amax, rows = calibrate(ratio, batches)
        err = ((amax - ref).abs() / ref)[ref_rows > 0]  # an input the reference never saw has no reference amax
        cold = (rows == 0)[ref_rows > 0] if cold is None else cold
        seen = rows[rows > 0].float()
        out["rows"].append((name, int((rows == 0).sum()), float(seen.median()) if seen.numel() else 0.0,
                            float(err.median()), float(err.max()), float(err[cold].median()) if cold.any() else 0.0))
    out["cold"] = int(cold.sum())
    mm.destroy_model_parallel()
    return out


def main(argv=None) -> None:
    """Prints the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("harness", "moe64"), default="harness",
                        help="harness: the tests' untrained 16-expert model (default); moe64: the QAD study's "
                             "64-expert top-8 model, trained first")
    parser.add_argument("--seed", type=int, default=1234, help="moe64: the teacher's seed")
    parser.add_argument("--pretrain-steps", type=int, help="moe64: the teacher's training steps (default: 300, 600 "
                                                             "with --gpu)")
    parser.add_argument("--long-batches", type=int, default=128, help="moe64: the reference's batches (of 8 x 64 "
                                                                      "tokens, 32 x 256 with --gpu)")
    parser.add_argument("--short-seqs", type=int, default=1, help="moe64: the short calibration's sequences (of 64 "
                                                                  "tokens, 256 with --gpu)")
    parser.add_argument("--aux-loss", type=float, nargs="?", const=1e-2, metavar="COEFF",
                        help="moe64: train the teacher with Megatron's load-balancing auxiliary loss "
                             "(moe_router_load_balancing_type aux_loss, moe_aux_loss_coeff COEFF; default 1e-2)")
    parser.add_argument("--gpu", action="store_true", help="moe64: the GPU study model's 64-expert twin (TE grouped "
                                                           "experts) on one GPU")
    parser.add_argument("--quick", action="store_true", help="moe64: a few steps only (checks that the tool runs)")
    args = parser.parse_args(argv)
    if args.aux_loss is not None and not (math.isfinite(args.aux_loss) and args.aux_loss > 0):
        parser.error(f"--aux-loss {args.aux_loss}: expected a positive, finite coefficient (1e-2 without a value)")
    for flag, value in (("--pretrain-steps", args.pretrain_steps), ("--long-batches", args.long_batches)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: expected a positive number of steps / batches")
    if args.short_seqs < 1 or args.short_seqs > 8:
        parser.error(f"--short-seqs {args.short_seqs}: expected 1 to 8 (sequences of one batch)")
    for flag, given in (("--quick", args.quick), ("--aux-loss", args.aux_loss is not None), ("--gpu", args.gpu)):
        if args.model == "harness" and given:
            parser.error(f"{flag} needs --model moe64")
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu: no CUDA GPU is visible")
    from modelopt_moe.launch import spawn

    if args.model == "harness":
        (out,) = spawn(_run, 1, timeout=900)
        print(f"reference (64 x 32 tokens, the model's routing): {out['reference unseen']} of 64 expert inputs "
              "unseen\n")
        print("| calibration | expert inputs without a token | median relative amax error | max relative amax error |")
        print("|---|---:|---:|---:|")
        for name in VARIANTS:
            unseen, median, worst = out[name]
            print(f"| {name} | {unseen} of 64 | {median:.3f} | {worst:.3f} |")
        return
    opts = {"model": args.model, "seed": args.seed, "pretrain_steps": args.pretrain_steps,
            "long_batches": args.long_batches, "short_seqs": args.short_seqs, "aux_loss_coeff": args.aux_loss or 0.0,
            "gpu": args.gpu, **(QUICK if args.quick else {})}
    (out,) = spawn(_run_trained, 1, args=(opts,), timeout=3600, backend="nccl" if args.gpu else "gloo")
    total = out["inputs"]
    print(f"{args.model} (seed {args.seed}): {out['model']}")
    print(f"reference ({out['reference']}, the model's routing): {out['reference unseen']} of {total} expert "
          "inputs unseen")
    tokens = torch.tensor(out["tokens per expert"], dtype=torch.float64)
    for i, layer in enumerate(tokens):
        print(f"teacher's tokens per expert on the reference, layer {i + 1}: min {layer.min():.0f}, median "
              f"{layer.median():.0f}, max {layer.max():.0f} (an even split: {layer.mean():.0f}), coefficient of "
              f"variation {layer.std(correction=0) / layer.mean():.3f}, {int((layer == 0).sum())} of {layer.numel()} "
              "experts without a token")
    loss = out["balance loss"]
    print("Megatron's load-balancing loss while the teacher trained (aux_loss / coeff, 1.0 for an even split; mean "
          "over the steps): " + ("none (no aux loss)" if loss is None else
                                 ", ".join(f"layer {i + 1} {v:.4f}" for i, v in enumerate(loss))) + "\n")
    print(f"relative amax error |amax - amax_ref| / amax_ref over the {total - out['reference unseen']} expert inputs "
          f"the reference saw; cold: the {out['cold']} of them the short calibration with the model's routing left "
          "without a token\n")
    print("| calibration | expert inputs without a token | median tokens per seen expert input | median relative "
          "amax error | max relative amax error | median relative amax error, cold inputs |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, unseen, tokens, median, worst, cold in out["rows"]:
        print(f"| {name} | {unseen} of {total} | {tokens:.0f} | {median:.3f} | {worst:.3f} | {cold:.3f} |")


if __name__ == "__main__":
    main()
