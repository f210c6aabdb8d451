r"""``modelopt-moe qat``: quantization-aware training or distillation (QAD) of your own Megatron MoE model.

    # a published Hugging Face model (Qwen3-MoE, Mixtral): built and loaded by modelopt_moe, distilled from itself
    torchrun --nproc-per-node 8 -m modelopt_moe.plugins.cli qat --hf /models/Qwen3-30B-A3B \
        --config nvfp4_experts.yaml --distill --tp 2 --ep 4 --steps 1000 --save ckpt/qad
    # your own model: a function that builds it at the current parallel layout (Megatron-LM's model_provider)
    modelopt-moe qat --model-provider my_project.models:model_provider --config my_quant.yaml --save ckpt/qat

The steps are the ones the README's Megatron-LM recipe adds to a training script: build the model, quantize it with
the YAML config (calibrating on ``--calib-batches`` batches) before Megatron's ``Float16Module`` / DDP wrap and
optimizer, then train in Megatron's schedule with fake-quantized weights reused within each step. ``--distill``
trains the quantized student towards a frozen bf16 copy of the starting weights (forward KL, plus ``--lm-weight``
times the LM loss). ``--load`` resumes from a checkpoint this command saved (weights, amaxes, quantization state,
optimizer, LR scheduler, iteration) at any TP / EP layout; ``--export`` writes the result as a Hugging Face
checkpoint.

``--model-provider`` and ``--data`` name a function as ``package.module:function``; the module is searched in the
working directory first, then on ``sys.path`` (as ``python -m`` does), in every rank.

Data: ``--data module:function`` is called as ``function(split, num_batches, batch_size, seq_len, offset)`` with
``split`` ``"calib"`` or ``"train"`` and returns that many batches, each a dict of ``tokens`` / ``labels`` /
``position_ids`` (int64 ``[batch_size, seq_len]``, token and label ids in ``[0, vocab_size)``), ``attention_mask``
(bool, True where masked, broadcastable to ``[batch_size, 1, seq_len, seq_len]``; None: causal) and optionally
``loss_mask`` (``[batch_size, seq_len]``, nonzero where a token counts); every rank of a data-parallel replica must
get the same batches. Every batch is checked against the model before calibration starts: a batch that breaks this
contract stops the run with an error naming ``--data``, the split, the batch, the key and its value. Without
``--data``, the byte-level English text that ships with Python (a smoke test for models with a vocabulary of at
least 256). ``--eval-data module:function`` is called the same way with ``split`` ``"eval"`` (``--eval-batches``
batches, offset 0): the held-out loss and perplexity on them (and, with ``--distill``, the KL to the bf16 model) are
measured before training (after calibration, or after the resume) and after it.

Runs under ``torchrun`` / ``srun`` in the launcher's processes (one per GPU), or spawns ``--world-size`` processes
on this machine. SIGTERM (a scheduler's preemption: SLURM sends it before its SIGKILL) or Ctrl-C stops every rank
within seconds: the command says at which step, removes a save it did not finish and names the last complete
checkpoint (``--load`` it to resume), then exits with 128 + the signal (143, or 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any

from modelopt_moe.interrupt import Interrupted

from .inputs import model_sizes, read_hf_model_config, read_json_config, refuse_hf_model
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

__all__ = ["main", "resolve_callable"]


def resolve_callable(spec: str, flag: str):
    """``"package.module:function"`` -> the function; ValueError naming ``flag`` and what is wrong.

    The module is searched in the working directory first, as ``python -m`` does (the ``modelopt-moe`` console
    script alone would not look there), in every process that resolves it: the one that parses, spawned ranks and
    the ranks of ``torchrun`` / ``srun``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{flag} {spec!r}: expected 'package.module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{flag} {spec!r}: {module_name} has no function {attr!r}")
    return fn


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelopt-moe qat", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    src = p.add_argument_group("model")
    src.add_argument("--model-provider", help="'module:function' that builds the Megatron model at the current "
                                              "parallel layout (called with pre_process/post_process if it takes "
                                              "them; the module searched in the working directory first)")
    src.add_argument("--hf", help="a Hugging Face MoE directory of a supported family (Qwen3-MoE, Qwen3.5-MoE, "
                                  "DeepSeek-V3 / Kimi-K2, gpt-oss, GLM-4.5, Mixtral): its weights are the "
                                  "starting point (and the teacher's); builds the model itself without "
                                  "--model-provider")
    src.add_argument("--load", help="resume from a checkpoint saved by this command (at any layout)")
    p.add_argument("--config", required=True, help="quantization YAML (a path, or a shipped preset's name)")
    p.add_argument("--distill", action="store_true", help="QAD: distil from the frozen bf16 starting model")
    p.add_argument("--lm-weight", type=float, help="with --distill: weight of the LM loss added to the KL (default: "
                                                   "the QAD recipe's, 0)")
    p.add_argument("--temperature", type=float, help="with --distill: KL temperature (default: the recipe's, 1)")
    p.add_argument("--train", help="with --distill: the parameter groups that train, e.g. 'experts', "
                                   "'experts+dense', 'all' (default: the recipe's, 'experts')")
    p.add_argument("--teacher-fp8", choices=["per_tensor", "per_channel"],
                   help="with --distill: store the teacher's weights in FP8 E4M3 with per-tensor or per-channel "
                        "scales, dequantized per layer (about half its memory; default: the recipe's, off)")
    p.add_argument("--data", help="'module:function' giving the batches, the module searched in the working "
                                  "directory first (see below; default: shipped text)")
    p.add_argument("--eval-data", help="'module:function' giving held-out batches (split 'eval'): loss, perplexity "
                                       "and, with --distill, KL before and after training")
    p.add_argument("--eval-batches", type=int, default=8, help="batches of --eval-data (default: %(default)s)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: %(default)s)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--calib-batches", type=int, default=16, help="calibration batches (default: %(default)s)")
    p.add_argument("--lr", type=float, help="peak learning rate, cosine-decayed to a tenth (default: the QAD "
                                            "recipe's with --distill, 1e-5 without)")
    p.add_argument("--save", help="checkpoint directory written at the end (and every --save-interval steps)")
    p.add_argument("--save-interval", type=int, help="steps between checkpoints, >= 1 (default: at the end only)")
    p.add_argument("--export", help="write a Hugging Face checkpoint here at the end")
    p.add_argument("--export-format", choices=["compressed-tensors", "modelopt", "hf-mxfp4"],
                   default="compressed-tensors",
                   help="format of --export: compressed-tensors (vLLM, transformers), modelopt (NVIDIA Model "
                        "Optimizer's: vLLM, SGLang, TensorRT-LLM) or hf-mxfp4 (gpt-oss's published layout: MXFP4 "
                        "weight-only experts, every other layer unquantized) (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=24 * 3600.0,
                   help="seconds for the whole run (default: %(default)s, a day)")
    add_layout_args(p)
    args = p.parse_args(argv)
    if not (args.model_provider or args.hf):
        p.error("give --model-provider or --hf (the model to train)")
    if args.distill and args.load and not args.hf:
        p.error("--distill with --load needs --hf: the teacher's weights are not in the student's checkpoint")
    for name in ("steps", "micro_batches", "batch_size", "seq_len", "calib_batches", "eval_batches"):
        if getattr(args, name) < (0 if name == "steps" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'steps' else 1}")
    if args.save_interval is not None and args.save_interval < 1:
        p.error(f"--save-interval {args.save_interval} must be >= 1 (steps between checkpoints; leave it out to save "
                "at the end only)")
    if args.save_interval is not None and not args.save:
        p.error("--save-interval needs --save (the directory to write the checkpoints to)")
    # Sequence parallelism splits the sequence over TP; the heads and the vocabulary split over it too.
    experts, tp_divides = model_sizes(read_json_config(args.hf) if args.hf else {}, seq_len=args.seq_len)
    args.layout = check_layout(p, args, num_experts=experts, tp_divides=tp_divides)
    if not args.distill:
        for flag in ("lm_weight", "temperature", "train", "teacher_fp8"):
            if getattr(args, flag) is not None:
                p.error(f"--{flag.replace('_', '-')} needs --distill")
    try:
        args.recipe = _recipe(args) if args.distill else None
        if args.hf:  # what the files tell, before anything heavy is imported
            read_hf_model_config(args.hf, "--hf")
        if args.load and not any(Path(d).exists() for d in (args.load, f"{args.load}.old")):
            raise ValueError(f"--load {args.load}: no such directory (expected a checkpoint written by --save)")
        if args.load:
            refuse_hf_model(args.load, "--load", f"start from it with --hf {args.load} (--load resumes a run from "
                                                 "its --save directory)")
    except ValueError as e:
        p.error(str(e))
    return args


