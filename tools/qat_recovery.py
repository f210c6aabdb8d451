"""The QAT-recovery experiment: how much of the loss that post-training quantization costs do plain QAT and QAD win
back in the same number of steps? Run by ``tools/bench_qat_recovery.py`` (tested in ``tests/tools/``).

Inside every rank of a :func:`modelopt_moe.launch.spawn` (or torchrun) job, :func:`run_recovery`:

1. trains a small Megatron MoE GPT in bf16 on the shipped text (``pretrain_steps``): the *teacher*;
2. from copies of the teacher's weights, for the same ``steps``, data and optimizer (Megatron's: ``Float16Module``,
   DDP, ``get_megatron_optimizer``, ``get_forward_backward_func``):
   * ``bf16``: continues training unquantized (the reference every gap is measured to);
   * ``ptq``: quantizes (max calibration) and does not train;
   * ``qat``: quantizes, then trains on the LM loss;
   * ``qad``: quantizes, then trains on the KL divergence to the frozen teacher
     (:func:`modelopt_moe.plugins.megatron.distillation_model`);
   for every number format and ``weight_amax_update`` asked for;
3. reports held-out LM losses, each run's gap to ``bf16``, the share of the PTQ gap (PTQ minus teacher) it closed,
   and the KL of each quantized model to the teacher.

Only the experts are quantized (weights and inputs; attention, router and output layer stay in bf16), the NVIDIA
Model Optimizer recipe for MoE models.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from pathlib import Path

import torch

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:  # the small Megatron models (tests/megatron_harness) are not part of the package
    sys.path.insert(0, _TESTS)

from megatron_harness.configs import expert_quant_config  # noqa: E402

__all__ = ["RecoveryConfig", "run_recovery", "expert_quant_config", "format_report"]


@dataclasses.dataclass
class RecoveryConfig:
    """The experiment's knobs (defaults: the short CPU variant)."""

    tp: int = 2
    ep: int = 2
    experts: str = "sequential"  # "sequential" | "grouped" | "te" (GPU)
    num_layers: int = 2
    hidden: int = 64
    ffn_hidden: int = 128
    num_experts: int = 4
    topk: int = 2
    seq: int = 32
    batch: int = 4
    microbatches: int = 1
    pretrain_steps: int = 40
    pretrain_lr: float = 3e-3
    steps: int = 8
    lr: float = 1e-3
    formats: tuple[str, ...] = ("nvfp4",)
    amax_updates: tuple[str, ...] = ("static",)
    methods: tuple[str, ...] = ("bf16", "ptq", "qat", "qad")
    eval_batches: int = 4
    calib_batches: int = 2
    temperature: float = 1.0
    seed: int = 1234
    model_overrides: dict = dataclasses.field(default_factory=dict)  # more build_moe_gpt arguments
    # "same": recovery (calibration, QAT, QAD) on more of the English text the teacher learned; "shifted": on Python
    # source code, while evaluation stays on held-out English text (the teacher's data is not at hand).
    recovery_data: str = "same"


def code_batches(batch_size: int, seq_len: int, num_batches: int, *, offset: int = 0,
                 vocab_size: int = 256) -> list[dict[str, torch.Tensor]]:
    """Byte-level batches of Python source code (a few modules of the standard library), laid out like
    ``text_batches``: another distribution than the English text, with the same bytes."""
    import dataclasses as dc
    import inspect
    import json as js
    import typing

    from modelopt_moe.plugins.cli.text_data import text_batches

    corpus = "\n\n".join(inspect.getsource(m) for m in (dc, inspect, js, typing)).encode("utf-8")
    return text_batches(batch_size, seq_len, num_batches, vocab_size, offset=offset, corpus=corpus)


