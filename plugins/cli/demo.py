"""``modelopt-moe demo``: the whole pipeline on a small MoE model, one line per stage on what it proved.

``--model`` picks the family: each shipped tiny config ``configs/<family>_tiny.json`` (``qwen3_moe`` by default,
``deepseek_v3``, ``glm4_moe``, ``gpt_oss``, ``qwen3_5_moe``) runs the same stages:

1. teacher: build the model from the family's tiny config (``configs/<family>_tiny.json``), train it briefly in bf16
   on real English text (byte tokens), save it as a Hugging Face checkpoint and import it back (the path a user with a
   published model takes);
2. PTQ: quantize a copy with a YAML config from ``configs/`` (NVFP4 experts by default, ``--format fp8``), calibrate;
3. QAD: distil the quantized student from the bf16 teacher (forward KL) in Megatron's training loop; held out, after
   PTQ and after QAD, what the KL does not show: teacher-forced top-1 agreement with the teacher and greedy generation
   from a few prompts (the teacher's tokens agreed on, the end rate and the mean length of each model);
4. checkpoint: save a distributed checkpoint, restore it in fresh process groups into freshly built models, at the
   same layout (logits bit-identical) and at TP=1 x EP=world (every weight and amax bit-identical; the logits' max
   and mean |diff| and top-1 agreement, with the measured source of the difference: bf16 rounding);
5. export: compressed-tensors and NVIDIA Model Optimizer formats; ``transformers`` loads the first, with the public
   fix for its NVFP4 experts loader applied (:func:`modelopt_moe.export.transformers_compat.fix_nvfp4_experts`),
   its logits compared in the same figures (a family whose experts are stored fused as 3-D tensors, gpt-oss, exports
   them quantized only as MXFP4 weights in its published layout, ``format="hf-mxfp4"``, which the demo's presets
   are not: the stage says so and writes nothing);
6. report: ``<out>/report.md`` with the numbers, the quantizer summary and PNG plots.

The layout fits the machine unless flags say otherwise (the first output line says which): one process per visible
GPU with Transformer Engine experts (``TEGroupedMLP``) and the Triton kernels, TP and EP chosen to divide the
process count and the 8 experts (1 GPU: TP=1 x EP=1; 8 GPUs: TP=2 x EP=4); without GPUs (or with ``--cpu``) 4 gloo
processes at TP=2 x EP=2 with the Megatron-Core local spec, Transformer Engine kept out. Under ``torchrun`` /
``srun`` it runs in the launcher's processes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .inputs import model_sizes
from .noise import print_warnings
from .ranks import (
    LayoutError,
    add_layout_args,
    calibration_loop,
    check_layout,
    prints_here,
    progress,
    run_ranks,
    say,
)

__all__ = ["main"]

DEFAULT_MODEL = "qwen3_moe"
_MODEL_CONFIG = "_tiny.json"  # configs/<family>_tiny.json: the model --model <family> builds
_EXPERTS_PRESET = "_experts.yaml"  # configs/<format>_experts.yaml: the preset --format <format> runs
DEFAULT_CONFIG = "nvfp4_experts.yaml"
# Disjoint sample ranges of the corpus (text_batches offsets, in samples).
_TRAIN, _CALIB, _QAD, _EVAL = 0, 4000, 4500, 6000
# Greedy generation on held-out prompts: how many, and new tokens each. The tiny config has no end-of-sequence token;
# its byte model ends a line with "\n", which stands for one.
_GEN_PROMPTS, _GEN_TOKENS, _LINE_END = 8, 16, 10


def _model_configs() -> dict[str, str]:
    """``--model`` choice -> its shipped tiny config: every ``configs/<family>_tiny.json``."""
    from importlib import resources

    files = resources.files("modelopt_moe.configs").iterdir()
    return {f.name.removesuffix(_MODEL_CONFIG): f.name for f in files if f.name.endswith(_MODEL_CONFIG)}


def _format_configs() -> dict[str, str]:
    """``--format`` choice -> its shipped preset: every ``configs/<format>_experts.yaml``."""
    from importlib import resources

    files = resources.files("modelopt_moe.configs").iterdir()
    return {f.name.removesuffix(_EXPERTS_PRESET): f.name for f in files if f.name.endswith(_EXPERTS_PRESET)}


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelopt-moe demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(_model_configs()), default=DEFAULT_MODEL,
                   help="model family: its shipped tiny config configs/<model>_tiny.json (default: %(default)s)")
    p.add_argument("--format", choices=sorted(_format_configs()),
                   default=DEFAULT_CONFIG.removesuffix(_EXPERTS_PRESET),
                   help="expert number format (default: %(default)s)")
    p.add_argument("--config", help="quantization YAML instead of the format's shipped one (a bare name finds the "
                                    "shipped presets)")
    p.add_argument("--steps", type=int, default=30, help="QAD steps (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=300, help="bf16 steps that train the teacher "
                                                               "(default: %(default)s)")
    p.add_argument("--train-all", action="store_true",
                   help="QAD trains every parameter (default: the QAD recipe's, the quantized experts' weights "
                        "only; the rest stays the teacher's)")
    p.add_argument("--out", default="report", help="report directory (default: %(default)s); its artifacts/ "
                                                   "holds the checkpoints")
    p.add_argument("--no-export", action="store_true", help="skip the Hugging Face export stage")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence (default: %(default)s)")
    p.add_argument("--num-calib-batches", type=int, default=4, help="calibration batches (default: %(default)s)")
    p.add_argument("--num-eval-batches", type=int, default=4, help="held-out batches (default: %(default)s)")
    p.add_argument("--lr", type=float, help="QAD peak learning rate (default: the QAD recipe's)")
    p.add_argument("--seed", type=int, default=1234, help="seed (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run (default: %(default)s)")
    add_layout_args(p)
    args = p.parse_args(argv)
    for name in ("steps", "train_steps", "batch_size", "seq_len", "num_calib_batches", "num_eval_batches"):
        if getattr(args, name) < (0 if name in ("steps", "train_steps") else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {0 if name in ('steps', 'train_steps') else 1}")
    # Sequence parallelism splits the sequence over TP; attention heads, KV heads and the vocabulary split over it too.
    experts, tp_divides = model_sizes(_model_config(args.model), seq_len=args.seq_len)
    args.layout = check_layout(p, args, num_experts=experts, tp_divides=tp_divides)
    return args


def _model_config(model: str) -> dict[str, Any]:
    """The shipped tiny model's Hugging Face config (read without importing torch: the layout depends on it)."""
    from importlib import resources

    return json.loads(resources.files("modelopt_moe.configs").joinpath(_model_configs()[model]).read_text())