def _recipe(args: argparse.Namespace):
    """The default QAD recipe with the flags given."""
    from modelopt_moe.distill import QADRecipe

    changes = {"lr": args.lr, "lm_loss_weight": args.lm_weight, "temperature": args.temperature,
               "train": args.train, "teacher_fp8": args.teacher_fp8}
    return QADRecipe(**{k: v for k, v in changes.items() if v is not None})


def _build(opts: dict[str, Any]):
    """The model at the current layout: the user's provider, or the Hugging Face config's Megatron model."""
    import torch

    if opts["model_provider"]:
        provider = resolve_callable(opts["model_provider"], "--model-provider")
        params = inspect.signature(provider).parameters
        kwargs = {k: True for k in ("pre_process", "post_process") if k in params}
        return provider(**kwargs)
    from modelopt_moe.export import build_megatron_model

    return build_megatron_model(opts["hf"], spec="te" if opts["gpus"] else "local", params_dtype=torch.bfloat16)


def _batches(opts: dict[str, Any], split: str, num_batches: int, offset: int, vocab_size: int, flag: str = "--data"):
    """The batches of ``flag``'s function (each checked against the batch contract and the model's vocabulary), or
    the shipped text."""
    spec = opts[flag[2:].replace("-", "_")]
    if spec:
        from modelopt_moe.plugins.megatron import BatchError, check_lm_batch

        fn = resolve_callable(spec, flag)
        source = f"{flag} {spec}('{split}', {num_batches}, {opts['batch_size']}, {opts['seq_len']}, {offset})"
        got = fn(split, num_batches, opts["batch_size"], opts["seq_len"], offset)
        try:
            batches = None if isinstance(got, dict) else list(got)
        except TypeError:
            batches = None
        if batches is None:
            raise BatchError(f"{source} returned a {type(got).__name__}, not a list of batches")
        if not batches:
            raise BatchError(f"{source} returned no batches; expected {num_batches}")
        for i, batch in enumerate(batches):
            check_lm_batch(batch, vocab_size, source=f"{source}, batch {i}", batch_size=opts["batch_size"],
                           seq_len=opts["seq_len"])
        return batches
    if vocab_size < 256:
        raise ValueError(f"the shipped byte-level text needs a vocabulary of at least 256 tokens; the model has "
                         f"{vocab_size}: give --data")
    from .text_data import text_batches

    return text_batches(opts["batch_size"], opts["seq_len"], num_batches, offset=offset)