def run_recovery(cfg: RecoveryConfig) -> dict:
    """Runs the experiment on this rank (``torch.distributed`` initialised, world size a multiple of TP and EP).

    Returns:
        ``{"teacher": {...}, "bf16": {...}, "<fmt>/<amax_update>/<method>": {"loss", "kl", "gap", "closed",
        "train_losses", "seconds"}, "config": {...}}``, the same on every rank.
    """
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import distillation_model
    from modelopt_moe.plugins.megatron import training as mt

    mm.init_model_parallel(cfg.tp, cfg.ep, seed=cfg.seed)
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    mb = cfg.microbatches
    if cfg.recovery_data not in ("same", "shifted"):
        raise ValueError(f"recovery_data={cfg.recovery_data!r}: expected 'same' or 'shifted'")
    pretrain = mm.text_batches(cfg.batch, cfg.seq, cfg.pretrain_steps * mb)
    if cfg.recovery_data == "same":
        recover = mm.text_batches(cfg.batch, cfg.seq, cfg.steps * mb, offset=cfg.pretrain_steps * mb * cfg.batch)
    else:
        recover = code_batches(cfg.batch, cfg.seq, cfg.steps * mb)
    calib = recover[:cfg.calib_batches]
    held_out = mm.text_batches(cfg.batch, cfg.seq, cfg.eval_batches, offset=5000)

    def build():
        return mm.build_moe_gpt(num_layers=cfg.num_layers, hidden=cfg.hidden, ffn_hidden=cfg.ffn_hidden,
                                num_experts=cfg.num_experts, moe_router_topk=cfg.topk, seq_len=cfg.seq,
                                params_dtype=torch.bfloat16, seed=cfg.seed, experts=cfg.experts,
                                **cfg.model_overrides)

    t0 = time.perf_counter()
    # Cosine decay to a tenth: the teacher ends near a minimum, so that continued training changes it little.
    teacher_trainer = mt.setup_training(build(), lr=cfg.pretrain_lr, lr_decay_steps=cfg.pretrain_steps)
    pre_losses = mt.train(teacher_trainer, pretrain, steps=cfg.pretrain_steps, num_microbatches=mb)
    teacher = mt.unwrap(teacher_trainer.model).eval()
    teacher_weights = {n: p.detach().clone() for n, p in teacher.named_parameters()}

    def copy_of_teacher():
        model = build()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(teacher_weights[n])
        return model

    def evaluate(model) -> dict:
        return mm.loss_and_kl(model, held_out, teacher, tp_group)

    out = {"config": dataclasses.asdict(cfg),
           "teacher": {**evaluate(teacher), "train_losses": pre_losses, "seconds": time.perf_counter() - t0}}

    def train_and_eval(model, key, student=None):
        t = time.perf_counter()
        trainer = mt.setup_training(model, lr=cfg.lr)
        losses = mt.train(trainer, recover, steps=cfg.steps, num_microbatches=mb)
        student = student if student is not None else mt.unwrap(trainer.model)
        out[key] = {**evaluate(student), "train_losses": losses, "seconds": time.perf_counter() - t,
                    "clipped_pct": _clipped_pct(student)}

    if "bf16" in cfg.methods:
        train_and_eval(copy_of_teacher(), "bf16")

    def quantized(fmt, update):
        model = copy_of_teacher()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.eval()
            mtq.quantize(model, expert_quant_config(fmt, update), lambda m: [mm.lm_loss(m, b) for b in calib])
        return model.train()

    for fmt in cfg.formats:
        for update in cfg.amax_updates:
            prefix = f"{fmt}/{update}"
            if "ptq" in cfg.methods or "qat" in cfg.methods:
                student = quantized(fmt, update)
                out[f"{prefix}/ptq"] = {**evaluate(student), "train_losses": [], "seconds": 0.0}
                if "qat" in cfg.methods:
                    train_and_eval(student, f"{prefix}/qat")
            if "qad" in cfg.methods:
                student = quantized(fmt, update)
                train_and_eval(distillation_model(student, teacher, temperature=cfg.temperature), f"{prefix}/qad",
                               student)
    ref = out.get("bf16", out["teacher"])["loss"]
    for key, r in out.items():
        if "/" in key:
            ptq = out[key.rsplit("/", 1)[0] + "/ptq"]["loss"] if key.rsplit("/", 1)[0] + "/ptq" in out else math.nan
            r["gap"] = r["loss"] - ref
            damage = ptq - out["teacher"]["loss"]
            r["closed"] = (ptq - r["loss"]) / damage if damage > 0 else math.nan
    mm.destroy_model_parallel()
    return out


def _clipped_pct(model) -> float | None:
    """Percentage of expert weights above the amax their quantizer holds (after the last step: a static amax clips
    them; a dynamic one is first recomputed from them, so it clips none), over every rank."""
    import torch.distributed as dist

    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import iter_expert_quantizers

    mtq.update_weight_amax(model)
    device = next(model.parameters()).device  # NCCL reduces device tensors
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for e in iter_expert_quantizers(model):
        q = e.quantizer
        if e.kind != "weight_quantizer" or not q.is_enabled or q.amax is None:
            continue
        for i, w in enumerate(e.gemm.weights or []):
            counts += torch.tensor([(w.detach().float().abs() > q.expert_amax(i).detach()).sum().item(), w.numel()],
                                   dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    counts = counts.tolist()
    return 100 * counts[0] / counts[1] if counts[1] else None


def format_report(result: dict) -> str:
    """A table of held-out losses, gaps to bf16-continued and KL to the teacher."""
    cfg = result["config"]
    lines = [f"teacher (bf16, {cfg['pretrain_steps']} steps at lr {cfg['pretrain_lr']}): held-out loss "
             f"{result['teacher']['loss']:.4f}",
             f"recovery: {cfg['steps']} steps at lr {cfg['lr']}, TP{cfg['tp']} EP{cfg['ep']}, {cfg['experts']} experts",
             f"{'run':<28}{'loss':>9}{'gap to bf16':>13}{'PTQ gap closed':>16}{'KL to teacher':>15}"
             f"{'clipped %':>11}"]
    if "bf16" in result:
        lines.append(f"{'bf16-continued':<28}{result['bf16']['loss']:>9.4f}{0.0:>13.4f}{'':>16}"
                     f"{result['bf16']['kl']:>15.5f}")
    for key, r in result.items():
        if "/" in key:
            closed = "" if math.isnan(r["closed"]) else f"{100 * r['closed']:.0f}%"
            clipped = "" if r.get("clipped_pct") is None else f"{r['clipped_pct']:.3f}"
            lines.append(f"{key:<28}{r['loss']:>9.4f}{r['gap']:>13.4f}{closed:>16}{r['kl']:>15.5f}{clipped:>11}")
    return "\n".join(lines)
