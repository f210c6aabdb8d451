"""The QAD study: which distillation recipe brings a quantized MoE model closest to its teacher, and why the others
do not. Run by ``tools/bench_qat_recovery.py --study``; the measurements are in ``docs/qad.md``.

Inside every rank of a :func:`modelopt_moe.launch.spawn` job, :func:`run_study`:

1. trains a small Megatron MoE GPT in bf16 once (the *teacher*, which PTQ starts from);
2. quantizes copies of it (experts' weights and inputs, max calibration) per number format: *PTQ*;
3. runs every variant for the same steps on the same batches from those copies: ``<fmt>/<method>[:<changes>]``,
   ``method`` ``qad`` (KL to the frozen teacher) or ``qat`` (LM loss), trained with the default
   :class:`~modelopt_moe.distill.QADRecipe` and the changes, e.g. ``nvfp4/qad:train=all,lr=1e-4``;
4. measures each one on held-out text, batch by batch (KL(teacher || student) and LM loss, so the spread over
   batches and the ratio to PTQ paired by batch are known), the KL on batches it trained on at a few checkpoints
   (train KL vs held-out KL), how far each parameter group moved from the teacher's values, the share of tokens
   routed to other experts than the teacher's, the gradients' size and coherence per group, and for variants that
   train more than the experts, the KL with the non-expert parameters reset to the teacher's (and vice versa).

Data: ``data="split"`` cuts the corpus in two: the held-out text (its last ``eval_fraction``) is never trained on,
neither by the teacher nor by any variant; pretraining and recovery read the rest in order. ``data="legacy"`` is
the layout of ``qat_recovery.py`` (the English text, held out at a fixed offset; a long pretraining wraps around
the corpus and then trains on the "held-out" text too).

Variants run in the order given (the most important first); with ``time_budget_s`` those that would end past the
budget are skipped (the decision is rank 0's, broadcast, so every rank runs the same variants).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:  # the small Megatron models (tests/megatron_harness) are not part of the package
    sys.path.insert(0, _TESTS)

__all__ = ["StudyConfig", "run_study", "format_study", "format_seeds", "parse_variant", "variant_calibration",
           "ptq_key", "STUDY_VARIANTS", "FORMER",
           "LEARNED_INPUTS", "code_corpus", "study_data", "study_model", "train_teacher"]

# The former default recipe: every parameter at lr 1e-4, constant, no warmup.
FORMER = "train=all,lr=1e-4,lr_decay_style=constant,warmup_fraction=0"
# Learned input (activation) amaxes, one per layer as the study's experts keep them (experts.input_amax: shared),
# at 100x the recipe's learning rate: Adam moves a parameter by about its learning rate per step, and an
# activation amax is hundreds of times a weight.
LEARNED_INPUTS = "input_amax_update=learned,amax_lr_mult=100"
# The study's variants, the most important first (a time budget cuts the tail): the default recipe against PTQ and
# the former recipe, the bounds (the weights' share, the inputs' share), then one change each.
STUDY_VARIANTS = (
    "nvfp4/qad",
    f"nvfp4/qad:{LEARNED_INPUTS}",
    f"nvfp4/qad:{FORMER}",
    "fp8/qad",
    f"fp8/qad:{LEARNED_INPUTS}",
    "nvfp4-w/qad",
    "nvfp4/qad:train=all,lr=1e-5",
    "nvfp4/qad:lr=1e-4",
    "nvfp4/qad:lr=1e-5",
    "nvfp4/qat",
    "nvfp4-a/qad",
    "nvfp4/qad:train=all",
    "nvfp4/qad:train=all-router-embedding-output-norms",
    "nvfp4/qad:lr_decay_style=constant,warmup_fraction=0",
    "nvfp4/qad:temperature=2",
    "nvfp4/qad:lm_loss_weight=0.5",
    "nvfp4/qad:weight_amax_update=static",
    "nvfp4/qad:weight_amax_update=learned",
    f"nvfp4/qad:{FORMER},adam_eps=1e-5",
    "nvfp4/qad:adam_beta2=0.95",
    "nvfp4/qad:weight_decay=0.1",
    "nvfp4/qad:train=all-router",
    f"fp8/qad:{FORMER}",
    "fp8/qat",
    f"nvfp4-w/qad:{FORMER}",
    "nvfp4/qad:train=all,lr=1e-4",
    "nvfp4/qad:adam_eps=1e-6",
)
# Study-only formats: nvfp4_46's config with each block's 4-or-6 candidate chosen by another rule
# (tools/four_over_six_rules.py); nvfp4_46mse is the library's rule through the same path (the check of that path).
RULE_FORMATS = {"nvfp4_46mse": "mse", "nvfp4_46l1": "l1_norm", "nvfp4_46amax": "abs_max"}
# The experts' MLP (StudyConfig.model_overrides): none (the study models' own), or gated (SwiGLU, GeGLU).
GLUS = {"none": {}, "swiglu": {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu},
        "geglu": {"gated_linear_unit": True, "activation_func": torch.nn.functional.gelu}}


@dataclasses.dataclass
class StudyConfig:
    """The study's knobs (defaults: a small CPU model)."""

    tp: int = 1
    ep: int = 1
    experts: str = "sequential"  # "sequential" | "grouped" | "te" (GPU)
    num_layers: int = 2
    hidden: int = 64
    ffn_hidden: int = 256
    num_experts: int = 4
    topk: int = 2
    seq: int = 64
    batch: int = 8
    pretrain_steps: int = 300
    pretrain_lr: float = 3e-3
    steps: int = 100
    eval_batches: int = 8
    train_eval_batches: int = 4  # the first recovery batches: the "train KL"
    calib_batches: int = 2
    checkpoints: tuple[int, ...] = ()  # steps at which KLs are measured (default: a quarter, half, the end)
    variants: tuple[str, ...] = STUDY_VARIANTS
    recipe: dict = dataclasses.field(default_factory=dict)  # changes to QADRecipe() that every variant starts from
    data: str = "split"  # "split" | "legacy"
    corpus: str = "code"  # "code" (the standard library's Python source) | "text" (its English help topics)
    eval_fraction: float = 0.05
    time_budget_s: float = 0.0  # 0: no budget
    partial_json: str = ""  # rank 0 rewrites the results so far here after every variant
    seed: int = 1234
    model_overrides: dict = dataclasses.field(default_factory=dict)  # more build_moe_gpt arguments