def _qat_rank(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of the run; a signal that stops it says where (``phase``): the step, the calibration, a save."""
    from modelopt_moe.interrupt import Interrupted, received_signal

    phase = {"now": "while starting"}
    try:
        return _run_rank(rank, opts, phase)
    except BaseException as e:
        signum = received_signal()  # an error after a signal (a peer stopped first) is the signal's doing
        if signum is None and not isinstance(e, Interrupted):
            raise
        raise Interrupted(signum or e.signum, phase["now"]) from None


def _run_rank(rank: int, opts: dict[str, Any], phase: dict[str, str]) -> dict[str, Any]:
    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import restore_sharded_modelopt_state
    from modelopt_moe.distill.teacher_fp8 import stored_bytes
    from modelopt_moe.export import export_hf, import_hf, save_hf_config
    from modelopt_moe.plugins.megatron import (
        destroy_model_parallel,
        distillation_model,
        init_model_parallel,  # Megatron's parallel groups (+ the CPU setup without CUDA)
        load_sharded_checkpoint,
        save_sharded_checkpoint,
        select_trainable,
    )
    from modelopt_moe.plugins.megatron import training as mt
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    from .evaluate import held_out_metrics as evaluate

    init_model_parallel(opts["tp"], opts["ep"], seed=1234)
    recipe = opts["recipe"]
    student = _build(opts)
    vocab = student.vocab_size
    # Every batch is checked against the model before anything costly starts (BatchError naming the flag).
    m = opts["micro_batches"]
    calib = None if opts["load"] else _batches(opts, "calib", opts["calib_batches"], 0, vocab)
    data = _batches(opts, "train", max(1, opts["steps"]) * m, opts["calib_batches"] * opts["batch_size"], vocab)
    held_out = _batches(opts, "eval", opts["eval_batches"], 0, vocab, "--eval-data") if opts["eval_data"] else None
    if opts["hf"] and not opts["load"]:  # resuming: the checkpoint holds the student's weights
        import_hf(student, opts["hf"])
    teacher = None
    if opts["distill"]:
        teacher = _build(opts)
        if opts["hf"]:
            import_hf(teacher, opts["hf"])
        else:
            teacher.load_state_dict(student.state_dict())
    start = 0
    if opts["load"]:
        restore_sharded_modelopt_state([student], opts["load"])
        say(rank, f"resuming from {opts['load']}")
    else:
        phase["now"] = "during calibration"
        student.eval()
        config = mtq.load_config(opts["config"])
        if recipe is not None and "weight_amax_update" not in config.model_fields_set:  # the YAML's own wins
            config = recipe.quant_config(config)
        mtq.quantize(student, config, calibration_loop(calib))
    if recipe is not None:
        select_trainable(student, recipe)  # the rest keeps the teacher's values
    teacher_bytes = stored_bytes(teacher) if teacher is not None else 0
    model = distillation_model(student, teacher, recipe=recipe) if teacher is not None else student
    if teacher is not None and recipe.teacher_fp8:
        say(rank, f"teacher weights in FP8 E4M3 ({recipe.teacher_fp8} scales): {stored_bytes(teacher) / 2**20:.2f} "
                  f"MiB on rank 0, {teacher_bytes / 2**20:.2f} MiB before")
    trainer = mt.setup_training(model, lr=opts["lr"] or 1e-5, lr_decay_steps=max(1, opts["steps"]), recipe=recipe,
                                reuse_quantized_weights=True)  # Megatron's distributed optimizer, as with GPUs
    if opts["load"]:
        with megatron_training_shims():  # the optimizer's checkpoint code moves tensors with .cuda()
            info = load_sharded_checkpoint([trainer.model], opts["load"], optimizer=trainer.optimizer,
                                           opt_param_scheduler=trainer.scheduler)
        start = info["iteration"] or 0
    # After the load: resumed quantizers get their amaxes with the weights (before it, every amax is None).
    summary = mtq.print_quant_summary(student, file=False, gather=True)  # a collective: every rank calls it
    say(rank, summary)

    def save(step: int) -> None:
        phase["now"] = f"while saving iteration {step}"
        with megatron_training_shims():
            save_sharded_checkpoint([trainer.model], opts["save"], optimizer=trainer.optimizer,
                                    opt_param_scheduler=trainer.scheduler, iteration=step)
        if rank == 0 and opts["hf"]:
            save_hf_config(opts["hf"], opts["save"])  # so that `modelopt-moe export` rebuilds the model

    evaluated = [evaluate(student, teacher, held_out)] if held_out and start < opts["steps"] else []
    losses = []
    bar = progress(rank, opts["steps"], "QAD" if teacher is not None else "QAT", initial=min(start, opts["steps"]))
    for step in range(start, opts["steps"]):
        phase["now"] = f"at step {step + 1} of {opts['steps']}"
        loss = mt.train_step(trainer, [data[(step * m + i) % len(data)] for i in range(m)], step=step)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4g}")
        bar.update(1)
        if opts["save"] and opts["save_interval"] and (step + 1) % opts["save_interval"] == 0:
            save(step + 1)
    bar.close()
    if opts["save"]:
        save(opts["steps"])
        say(rank, f"saved {opts['save']} (iteration {opts['steps']})")
    if held_out:
        evaluated.append(evaluate(student, teacher, held_out))
    if opts["export"]:
        phase["now"] = "during the export"
        out = export_hf(trainer.model, opts["export"], format=opts["export_format"],
                        hf_config=opts["hf"], progress=rank == 0)
        say(rank, f"exported {out} ({opts['export_format']})")
    destroy_model_parallel()
    return {"losses": losses, "start": start, "eval": evaluated}


def _eval_line(evaluated: list[dict[str, Any]]) -> str:
    """``loss a -> b, perplexity c -> d, KL e -> f`` (before and after training; one value without steps)."""
    names = {"loss": "loss", "perplexity": "perplexity", "kl": "KL to the bf16 model"}
    return ", ".join(f"{label} " + " -> ".join(f"{e[key]:.4g}" for e in evaluated)
                     for key, label in names.items() if evaluated[0][key] is not None)


_INPUT_ERRORS = ("BatchError", "CalibrationError")  # about the user's data: the message says it all


def _input_error(e: Exception) -> str:
    """A rank's error about the user's input (a batch, the calibration data) without the traceback around it."""
    text = str(e)
    for name in _INPUT_ERRORS:
        found = re.search(rf"^\S*\b{name}: ", text, flags=re.M)
        if found:
            rank = re.match(r"spawn: (rank \d+ of \d+)", text)
            message = text[found.end():].split("\n(ranks ")[0].rstrip()
            return f"{rank.group(1) + ': ' if rank else ''}{message}"
    return text


def _checkpoint_after_interrupt(save: str | None, load: str | None) -> str:
    """Removes the unfinished save of an interrupted run and names the last complete checkpoint (``--save``'s, else
    ``--load``'s) with its iteration, and how to resume from it."""
    from modelopt_moe.checkpoint.errors import CorruptCheckpointError, IncompleteCheckpointError
    from modelopt_moe.checkpoint.files import (
        check_checkpoint_dir,
        checkpoint_iteration,
        discard_unfinished_save,
        resolve_checkpoint_dir,
    )

    notes = []
    if save and (removed := discard_unfinished_save(save)) is not None:
        notes.append(f"removed the unfinished save {removed}")
    for ckpt in dict.fromkeys(d for d in (save, load) if d):
        try:
            path = check_checkpoint_dir(resolve_checkpoint_dir(ckpt))
        except (IncompleteCheckpointError, CorruptCheckpointError, OSError):
            continue
        iteration = checkpoint_iteration(path)
        at = "an unrecorded iteration" if iteration is None else f"iteration {iteration}"
        return "; ".join([f"last complete checkpoint: {at} in {path} (resume with --load {path})", *notes])
    none = "no complete checkpoint yet" if save else "no checkpoint (--save names where to write them)"
    return "; ".join([none, *notes])


def main(argv: list[str]) -> int:
    """``modelopt-moe qat``; returns the exit code (2: bad arguments, found before any process starts; 128 + the
    signal when SIGTERM or Ctrl-C stopped it)."""
    args = _parse_args(argv)
    import modelopt_moe.quantization as mtq
    from modelopt_moe.export.fused_mxfp4 import FILE_FORMAT, check_family
    from modelopt_moe.export.hf_checkpoint import HfCheckpointReader

    try:  # --hf's model as import_hf reads it: architecture, every tensor's shape and dtype, from the headers alone
        if args.hf:
            reader = HfCheckpointReader(args.hf)
            if args.export_format == FILE_FORMAT:  # export_hf's own check of the family, before training
                check_family(reader.family)
    except ValueError as e:
        print(f"modelopt-moe qat: --hf {args.hf}: {e}", file=sys.stderr)
        return 2
    try:  # fail fast, before starting processes
        mtq.load_config(args.config)
        for flag, spec in (("--model-provider", args.model_provider), ("--data", args.data),
                           ("--eval-data", args.eval_data)):
            if spec:
                resolve_callable(spec, flag)
    except (mtq.ConfigError, ValueError) as e:
        print(f"modelopt-moe qat: {e}", file=sys.stderr)
        return 2
    opts = {k: getattr(args, k) for k in ("model_provider", "hf", "load", "config", "distill", "recipe", "data",
                                          "eval_data", "eval_batches", "steps", "micro_batches", "batch_size",
                                          "seq_len", "calib_batches", "lr", "save", "save_interval", "export",
                                          "export_format", "tp", "ep")}
    opts["gpus"] = args.layout.gpus
    if prints_here():
        print(f"modelopt-moe qat: {args.layout.describe()}", flush=True)
    try:
        ran = run_ranks(_qat_rank, args.layout, args=(opts,), timeout=args.timeout)
    except Interrupted as e:  # every rank has stopped (spawned here), or this one (under a launcher)
        if prints_here():
            print(f"modelopt-moe qat: {e}; {_checkpoint_after_interrupt(args.save, args.load)}", file=sys.stderr,
                  flush=True)
        return e.exit_code
    except LayoutError as e:
        print(f"modelopt-moe qat: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as e:
        print(f"modelopt-moe qat: failed: {_input_error(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # under a launcher, this rank's own exception
        if type(e).__name__ not in _INPUT_ERRORS:
            raise
        print(f"modelopt-moe qat: failed: {e}", file=sys.stderr)
        return 1
    result = ran.results[0]
    losses = result["losses"]
    if prints_here():
        if losses:  # significant digits: a KL of 1e-5 is not 0.0000
            print(f"modelopt-moe qat: steps {result['start'] + 1}..{result['start'] + len(losses)}, loss "
                  f"{losses[0]:.4g} -> {losses[-1]:.4g}", flush=True)
        if result["eval"]:
            print(f"modelopt-moe qat: held-out ({args.eval_data}, {args.eval_batches} batches): "
                  f"{_eval_line(result['eval'])}", flush=True)
        print_warnings(ran.warnings)
    return 0