def _prepare_out(out: Path) -> str | None:
    """An error message, or None once ``out`` is ready (a previous demo's artifacts are replaced; anything else in
    a non-empty directory is left alone and refused)."""
    ours = {"artifacts", "run.json", "report.md", "loss_curve.png", "expert_weight_amax.png",
            "expert_weight_error.png", "expert_input_amax.png"}  # what a demo (perhaps one that failed) leaves
    if out.exists() and any(p.name not in ours for p in out.iterdir()):
        return f"--out {out} exists, is not empty and holds other files than a demo report; choose another directory"
    shutil.rmtree(out / "artifacts", ignore_errors=True)
    (out / "artifacts").mkdir(parents=True, exist_ok=True)
    return None


def main(argv: list[str]) -> int:
    """``modelopt-moe demo``; returns the exit code (2: bad arguments, found before any process starts)."""
    args = _parse_args(argv)
    import modelopt_moe.quantization as mtq

    config = args.config or _format_configs()[args.format]
    try:  # fail fast, before starting processes
        mtq.load_config(config)
    except mtq.ConfigError as e:
        print(f"modelopt-moe demo: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    print_here = prints_here()
    if print_here:
        problem = _prepare_out(out)
        if problem:
            print(f"modelopt-moe demo: {problem}", file=sys.stderr)
            return 2
    if print_here:
        print(f"modelopt-moe demo: {args.layout.describe()}; {args.model} model ({_model_configs()[args.model]}), "
              f"{args.format} experts ({config})", flush=True)
    opts = {k: getattr(args, k) for k in ("model", "format", "steps", "train_steps", "batch_size", "seq_len",
                                          "num_calib_batches", "num_eval_batches", "lr", "seed", "tp", "ep",
                                          "no_export", "train_all")}
    opts.update(config=config, out=str(out), gpus=args.layout.gpus)
    try:
        ran = run_ranks(_demo_rank, args.layout, args=(opts,), timeout=args.timeout)
    except LayoutError as e:
        print(f"modelopt-moe demo: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as e:
        print(f"modelopt-moe demo: failed: {e}", file=sys.stderr)
        return 1
    if print_here:
        r0 = ran.results[0]
        print(f"\nreport: {r0['report']}", flush=True)
        print_warnings(ran.warnings)
        return 0 if r0["ok"] else 1
    return 0


# ---------------------------------------------------------------------------------------------------------------
# One rank


def _train(rank, trainer, batches, steps: int, desc: str, start: int = 0) -> list[list[float]]:
    """``steps`` optimizer steps, one micro-batch each; ``[[global step, loss], ...]``."""
    from modelopt_moe.plugins.megatron import training as mt

    curve = []
    bar = progress(rank, steps, desc)
    for s in range(steps):
        loss = mt.train_step(trainer, [batches[s % len(batches)]])
        curve.append([start + s, loss])
        bar.set_postfix(loss=f"{loss:.4g}")  # significant digits: a KL of 1e-5 is not 0.0000
        bar.update(1)
    bar.close()
    return curve


def _demo_rank(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Every rank runs every stage (the same collectives in the same order); rank 0 prints and writes."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import iter_expert_quantizers
    from modelopt_moe.distill import QADRecipe
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf, save_hf_config
    from modelopt_moe.export.check import check_all_engines
    from modelopt_moe.export.families import family_for_architecture, read_hf_config
    from modelopt_moe.export.mapping import STACKED
    from modelopt_moe.plugins.megatron import (
        destroy_model_parallel,
        distillation_model,
        init_model_parallel,
        load_sharded_checkpoint,
        save_sharded_checkpoint,
        select_trainable,
    )
    from modelopt_moe.plugins.megatron import training as mt
    from modelopt_moe.quantization.config import preset_path
    from modelopt_moe.report import gather_expert_stats
    from modelopt_moe.report.outcome import mean_and_noise, qad_outcome

    from .agreement import generation_stats, greedy_generate, held_out_prompts, top1_agreement
    from .evaluate import gather_logits, global_state, loss_and_kl
    from .text_data import text_batches

    t_start = time.perf_counter()
    out, art = Path(opts["out"]), Path(opts["out"]) / "artifacts"
    model_config = _model_configs()[opts["model"]]
    hf_config = read_hf_config(preset_path(model_config))
    family = family_for_architecture(hf_config)
    arch = family.arch_from_hf(hf_config)
    # Transformer Engine's layers on GPUs; Megatron-Core's Gated DeltaNet only in the local spec (hf_model.py says why)
    spec = "te" if opts["gpus"] and not arch.linear_attention_layers else "local"
    bs, seq, tp, ep = opts["batch_size"], opts["seq_len"], opts["tp"], opts["ep"]
    run: dict[str, Any] = {"title": "modelopt_moe demo: QAT of a MoE model, end to end", "stages": [], "losses": {},
                           "curves": {}, "format": opts["format"], "eval": {}}
    ok = True

    def stage(text: str) -> None:
        run["stages"].append(text)
        say(rank, f"[{len(run['stages'])}/6] {text}")

    def agree(flag: bool) -> bool:  # the same verdict on every rank (a collective every rank makes)
        t = torch.tensor([0.0 if flag else 1.0], device="cuda" if opts["gpus"] else "cpu")  # NCCL: on the GPU
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() == 0.0

    def build(source, seed):
        torch.manual_seed(seed)
        return build_megatron_model(source, spec=spec, params_dtype=torch.bfloat16)

    init_model_parallel(tp, ep, seed=opts["seed"])
    train = text_batches(bs, seq, max(1, opts["train_steps"]), offset=_TRAIN)
    calib = text_batches(bs, seq, opts["num_calib_batches"], offset=_CALIB)
    qad = text_batches(bs, seq, max(1, opts["steps"]), offset=_QAD)
    held_out = text_batches(bs, seq, opts["num_eval_batches"], offset=_EVAL)
    run["setup"] = [f"model: {model_config} ({family.architecture}: {arch.num_layers} layers, hidden "
                    f"{arch.hidden_size}, {arch.num_experts} experts top-{arch.top_k}), Megatron-Core {spec} spec",
                    f"{world_size} {'GPU' if opts['gpus'] else 'CPU'} ranks, TP={tp} EP={ep}; held-out numbers: "
                    f"means over {len(held_out)} batches of {bs} x {seq} tokens, ± their standard error",
                    f"data: English text from Python's standard library, byte tokens, {bs} x {seq} per step",
                    f"quantization: {opts['config']} ({opts['format']} experts)"]

    # 1. teacher ------------------------------------------------------------------------------------------------
    trainer = mt.setup_training(build(hf_config, opts["seed"]), lr=3e-3, lr_decay_steps=max(1, opts["train_steps"]))
    run["curves"]["bf16 teacher training"] = _train(rank, trainer, train, opts["train_steps"], "bf16 teacher")
    trained = mt.unwrap(trainer.model)
    teacher_hf = art / "teacher_hf"
    export_hf(trained, teacher_hf, format="hf", hf_config=hf_config, progress=False)
    teacher = build(teacher_hf, opts["seed"] + 1)  # other init: every weight must come from the file
    import_hf(teacher, teacher_hf)
    same = agree(all(torch.equal(a, b) for a, b in zip(trained.parameters(), teacher.parameters(), strict=True)))
    del trainer, trained
    teacher.eval()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    bf16 = loss_and_kl(teacher, held_out, None, tp_group)
    run["losses"]["bf16 teacher (held out)"] = bf16["loss"]
    run["eval"]["bf16 teacher"] = {"loss": bf16["losses"]}
    prompts = held_out_prompts(held_out, _GEN_PROMPTS, min(seq // 2, 32))
    end_token = hf_config.get("eos_token_id", _LINE_END)
    generated = {"bf16 teacher": greedy_generate(teacher, prompts, _GEN_TOKENS, multiple_of=tp)}
    curve = run["curves"]["bf16 teacher training"]
    stage(f"teacher: {opts['train_steps']} bf16 steps in Megatron's training loop (loss {curve[0][1]:.3f} -> "
          f"{curve[-1][1]:.3f}), saved as a Hugging Face checkpoint and imported back "
          f"{'bit-exact' if same else 'NOT bit-exact'}: held-out loss {bf16['loss']:.4f}")
    ok &= same

    # 2. PTQ ----------------------------------------------------------------------------------------------------
    student = build(teacher_hf, opts["seed"] + 2)
    import_hf(student, teacher_hf)
    student.eval()

    mtq.quantize(student, mtq.load_config(opts["config"]), calibration_loop(calib))
    ptq = loss_and_kl(student, held_out, teacher, tp_group)
    qad_seen = qad[:opts["num_eval_batches"]]  # the KL that QAD minimises, on batches it trains on
    ptq_seen_kl = loss_and_kl(student, qad_seen, teacher, tp_group)["kl"]
    run["losses"]["PTQ (held out)"] = ptq["loss"]
    run["eval"]["PTQ"] = {"loss": ptq["losses"], "kl": ptq["kls"],
                          "top1": top1_agreement(student, teacher, held_out, tp_group)}
    generated["PTQ"] = greedy_generate(student, prompts, _GEN_TOKENS, multiple_of=tp)
    enabled = sum(q.is_enabled for e in iter_expert_quantizers(student) for q in [e.quantizer])
    gap, gap_noise = mean_and_noise([q - b for q, b in zip(ptq["losses"], bf16["losses"], strict=True)])
    stage(f"PTQ: {enabled} expert quantizers ({opts['format']}) calibrated on {len(calib)} batches: held-out loss "
          f"{ptq['loss']:.5g} ({gap:+.2g}{'' if math.isnan(gap_noise) else f' ± {gap_noise:.2g}'} vs bf16), KL to "
          f"the teacher {ptq['kl']:.3g}")

    # 3. QAD ----------------------------------------------------------------------------------------------------
    # The default QAD recipe (docs/qad.md): the expert weights alone train, warmup then cosine decay.
    recipe = QADRecipe(**{k: v for k, v in (("lr", opts["lr"]), ("train", "all" if opts["train_all"] else None))
                          if v is not None})
    select_trainable(student, recipe)
    trained_what = "every parameter" if recipe.train == "all" else f"the {recipe.train} weights"
    trainer = mt.setup_training(distillation_model(student, teacher, recipe=recipe), recipe=recipe,
                                lr_decay_steps=max(1, opts["steps"]), reuse_quantized_weights=True)
    start = len(run["curves"]["bf16 teacher training"])
    run["curves"]["QAD (KL to the teacher)"] = _train(rank, trainer, qad, opts["steps"], "QAD", start)
    del trainer
    mtq.update_weight_amax(student)
    qad_eval = loss_and_kl(student, held_out, teacher, tp_group)
    qad_seen_kl = loss_and_kl(student, qad_seen, teacher, tp_group)["kl"]
    run["losses"]["KL to teacher on QAD data, after PTQ"] = ptq_seen_kl
    run["losses"]["KL to teacher on QAD data, after QAD"] = qad_seen_kl
    run["losses"]["QAD (held out)"] = qad_eval["loss"]
    run["losses"]["KL to teacher after PTQ"], run["losses"]["KL to teacher after QAD"] = ptq["kl"], qad_eval["kl"]
    run["eval"]["QAD"] = {"loss": qad_eval["losses"], "kl": qad_eval["kls"],
                          "top1": top1_agreement(student, teacher, held_out, tp_group)}
    generated["QAD"] = greedy_generate(student, prompts, _GEN_TOKENS, multiple_of=tp)
    run["generation"] = {"prompts": len(prompts), "prompt tokens": prompts.shape[1], "new tokens": _GEN_TOKENS,
                         "end token": end_token, "models": {m: generation_stats(g, end_token, generated["bf16 teacher"])
                                                            for m, g in generated.items()}}
    gen = run["generation"]["models"]
    # Said plainly, with the noise of each difference (the spread over the held-out batches): a share of the loss
    # gap closed only where that gap is larger than its noise, and a loss that got worse called worse.
    outcome = qad_outcome(bf16["losses"], ptq["losses"], qad_eval["losses"], ptq["kls"], qad_eval["kls"])
    run["outcome"] = outcome
    stage(f"QAD: {opts['steps']} steps training {trained_what} at lr {recipe.lr:g} (warmup, {recipe.lr_decay_style} "
          f"decay) on the KL to the bf16 teacher (Megatron's schedule, "
          f"fake-quantized weights reused within each step): KL on its data {ptq_seen_kl:.3g} -> {qad_seen_kl:.3g}; "
          f"{outcome['text']}; held out, the teacher's top-1 token at "
          f"{100 * sum(run['eval']['PTQ']['top1']) / len(held_out):.1f}% -> "
          f"{100 * sum(run['eval']['QAD']['top1']) / len(held_out):.1f}% of positions, and greedy generation from "
          f"{len(prompts)} prompts: the teacher's tokens at {100 * gen['PTQ']['same tokens as the reference']:.0f}% "
          f"-> {100 * gen['QAD']['same tokens as the reference']:.0f}%, mean length "
          f"{gen['PTQ']['mean length']:.1f} -> {gen['QAD']['mean length']:.1f} (teacher "
          f"{gen['bf16 teacher']['mean length']:.1f})")

    # 4. checkpoint ---------------------------------------------------------------------------------------------
    ckpt = art / "checkpoint"
    save_sharded_checkpoint([student], ckpt, iteration=opts["steps"])
    if rank == 0:
        save_hf_config(teacher_hf, ckpt)
    dist.barrier()
    student.eval()
    probe = held_out[0]
    with torch.no_grad():
        saved_logits = gather_logits(student, probe)
    saved_state = global_state(student)
    summary = mtq.print_quant_summary(student, file=False, gather=True)  # every rank: it gathers every expert
    stats = gather_expert_stats(student)
    del student, teacher
    init_model_parallel(tp, ep, seed=opts["seed"])  # fresh process groups, the same layout
    same_layout = build(teacher_hf, opts["seed"] + 3)
    load_sharded_checkpoint([same_layout], ckpt)
    same_layout.eval()
    with torch.no_grad():
        logits_same = agree(torch.equal(gather_logits(same_layout, probe), saved_logits))
    del same_layout
    other_tp, other_ep = 1, world_size if arch.num_experts % world_size == 0 else 1
    init_model_parallel(other_tp, other_ep, seed=opts["seed"])
    restored = build(teacher_hf, opts["seed"] + 4)
    load_sharded_checkpoint([restored], ckpt)
    restored.eval()
    state = global_state(restored)
    state_same = agree(state.keys() == saved_state.keys() and all(torch.equal(v, saved_state[k])
                                                                   for k, v in state.items()))
    with torch.no_grad():
        moved = _logit_agreement(gather_logits(restored, probe), saved_logits)
    run["losses"].update({f"checkpoint at another layout: logits {k}": moved[k] for k in _AGREEMENT})
    other = (f"at TP={other_tp} EP={other_ep} every weight and amax {'bit-identical' if state_same else 'DIFFERENT'}, "
             f"logits {_agreement_text(moved)}")
    if other_tp != tp:  # measured: as large with quantization off, none in fp32
        other += (f" (bf16 rounding: TP={tp} adds the row-parallel GEMMs' partial sums in bf16, as large without "
                  "quantization; the max sits at tokens where it flips a near-tied expert choice)")
    if (other_tp, other_ep) == (tp, ep):  # one process: there is no other layout to restore at
        other = f"every weight and amax {'bit-identical' if state_same else 'DIFFERENT'} in a second restore"
    stage(f"checkpoint: saved at TP={tp} EP={ep}; restored in fresh process groups into freshly built models: at "
          f"TP={tp} EP={ep} logits {'bit-identical' if logits_same else 'DIFFERENT'}; {other}")
    ok &= logits_same and state_same

    # 5. export -------------------------------------------------------------------------------------------------
    fused = [family.hf_tensor(p.canonical[0].format(L=0)) for p in family.megatron.layer
             if p.rule in STACKED and p.holder]  # the quantized ones: weights, not biases
    if opts["no_export"]:
        stage("export: skipped (--no-export)")
    elif fused and enabled:  # the same on every rank: a property of the family and the config
        stage(f"export: not written: {family.name} stores its experts fused as 3-D tensors ({', '.join(fused)}), and "
              "quantized fused experts export only as MXFP4 weights in the published layout (format='hf-mxfp4', "
              "docs/export.md); the checkpoint above holds them")
    else:
        ct, mo = art / "hf_compressed_tensors", art / "hf_modelopt"
        export_hf(restored, ct, format="compressed-tensors", hf_config=hf_config, progress=False)
        export_hf(restored, mo, format="modelopt", hf_config=hf_config, progress=False)
        mtq.disable_quantizer(restored, "*input_quantizer")  # transformers runs the experts weight-only
        with torch.no_grad():
            weight_only = gather_logits(restored, probe).float()
        agreement, fix = None, None
        if rank == 0:
            theirs, fix = _transformers_logits(ct, probe["tokens"])
            agreement = _logit_agreement(theirs, weight_only.cpu())
        dist.barrier()
        run["losses"]["transformers vs Megatron logits (max |diff|)"] = agreement and agreement["max |diff|"]
        run["losses"]["transformers vs Megatron logits (mean |diff|)"] = agreement and agreement["mean |diff|"]
        run["losses"]["transformers vs Megatron: same top-1 token"] = agreement and agreement["same top-1 token"]
        # measured: the unquantized bf16 models differ as much, and not at all in fp32
        text = "n/a on this rank" if agreement is None else (
            f"{_agreement_text(agreement)} (bf16 rounding in transformers' order of operations, not the export: the "
            "unquantized models differ as much; the max sits at tokens where it flips a near-tied expert choice)")
        how = "" if fix is None else (
            ", with modelopt_moe.export.transformers_compat.fix_nvfp4_experts() applied (transformers 5.13+ "
            "mis-scales NVFP4 experts without it)" if fix.applied else
            f", modelopt_moe.export.transformers_compat.fix_nvfp4_experts() not needed ({fix.note})")
        checked = [check_all_engines(d) for d in (ct, mo)] if rank == 0 else [(True, "n/a on this rank")]
        ok &= agree(all(passed for passed, _ in checked))
        stage(f"export: {ct} (compressed-tensors) and {mo} (Model Optimizer) written from TP={other_tp} "
              f"EP={other_ep}; transformers loads the first{how}; it dequantizes the weights and ignores input "
              f"scales, so it is compared with our weight-only forward: {text}; "
              f"{'; '.join(line for _, line in checked)}")

    # 6. report -------------------------------------------------------------------------------------------------
    report = None
    if rank == 0:
        from dataclasses import asdict

        from modelopt_moe.report.writer import write_report

        run["stats"] = asdict(stats)
        run["summary"] = summary
        run["seconds"] = time.perf_counter() - t_start
        report = str(out / "report.md")
        stage(f"report: {report} with the numbers, the quantizer summary and the plots ({run['seconds']:.0f} s "
              "in all)")
        write_report(run, out)  # after the stage line, which the report lists too
        (out / "run.json").write_text(json.dumps(run, indent=1))
    destroy_model_parallel()
    return {"ok": ok, "report": report, "run": run if rank == 0 else None}


_AGREEMENT = ("max |diff|", "mean |diff|", "same top-1 token")


def _logit_agreement(logits, reference) -> dict[str, float]:
    """How close two models' logits ``[batch, seq, vocab]`` are: the largest and the typical difference, and the
    share of positions with the same top-1 token (a bug moves all three; rounding only the first, at a few tokens)."""
    a, b = logits.float().cpu(), reference.float().cpu()
    diff = (a - b).abs()
    return {"max |diff|": diff.max().item(), "mean |diff|": diff.mean().item(),
            "same top-1 token": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "max |logit|": b.abs().max().item()}


def _agreement_text(a: dict[str, float]) -> str:
    return (f"max |diff| {a['max |diff|']:.2g}, mean |diff| {a['mean |diff|']:.2g} on logits up to "
            f"{a['max |logit|']:.2g} (bf16), the same top-1 token at {100 * a['same top-1 token']:.1f}% of positions")


def _transformers_logits(hf_dir: Path, tokens) -> tuple:
    """Logits of the exported compressed-tensors checkpoint as ``transformers`` loads it (dequantized, bf16), with
    the public NVFP4 experts fix in effect; and the fix's note."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from modelopt_moe.export import transformers_compat

    transformers_logging.set_verbosity_error()  # its load report lists the input scales it does not use
    transformers_logging.disable_progress_bar()
    # transformers 5.13+ mis-scales NVFP4 MoE experts; the fix is what users apply too (a no-op where not needed)
    with transformers_compat.fix_nvfp4_experts() as fix:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, quantization_config=CompressedTensorsConfig(
            dequantize=True), dtype=torch.bfloat16)
    with torch.no_grad():
        return model(tokens).logits.float(), fix