def parse_variant(spec: str, base: dict | None = None):
    """``"nvfp4/qad:lr=1e-4,train=all"`` -> ``("nvfp4", "qad", QADRecipe(**base, lr=1e-4, train="all"))``.

    ``calib=<name>`` among the changes calibrates the variant's start (PTQ) with ``name``, a key of
    ``megatron_harness.configs.CALIBRATIONS`` (:func:`variant_calibration`; default ``max``); calibrations that
    choose weight amaxes (``mse``, ``fp8_sweep``, ``four_over_six``) make ``weight_amax_update`` ``static`` unless the
    variant sets it (``dynamic`` would replace the chosen amaxes at the first step); ``smooth`` rescales the experts'
    weights first (gated experts only; the start's parameter drift counts the rescale). Method ``ptq``: the start
    alone, no training.

    Raises:
        ValueError: an unknown format, method, calibration or recipe field, a calibration the format has no use for,
            or a bad value (naming the variant).
    """
    from megatron_harness.configs import CALIBRATIONS, WEIGHT_CALIBRATIONS, expert_quant_config

    from modelopt_moe.distill import QADRecipe

    head, _, changes = spec.partition(":")
    fmt, _, method = head.partition("/")
    formats = ("nvfp4", "nvfp4_46", "nvfp4_46in", "nvfp4_46w", "fp8", "int8", "mxfp4", "mxfp8", "fp8_block",
               *RULE_FORMATS)
    if fmt.split("-")[0] not in formats or fmt.partition("-")[2] not in ("", "w", "a") or (
            method not in ("qad", "qat", "ptq")):
        raise ValueError(f"variant {spec!r}: expected '<{'|'.join(formats)}>[-w|-a]/<qad|qat|ptq>[:field=value,...]'")
    fields = {f.name: f for f in dataclasses.fields(QADRecipe)}
    kwargs = dict(base or {})
    calib = "max"
    for item in filter(None, changes.split(",")):
        key, _, value = item.partition("=")
        if key == "calib":
            if value not in CALIBRATIONS:
                raise ValueError(f"variant {spec!r}: unknown calibration {value!r}; expected one of "
                                 f"{sorted(CALIBRATIONS)}")
            calib = value
            continue
        if key not in fields:
            raise ValueError(f"variant {spec!r}: unknown QADRecipe field {key!r}; expected one of "
                             f"{sorted([*fields, 'calib'])}")
        default = getattr(QADRecipe(), key)
        kwargs[key] = value if default is None or isinstance(default, str) else type(default)(value)
    if calib in WEIGHT_CALIBRATIONS and kwargs.get("weight_amax_update", "dynamic") == "dynamic":
        kwargs["weight_amax_update"] = "static"
    try:
        expert_quant_config(_config_format(fmt.split("-")[0]), "static", calib)
        return fmt, method, QADRecipe(**kwargs)
    except ValueError as e:
        raise ValueError(f"variant {spec!r}: {e}") from e


def _config_format(fmt: str) -> str:
    """The key of ``megatron_harness.configs.EXPERT_FORMATS`` a study format quantizes with."""
    return "nvfp4_46" if fmt in RULE_FORMATS else fmt


def variant_calibration(spec: str) -> str:
    """The calibration a variant starts from: its ``calib=`` change, ``max`` without one."""
    changes = spec.partition(":")[2]
    return next((item.partition("=")[2] for item in changes.split(",") if item.startswith("calib=")), "max")


def ptq_key(fmt: str, calib: str) -> str:
    """The key of a start (PTQ) in the study's ``ptq``: the format, with ``:calib=<name>`` unless max-calibrated."""
    return fmt if calib == "max" else f"{fmt}:calib={calib}"


