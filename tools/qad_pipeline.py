"""QAD at pipeline parallelism 2 against pipeline parallelism 1, on the same weights and tokens (docs/qad.md).

One job of 4 CPU processes (gloo; :func:`modelopt_moe.launch.spawn`) runs the same QAD twice,
first at PP=2 x TP=2 (each stage: two of the four layers of both student and teacher), then at PP=1 x TP=2:

1. a transformers-written Qwen3-MoE model (``configs/qwen3_moe_tiny.json`` with 4 layers, random weights of std 0.2,
   seed 0) is built and imported as the bf16 teacher, and again as the student;
2. the student is quantized (NVFP4 experts, ``nvfp4_experts``) and calibrated through Megatron's pipeline schedule;
3. ``distillation_model(student, teacher)`` trains ``--steps`` steps with the default :class:`QADRecipe`
   (``training.setup_training`` / ``train``: Megatron's DDP, distributed optimizer, bf16 with fp32 main weights);
4. the student is saved (``save_sharded_checkpoint``) and exported (``export_hf``, Model Optimizer format).

Prints the loss of every step at both layouts, their largest relative difference, the seconds per step, and whether
the two exports are the same bytes::

    python tools/qad_pipeline.py --steps 10
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from modelopt_moe.launch import spawn

WORLD, TP, SEQ, BATCH, MICRO = 4, 2, 64, 2, 2


def _save_teacher(path: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = json.loads((Path(__file__).parent.parent / "configs" / "qwen3_moe_tiny.json").read_text())
    config.update(num_hidden_layers=4, initializer_range=0.2)  # wider weights: peaked logits, a real KL
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).to(torch.bfloat16).save_pretrained(path)


def _qad(pp: int, hf_dir: str, out: Path, steps: int) -> dict:
    import warnings

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import modelopt_moe.quantization as mtq
    from modelopt_moe.distill import QADRecipe
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.cli.text_data import text_batches
    from modelopt_moe.plugins.megatron import (
        distillation_model,
        init_model_parallel,
        lm_forward_step,
        save_sharded_checkpoint,
    )
    from modelopt_moe.plugins.megatron import training as mt
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    init_model_parallel(TP, 1, pp=pp, seed=1234)

    def build():
        model = build_megatron_model(hf_dir, params_dtype=torch.bfloat16)
        import_hf(model, hf_dir)
        return model

    calib = text_batches(BATCH, SEQ, 4, offset=10_000)
    batches = text_batches(BATCH, SEQ, steps * MICRO)

    def forward_loop(m):
        with megatron_training_shims(), torch.no_grad():
            get_forward_backward_func()(forward_step_func=lm_forward_step, data_iterator=iter(calib), model=[m],
                                        num_microbatches=len(calib), seq_length=SEQ, micro_batch_size=BATCH,
                                        forward_only=True)

    teacher, student = build().eval(), build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(student.eval(), mtq.load_config("nvfp4_experts"), forward_loop)
    student.train()
    recipe = QADRecipe()
    trainer = mt.setup_training(distillation_model(student, teacher, recipe=recipe), recipe=recipe,
                                lr_decay_steps=steps)
    start = time.perf_counter()
    losses = mt.train(trainer, batches, steps=steps, num_microbatches=MICRO)
    seconds = (time.perf_counter() - start) / steps
    save_sharded_checkpoint(student, out / f"pp{pp}_ckpt")
    export_hf(student, out / f"pp{pp}" / "qad", format="modelopt", progress=False)
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "seconds_per_step": seconds}


def _rank(rank, world_size, hf_dir, out_dir, steps):
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()
    out = Path(out_dir)
    return {"pp2": _qad(2, hf_dir, out, steps), "pp1": _qad(1, hf_dir, out, steps)}


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main(argv: list[str] | None = None) -> None:
    """Runs both layouts and prints the comparison."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="QAD steps at each layout (default: %(default)s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        _save_teacher(base / "teacher")
        results = spawn(_rank, WORLD, args=(str(base / "teacher"), str(base), args.steps), timeout=3600)
        same = _same_files(base / "pp1" / "qad", base / "pp2" / "qad")
    pp2, pp1 = results[0]["pp2"], results[0]["pp1"]
    print(f"QAD, Qwen3-MoE tiny (4 layers, 8 experts, NVFP4 experts), {WORLD} ranks, {args.steps} steps of "
          f"{MICRO} x {BATCH} x {SEQ} tokens")
    print(f"{'step':>4} {'loss PP=2 x TP=2':>18} {'loss PP=1 x TP=2':>18}")
    for s, (a, b) in enumerate(zip(pp2["losses"], pp1["losses"], strict=True)):
        print(f"{s:>4} {a:>18.6f} {b:>18.6f}")
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(pp2["losses"], pp1["losses"], strict=True))
    print(f"largest relative difference {diff:.2e}; seconds per step: PP=2 {pp2['seconds_per_step']:.2f}, "
          f"PP=1 {pp1['seconds_per_step']:.2f}")
    print(f"exported checkpoints (Model Optimizer format) identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