def code_corpus() -> bytes:
    """The Python source of the standard library (tests, IDLE, tkinter and the turtle demos left out), files in
    sorted order: about 10 MB of one language, enough to pretrain without repeating it."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__", "lib2to3", "tkinter",
            "turtledemo"}
    parts = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    parts.append(f.read())
    return b"\n\n".join(parts)


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "median": statistics.median(values), "min": min(values), "max": max(values)}


def study_data(cfg: StudyConfig) -> dict:
    """Pretraining, recovery (calibration = its first batches), train-eval and held-out batches, and what they
    cover: ``{"pretrain", "recover", "held_out", "info"}``."""
    from modelopt_moe.plugins.cli.text_data import corpus_bytes, text_batches

    per_batch = cfg.batch * cfg.seq
    if cfg.data == "legacy":
        pretrain = text_batches(cfg.batch, cfg.seq, cfg.pretrain_steps)
        recover = text_batches(cfg.batch, cfg.seq, cfg.steps, offset=cfg.pretrain_steps * cfg.batch)
        held_out = text_batches(cfg.batch, cfg.seq, cfg.eval_batches, offset=5000)
        n = len(corpus_bytes())
        info = {"corpus_bytes": n, "train_bytes": n, "held_out_bytes": n,
                "pretrain_epochs": cfg.pretrain_steps * per_batch / n,
                "note": "held-out text at a fixed offset of the corpus the teacher trains on (wraps around)"}
        return {"pretrain": pretrain, "recover": recover, "held_out": held_out, "info": info}
    if cfg.data != "split":
        raise ValueError(f"StudyConfig.data={cfg.data!r}: expected 'split' or 'legacy'")
    if cfg.corpus == "code":
        corpus = code_corpus()
    elif cfg.corpus == "text":
        corpus = corpus_bytes()
    else:
        raise ValueError(f"StudyConfig.corpus={cfg.corpus!r}: expected 'code' or 'text'")
    cut = int(len(corpus) * (1 - cfg.eval_fraction))
    train_part, held_part = corpus[:cut], corpus[cut:]
    need = cfg.eval_batches * cfg.batch * (cfg.seq + 1)
    if need > len(held_part):
        raise ValueError(f"StudyConfig: {cfg.eval_batches} held-out batches of {cfg.batch} x {cfg.seq} need "
                         f"{need} bytes; the held-out {cfg.eval_fraction:.0%} of the {cfg.corpus} corpus has "
                         f"{len(held_part)}: lower eval_batches or raise eval_fraction")
    pretrain = text_batches(cfg.batch, cfg.seq, cfg.pretrain_steps, corpus=train_part)
    recover = text_batches(cfg.batch, cfg.seq, cfg.steps, offset=cfg.pretrain_steps * cfg.batch, corpus=train_part)
    held_out = text_batches(cfg.batch, cfg.seq, cfg.eval_batches, corpus=held_part)
    info = {"corpus": cfg.corpus, "corpus_bytes": len(corpus), "train_bytes": len(train_part),
            "held_out_bytes": len(held_part), "pretrain_epochs": cfg.pretrain_steps * per_batch / len(train_part),
            "recovery_repeats_pretraining": (cfg.pretrain_steps + cfg.steps) * per_batch > len(train_part)}
    return {"pretrain": pretrain, "recover": recover, "held_out": held_out, "info": info}


class _Routing:
    """Records every router's top-k choice (``routing_map``) in the forwards made while active."""

    def __init__(self, model):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
        self.maps: list[torch.Tensor] = []
        self._handles = []

    def __enter__(self):
        self.maps = []

        def hook(module, args, output):  # returns None: the output stays the router's
            self.maps.append(output[1].detach().clone())

        self._handles = [r.register_forward_hook(hook) for r in self.routers]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


def study_model(cfg: StudyConfig, weights: dict | None = None):
    """The study's bf16 Megatron MoE GPT (its initialization by ``cfg.seed``); with ``weights`` (name -> tensor, e.g.
    a trained teacher's parameters), a copy of those (Megatron's model parallelism initialised)."""
    import megatron_harness.models as mm

    model = mm.build_moe_gpt(num_layers=cfg.num_layers, hidden=cfg.hidden, ffn_hidden=cfg.ffn_hidden,
                             num_experts=cfg.num_experts, moe_router_topk=cfg.topk, seq_len=cfg.seq,
                             params_dtype=torch.bfloat16, seed=cfg.seed, experts=cfg.experts, **cfg.model_overrides)
    if weights is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
    return model


def train_teacher(cfg: StudyConfig, batches: list[dict]) -> tuple[torch.nn.Module, list[float]]:
    """The study's teacher: :func:`study_model` trained in bf16 for ``cfg.pretrain_steps`` steps of ``batches`` (the
    ``"pretrain"`` batches of :func:`study_data`) at ``cfg.pretrain_lr``; returns it in eval mode and the losses."""
    from modelopt_moe.plugins.megatron import training as mt

    trainer = mt.setup_training(study_model(cfg), lr=cfg.pretrain_lr, lr_decay_steps=cfg.pretrain_steps,
                                use_distributed_optimizer=False)
    losses = mt.train(trainer, batches, steps=cfg.pretrain_steps, num_microbatches=1)
    return mt.unwrap(trainer.model).eval(), losses


def _all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def run_study(cfg: StudyConfig, verbose: bool = False) -> dict:
    """Runs the study on this rank (``torch.distributed`` initialised, world size a multiple of TP and EP);
    ``verbose``: print a line per finished stage (give it to one rank).

    Returns:
        ``{"config", "data", "teacher", "ptq": {fmt: ...}, "variants": {spec: ...}, "skipped": [...], "seconds"}``,
        the same on every rank (see :func:`format_study` for what each entry holds).
    """
    import megatron_harness.models as mm
    from megatron_harness.configs import WEIGHT_CALIBRATIONS, expert_quant_config

    import modelopt_moe.quantization as mtq
    from modelopt_moe.distill import logits_kl_loss, param_group, vocab_parallel_cross_entropy
    from modelopt_moe.plugins.megatron import distillation_model, select_trainable
    from modelopt_moe.plugins.megatron import training as mt

    t_start = time.perf_counter()
    # bad specs fail before any training
    specs = [(s, *parse_variant(s, cfg.recipe), variant_calibration(s)) for s in cfg.variants]
    checkpoints = sorted(set(cfg.checkpoints or (max(1, cfg.steps // 4), max(1, cfg.steps // 2), cfg.steps)))
    checkpoints = [c for c in checkpoints if 0 < c <= cfg.steps] or [cfg.steps]
    mm.init_model_parallel(cfg.tp, cfg.ep, seed=cfg.seed)
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    data = study_data(cfg)
    recover, held_out = data["recover"], data["held_out"]
    train_eval = recover[:cfg.train_eval_batches]
    calib = recover[:cfg.calib_batches]

    # 1. the teacher, once ----------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    teacher, pre_losses = train_teacher(cfg, data["pretrain"])
    teacher_weights = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    device = next(teacher.parameters()).device

    def forward(model, batch):
        b = {k: v.to(device) for k, v in batch.items()}
        return model(b["tokens"], b["position_ids"], b["attention_mask"]), b["labels"]

    with torch.no_grad():
        teacher_logits = {id(b): forward(teacher, b)[0] for b in held_out + train_eval}
        teacher_top1 = {i: _top1(logits, tp_group) for i, logits in teacher_logits.items()}
        with _Routing(teacher) as routing:
            forward(teacher, held_out[0])
        teacher_routes = routing.maps

    def evaluate(model, batches) -> dict:
        """Per batch: LM loss and KL to the teacher (every rank: the losses reduce over TP)."""
        was_training = model.training
        model.eval()
        losses, kls, flips = [], [], []
        with torch.no_grad():
            for b in batches:
                logits, labels = forward(model, b)
                losses.append(float(vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group).mean()))
                kls.append(float(logits_kl_loss(logits, teacher_logits[id(b)], tp_group=tp_group).mean()))
                flips.append(float((_top1(logits, tp_group) != teacher_top1[id(b)]).double().mean()))
        model.train(was_training)
        return {"loss": losses, "kl": kls, "top1_flips": flips}

    def route_flips(model) -> float:
        """Share of (token, layer) whose top-k expert set differs from the teacher's, on the first held-out batch."""
        was_training = model.training
        model.eval()
        with torch.no_grad(), _Routing(model) as routing:
            forward(model, held_out[0])
        model.train(was_training)
        diff = sum(float((a != b).any(-1).sum()) for a, b in zip(routing.maps, teacher_routes, strict=True))
        total = sum(a.shape[0] for a in routing.maps)
        diff, total = _all_sum([diff, total], device)
        return diff / total if total else math.nan

    def drift(model) -> dict:
        """Per parameter group: ||w - w_teacher|| / ||w_teacher|| (over every rank)."""
        sums: dict[str, list[float]] = {}
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in teacher_weights:
                    t = teacher_weights[n].float()
                    s = sums.setdefault(param_group(n), [0.0, 0.0])
                    s[0] += float((p.float() - t).square().sum())
                    s[1] += float(t.square().sum())
        groups = sorted(sums)
        total = _all_sum([x for g in groups for x in sums[g]], device)
        return {g: math.sqrt(total[2 * i] / total[2 * i + 1]) if total[2 * i + 1] else 0.0
                for i, g in enumerate(groups)}

    def split_kl(model, fmt, gemms: bool = False) -> dict:
        """Held-out KL with only the expert weight quantizers on, and with only the input quantizers on (``gemms``:
        also with only fc1's inputs, and only fc2's)."""
        if "-" in fmt:
            return {"kl_weights_only": math.nan, "kl_inputs_only": math.nan}
        cases = [("kl_weights_only", ["*experts*input_quantizer"]),
                 ("kl_inputs_only", ["*experts*weight_quantizer"])]
        if gemms:
            cases += [("kl_fc1_inputs_only", ["*experts*weight_quantizer", "*experts*linear_fc2*input_quantizer"]),
                      ("kl_fc2_inputs_only", ["*experts*weight_quantizer", "*experts*linear_fc1*input_quantizer"])]
        out = {}
        for key, off in cases:
            for pattern in off:
                mtq.disable_quantizer(model, pattern)
            out[key] = statistics.fmean(evaluate(model, held_out)["kl"])
            for pattern in off:
                mtq.enable_quantizer(model, pattern)
        return out

    def weight_rms(model) -> dict:
        """Per parameter group: the RMS of its elements (over every rank), the scale Adam's steps compare to."""
        sums: dict[str, list[float]] = {}
        for n, p in model.named_parameters():
            s = sums.setdefault(param_group(n), [0.0, 0.0])
            s[0] += float(p.detach().float().square().sum())
            s[1] += p.numel()
        groups = sorted(sums)
        total = _all_sum([x for g in groups for x in sums[g]], device)
        return {g: math.sqrt(total[2 * i] / total[2 * i + 1]) for i, g in enumerate(groups)}

    def copy_of_teacher():
        return study_model(cfg, teacher_weights)

    def quantized(fmt, amax_update, input_amax_update="static", calibration="max"):
        """The teacher quantized to ``fmt``: ``nvfp4`` / ``fp8`` / ``int8`` (experts' weights and inputs), with
        ``-w`` the weights alone, with ``-a`` the inputs alone; calibrated by ``calibration`` (``CALIBRATIONS``)."""
        model = copy_of_teacher()
        model.eval()
        base, _, only = fmt.partition("-")
        if base in RULE_FORMATS:
            from four_over_six_rules import use_rule

            use_rule(model, RULE_FORMATS[base])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, {**expert_quant_config(_config_format(base), amax_update, calibration),
                                 "input_amax_update": input_amax_update},
                         lambda m: [forward(m, b) for b in calib])
        if only:
            mtq.disable_quantizer(model, "*experts*input_quantizer" if only == "w" else "*experts*weight_quantizer")
        return model.train()

    config = {**dataclasses.asdict(cfg), "model_overrides": {k: getattr(v, "__name__", v)  # e.g. "silu", for JSON
                                                             for k, v in cfg.model_overrides.items()}}
    out = {"config": config, "data": data["info"], "checkpoints": checkpoints,
           "teacher": {**evaluate(teacher, held_out), "pretrain_losses": pre_losses[::max(1, len(pre_losses) // 50)],
                       "weight_rms": weight_rms(teacher), "seconds": time.perf_counter() - t0},
           "ptq": {}, "variants": {}, "skipped": []}

    def report(line: str) -> None:
        if verbose:
            print(f"[study {time.perf_counter() - t_start:6.0f} s] {line}", flush=True)
        if verbose and cfg.partial_json:
            import json

            partial = {**out, "seconds": time.perf_counter() - t_start, "partial": True}
            with open(cfg.partial_json, "w") as f:
                json.dump(partial, f, indent=1, default=str)

    report(f"teacher: {cfg.pretrain_steps} steps, loss {pre_losses[0]:.3f} -> {pre_losses[-1]:.3f}, held-out "
           f"{statistics.fmean(out['teacher']['loss']):.4f}; weight RMS "
           + " ".join(f"{g} {v:.3g}" for g, v in out["teacher"]["weight_rms"].items()))

    # 2. PTQ per format and calibration (max first: the others are measured against it) ----------------------------
    starts = dict.fromkeys((f, c) for _, f, _, _, cal in specs for c in ("max", cal))
    for fmt, cal in starts:
        key = ptq_key(fmt, cal)
        model = quantized(fmt, "static" if cal in WEIGHT_CALIBRATIONS else "dynamic", calibration=cal)
        out["ptq"][key] = {**evaluate(model, held_out), "train_kl": evaluate(model, train_eval)["kl"],
                           "route_flips": route_flips(model), **split_kl(model, fmt, gemms=True),
                           "format": fmt, "calibration": cal}
        del model
        p = out["ptq"][key]
        p["kl_vs_max_ptq"] = statistics.fmean(p["kl"]) / statistics.fmean(out["ptq"][fmt]["kl"])
        split = ", ".join(f"{k[3:]} {v:.5f}" for k, v in p.items() if k.startswith("kl_") and k != "kl_vs_max_ptq"
                          and v == v)
        report(f"{_ptq_label(key)}: held-out KL {statistics.fmean(p['kl']):.5f} ({p['kl_vs_max_ptq']:.2f} x max "
               f"PTQ; {split}), top-1 flips {100 * statistics.fmean(p['top1_flips']):.2f}%, loss "
               f"{statistics.fmean(p['loss']):.4f}")

    def run_variant(fmt, method, recipe, cal) -> dict:
        student = quantized(fmt, recipe.weight_amax_update, recipe.input_amax_update, cal)
        trained = select_trainable(student, recipe)
        model = distillation_model(student, teacher, recipe=recipe) if method == "qad" else student
        trainer = mt.setup_training(model, recipe=recipe, lr_decay_steps=cfg.steps, use_distributed_optimizer=False,
                                    reuse_quantized_weights=True)
        grads = _GradStats(student, param_group)
        curve, losses = [], []
        for step in range(cfg.steps):
            losses.append(mt.train_step(trainer, [recover[step]], step=step, after_backward=grads.collect))
            if step + 1 in checkpoints:
                mtq.update_weight_amax(student)
                held = evaluate(student, held_out)
                curve.append({"step": step + 1, "train_kl": statistics.fmean(evaluate(student, train_eval)["kl"]),
                              "held_out_kl": statistics.fmean(held["kl"]),
                              "held_out_loss": statistics.fmean(held["loss"])})
        r = {"format": fmt, "method": method, "calibration": cal, "ptq_key": ptq_key(fmt, cal),
             "recipe": recipe.to_dict(), **held, "curve": curve,
             "train_losses": losses, "drift": drift(student), "route_flips": route_flips(student),
             "grads": grads.summary(device), "trained_elements": _all_sum([float(sum(trained.values()))], device)[0],
             **split_kl(student, fmt)}
        if set(recipe.trained_groups) - {"experts"}:
            r.update(_decompose(student, teacher_weights, param_group, lambda: evaluate(student, held_out)["kl"]))
        return r

    # 3. the variants ---------------------------------------------------------------------------------------------
    longest = 0.0
    for spec, fmt, method, recipe, cal in specs:
        if method == "ptq":  # the start alone: measured above
            continue
        elapsed = time.perf_counter() - t_start
        go = torch.tensor([1.0 if not cfg.time_budget_s or elapsed + 1.1 * longest <= cfg.time_budget_s else 0.0],
                          device=device)
        if dist.is_initialized():
            dist.broadcast(go, src=0)  # rank 0 decides: every rank runs the same variants
        if go.item() == 0.0:
            out["skipped"].append(spec)
            report(f"{spec}: skipped (time budget)")
            continue
        t0 = time.perf_counter()
        try:
            r = run_variant(fmt, method, recipe, cal)
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others' measurements
            out["variants"][spec] = {"format": fmt, "method": method, "calibration": cal, "recipe": recipe.to_dict(),
                                     "error": f"{type(e).__name__}: {e}"}
            report(f"{spec}: FAILED ({type(e).__name__}: {e})")
            continue
        r["seconds"] = time.perf_counter() - t0
        longest = max(longest, r["seconds"])
        out["variants"][spec] = r
        ptq_kl = statistics.fmean(out["ptq"][ptq_key(fmt, cal)]["kl"])
        report(f"{spec}: held-out KL {statistics.fmean(r['kl']):.5f} ({statistics.fmean(r['kl']) / ptq_kl:.2f} x "
               f"PTQ; weights alone {r['kl_weights_only']:.5f}), train KL {r['curve'][-1]['train_kl']:.5f}, loss "
               f"{statistics.fmean(r['loss']):.4f}, {r['seconds']:.0f} s")
    mm.destroy_model_parallel()
    out["seconds"] = time.perf_counter() - t_start
    _summarize(out)
    return out


class _GradStats:
    """Per parameter group, from ``main_grad`` after every backward: the gradient's RMS at the first step and at the
    last, and its coherence over the run, ``||sum_t g_t|| / sqrt(T * sum_t ||g_t||^2)`` (1: every step pushes the
    same way; about ``1/sqrt(T)``: the steps are noise). Accumulated on the device, read once at the end."""

    def __init__(self, model, group_of):
        named = [(group_of(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.groups = sorted({g for g, _ in named})
        self.index = [self.groups.index(g) for g, _ in named]
        self.params = [p for _, p in named]
        self.numel = [0] * len(self.groups)
        for i, p in zip(self.index, self.params, strict=True):
            self.numel[i] += p.numel()
        self.sums = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.sq = self.first = self.last = None
        self.steps = 0

    def _by_group(self, values: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(len(self.groups), dtype=torch.float64, device=values[0].device)
        return out.index_add_(0, torch.tensor(self.index, device=out.device), torch.stack(values).double())

    def collect(self) -> None:
        if not self.params:
            return
        grads = [(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).float() for p in self.params]
        torch._foreach_add_(self.sums, grads)
        now = self._by_group([n.square() for n in torch._foreach_norm(grads)])
        self.sq = now.clone() if self.sq is None else self.sq + now
        self.first = now if self.first is None else self.first
        self.last = now
        self.steps += 1

    def summary(self, device) -> dict:
        if not self.params or not self.steps:
            return {}
        summed = self._by_group([n.square() for n in torch._foreach_norm(self.sums)])
        vals = _all_sum(torch.cat([self.first, self.last, self.sq, summed]).tolist()
                        + [float(n) for n in self.numel], device)
        k = len(self.groups)
        out = {}
        for i, g in enumerate(self.groups):
            first, last, sq, summ, n = (vals[j * k + i] for j in range(5))
            out[g] = {"rms_first": math.sqrt(first / n), "rms_last": math.sqrt(last / n),
                      "coherence": math.sqrt(summ / (self.steps * sq)) if sq else math.nan}
        return out


def _decompose(student, teacher_weights, group_of, held_out_kl) -> dict:
    """Held-out KL with the trained non-expert parameters reset to the teacher's (the experts' training alone), and
    with the experts reset instead (the rest's training alone). The student ends as trained."""
    saved = {n: p.detach().clone() for n, p in student.named_parameters() if n in teacher_weights}
    out = {}
    with torch.no_grad():
        for key, reset in (("kl_experts_trained_only", lambda g: g != "experts"),
                           ("kl_rest_trained_only", lambda g: g == "experts")):
            for n, p in student.named_parameters():
                if n in teacher_weights and reset(group_of(n)):
                    p.copy_(teacher_weights[n])
            out[key] = statistics.fmean(held_out_kl())
            for n, p in student.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
    return out


def _summarize(out: dict) -> None:
    """Adds the statistics over held-out batches and the ratios to PTQ (of the means, and paired by batch)."""
    measured = [r for r in out["variants"].values() if "error" not in r]
    for r in [out["teacher"], *out["ptq"].values(), *measured]:
        r["kl_stats"] = _stats(r["kl"]) if "kl" in r else None
        r["loss_stats"] = _stats(r["loss"])
    for r in measured:
        ptq = out["ptq"][r.get("ptq_key", r["format"])]
        r["kl_vs_max_ptq"] = statistics.fmean(r["kl"]) / statistics.fmean(out["ptq"][r["format"]]["kl"])
        r["kl_vs_ptq"] = statistics.fmean(r["kl"]) / statistics.fmean(ptq["kl"])
        r["kl_vs_ptq_by_batch"] = _stats([a / b for a, b in zip(r["kl"], ptq["kl"], strict=True)])
        r["loss_minus_ptq"] = _stats([a - b for a, b in zip(r["loss"], ptq["loss"], strict=True)])
        ptq_train = statistics.fmean(ptq["train_kl"])
        r["train_kl_vs_ptq"] = [c["train_kl"] / ptq_train for c in r["curve"]]
        r["held_out_kl_vs_ptq"] = [c["held_out_kl"] / statistics.fmean(ptq["kl"]) for c in r["curve"]]


def format_study(out: dict) -> str:
    """The study as text: one row per variant, then the train-KL vs held-out-KL curves and the parameter drift."""
    cfg, info = out["config"], out["data"]
    teacher = out["teacher"]
    lines = [f"teacher: {cfg['num_layers']} layers, hidden {cfg['hidden']}, {cfg['num_experts']} experts top-"
             f"{cfg['topk']} (expert FFN {cfg['ffn_hidden']}{_glu(cfg)}), {cfg['experts']} experts, TP{cfg['tp']} "
             f"EP{cfg['ep']}; "
             f"{cfg['pretrain_steps']} bf16 steps at lr {cfg['pretrain_lr']} on batches of {cfg['batch']} x "
             f"{cfg['seq']} ({info['pretrain_epochs']:.2f} epochs of the training text); held-out loss "
             f"{teacher['loss_stats']['mean']:.4f} ({teacher['seconds']:.0f} s)",
             f"data: {cfg['data']} ({cfg['corpus'] if cfg['data'] == 'split' else 'text'}); each variant "
             f"{cfg['steps']} steps on the same batches; {cfg['eval_batches']} held-out batches (KL: mean +- std "
             f"over them; x PTQ: ratio of the means to the variant's start [min..max of the per-batch ratios]; x max: "
             f"to the format's max-calibrated PTQ; top-1: held-out tokens whose most likely next token is not the "
             f"teacher's; routes: (token, layer) routed to other experts than the teacher's)"]
    head = (f"{'variant':<60}{'held-out KL':>20}{'x PTQ':>20}{'x max':>7}{'top-1':>8}{'loss - PTQ':>18}"
            f"{'train KL x PTQ':>16}{'routes':>7}{'s':>6}")
    lines += ["", head]
    for key, p in out["ptq"].items():
        k = p["kl_stats"]
        lines.append(f"{_ptq_label(key):<60}{k['mean']:>11.5f} +-{k['std']:.5f}{1.0:>20.2f}"
                     f"{p.get('kl_vs_max_ptq', 1.0):>7.2f}{100 * statistics.fmean(p['top1_flips']):>7.2f}%{0.0:>18.4f}"
                     f"{1.0:>16.2f}{100 * p['route_flips']:>6.1f}%")
    failed = {spec: r["error"] for spec, r in out["variants"].items() if "error" in r}
    measured = {spec: r for spec, r in out["variants"].items() if "error" not in r}
    for spec, r in measured.items():
        k, b, d = r["kl_stats"], r["kl_vs_ptq_by_batch"], r["loss_minus_ptq"]
        lines.append(f"{spec:<60}{k['mean']:>11.5f} +-{k['std']:.5f}{r['kl_vs_ptq']:>8.2f} [{b['min']:.2f}.."
                     f"{b['max']:.2f}]{r['kl_vs_max_ptq']:>7.2f}{100 * statistics.fmean(r['top1_flips']):>7.2f}%"
                     f"{d['mean']:>+11.4f} +-{d['std']:.4f}{r['train_kl_vs_ptq'][-1]:>16.2f}"
                     f"{100 * r['route_flips']:>6.1f}%{r['seconds']:>6.0f}")
    for spec, error in failed.items():
        lines.append(f"{spec:<60} FAILED: {error}")
    if out["skipped"]:
        lines.append(f"skipped (time budget): {', '.join(out['skipped'])}")
    lines += ["", "KL x PTQ at steps " + ", ".join(str(c) for c in out["checkpoints"]) + " (train batches | held out)"
              + "; drift ||w - w_teacher|| / ||w_teacher|| per group; gradient RMS (first step) and coherence"]
    for spec, r in measured.items():
        train = " ".join(f"{x:.2f}" for x in r["train_kl_vs_ptq"])
        held = " ".join(f"{x:.2f}" for x in r["held_out_kl_vs_ptq"])
        drift = " ".join(f"{g}={v:.1e}" for g, v in r["drift"].items() if v > 0)
        grads = " ".join(f"{g}={v['rms_first']:.1e}/{v['coherence']:.2f}" for g, v in r["grads"].items())
        extra = ""
        if "kl_experts_trained_only" in r:
            extra = (f"; KL with only the experts' training kept {r['kl_experts_trained_only']:.5f}, with only the "
                     f"rest's {r['kl_rest_trained_only']:.5f}")
        lines.append(f"{spec}: train {train} | held out {held}; drift {drift}; grads {grads}{extra}")
    lines.append(f"({out['seconds']:.0f} s)")
    return "\n".join(lines)


def format_seeds(runs: dict) -> str:
    """Studies of the same variants under several seeds (``{seed: run_study output}``; each seed trains its own
    teacher and draws its own batches) as text: per start (PTQ, per format and calibration) and per variant, the
    median and the range over the seeds of its held-out KL, of its ratio to its seed's max-calibrated PTQ KL of the
    format (``x max PTQ``), of the share of held-out tokens whose top-1 token is not the teacher's (``top-1 flips``)
    and of its ratio to its own start's PTQ KL (``x PTQ``, as in :func:`format_study`)."""
    seeds = list(runs)
    lines = [f"seeds {', '.join(str(s) for s in seeds)}: median [min..max] over the seeds", "",
             f"{'variant':<60}{'held-out KL':>28}{'x max PTQ':>22}{'top-1 flips %':>22}{'x PTQ':>22}{'seeds':>7}"]

    def cell(values, spec):
        if not values:
            return "-"
        return f"{statistics.median(values):{spec}} [{min(values):{spec}}..{max(values):{spec}}]"

    def row(label, done, ratios):
        kls = [r["kl_stats"]["mean"] for r in done]
        vs_max = [r.get("kl_vs_max_ptq", 1.0) for r in done]
        flips = [100 * statistics.fmean(r["top1_flips"]) for r in done if "top1_flips" in r]
        return (f"{label:<60}{cell(kls, '.4g'):>28}{cell(vs_max, '.2f'):>22}{cell(flips, '.2f'):>22}"
                f"{cell(ratios, '.2f'):>22}{len(done):>7}")

    for key in dict.fromkeys(k for out in runs.values() for k in out["ptq"]):
        done = [out["ptq"][key] for out in runs.values() if key in out["ptq"]]
        lines.append(row(_ptq_label(key), done, [1.0] * len(done)))
    for spec in dict.fromkeys(s for out in runs.values() for s in out["variants"]):
        done = [out["variants"][spec] for out in runs.values()
                if spec in out["variants"] and "error" not in out["variants"][spec]]
        lines.append(row(spec, done, [r["kl_vs_ptq"] for r in done]))
    return "\n".join(lines)


def _glu(cfg: dict) -> str:
    """``", gated <activation>"`` for a study of gated experts (``model_overrides``), else nothing."""
    over = cfg.get("model_overrides", {})
    return f", gated {over.get('activation_func', 'gelu')}" if over.get("gated_linear_unit") else ""


def _ptq_label(key: str) -> str:
    """``nvfp4`` -> ``nvfp4/ptq``; ``nvfp4:calib=mse`` -> ``nvfp4/ptq:calib=mse``."""
    fmt, _, calib = key.partition(":")
    return f"{fmt}/ptq" + (f":{calib}" if calib else "")


def _top1(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """The most likely token of every position of vocab-parallel ``logits`` (the first of equal maxima, as
    ``argmax``); over tensor-parallel ranks, one ``all_gather`` that every rank of ``tp_group`` calls."""
    values, index = logits.float().max(-1)
    world = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    if world == 1:
        return index
    index = index + dist.get_rank(tp_group) * logits.shape[-1]
    all_values, all_index = [torch.empty_like(values) for _ in range(world)], [torch.empty_like(index)
                                                                                for _ in range(world)]
    dist.all_gather(all_values, values.contiguous(), group=tp_group)
    dist.all_gather(all_index, index.contiguous(), group=tp_group)
    best = torch.stack(all_values).argmax(0, keepdim=True)  # the first rank of equal maxima: the lowest index
    return torch.stack(all_index).gather(0, best)[0]
