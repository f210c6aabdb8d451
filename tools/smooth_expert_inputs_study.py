"""Does a function-preserving per-channel rescaling inside each expert lower NVFP4's error on the experts' fc2
(down-projection) inputs? A PTQ study on the QAD study's models (``tools/qad_study.py``; docs/calibration.md).

An expert computes ``fc2(h)``, ``h = act(gate) * up`` with a gated linear unit (``[gate; up] = fc1(x)``). Dividing
row ``j`` of fc1's *up* half by ``s_j`` and multiplying column ``j`` of fc2 by ``s_j`` leaves the expert's output
unchanged in exact arithmetic, and changes what the 16-value NVFP4 blocks of fc2's input (and of both weights) hold:
a deployable change of the weights alone (SmoothQuant / AWQ style), no engine support needed. Without a gate
(``act(fc1(x))``, the study models' GELU MLP) or with a clamped or offset GLU (gpt-oss) no such ``s`` exists; what
stays exact for every elementwise activation is a permutation of the channels (fc1's rows and fc2's columns).

Transforms (``--variants``; joined with ``+`` they apply left to right, each on the statistics of the model it gets):

- ``none``: the teacher as trained (max PTQ);
- ``smooth<alpha>``: SmoothQuant's ``s_j = amax_x_j**alpha / amax_w_j**(1 - alpha)``, ``amax_x_j`` the largest
  ``|h_j|`` over the calibration tokens routed to the expert, ``amax_w_j`` the largest ``|fc2[:, j]|``; a suffix ``p2``
  rounds ``s`` to a power of two (exact in bf16);
- ``blockeq``: inside each block of 16 channels, every channel's ``amax_x`` raised to the block's largest
  (``s_j = amax_x_j / max_block amax_x``; the error moves to fc2's weights);
- ``awq``: per expert, of ``s = 1`` and the SmoothQuant scales at alpha 0, 0.1, ..., 1, the one whose NVFP4
  fake-quantized fc2 GEMM is closest to the bf16 one on the expert's calibration tokens (AWQ's search);
- ``ship<alpha>``: the library's ``smooth_expert_inputs: {alpha: <alpha>}``, applied by ``mtq.quantize`` (the same
  rule as ``smooth<alpha>p2``, on the statistics fc2's input quantizer sees); last in a ``+`` chain;
- ``fc1in<alpha>`` (``p2``): SmoothQuant on fc1's inputs instead, one ``s`` per MoE layer folded into the pre-MLP
  norm (weight and bias divided) and the columns of the router and of every expert's fc1 (multiplied); exact for any
  activation;
- ``perm``: the channels sorted by ``amax_x`` (descending) per expert, so a block holds channels of like size; exact
  for any activation;
- ``spread``: the opposite, the channels dealt round-robin over the blocks by ``amax_x``, so each block holds one of
  the largest (exact for any activation).

Channels (and experts) that saw no calibration token keep ``s_j = 1``. ``smooth<alpha>p2`` is what the library ships
as the config key ``smooth_expert_inputs: {alpha: <alpha>}`` (:mod:`modelopt_moe.quantization.smooth_experts`, whose
scale rule, expert finder and refusals this tool uses). For every transform the study reports the
bf16 model's held-out KL to the untransformed teacher (the transform alone: 0 for exact transforms, bf16 rounding
otherwise), then NVFP4 PTQ (experts' weights and inputs, max calibration of the transformed model on the same
calibration batches): held-out KL, its ratio to ``none``'s, top-1 flips, and the KL with only fc2's inputs quantized
(the share the transform targets), only fc1's inputs, and the weights alone.

Usage (one gloo process; the study's knobs as ``--set``, e.g. ``eval_batches=16``)::

    python tools/smooth_expert_inputs_study.py --model moe64 --glu swiglu --seeds 1234,4321
    python tools/smooth_expert_inputs_study.py --model study --glu none --variants none perm

``--glu swiglu`` trains the teacher with SwiGLU experts (``gated_linear_unit``, SiLU; the study models' MLP is GELU,
non-gated, where only ``perm``, ``spread`` and ``fc1in`` apply); ``--quick``: a few steps (checks that the tool runs).
Results: docs/calibration.md, "Rescaling the experts' fc2 inputs".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "tests"):
    if str(_path) not in sys.path:  # the study's tools, and its small Megatron models (not part of the package)
        sys.path.insert(0, str(_path))

__all__ = ["ExpertGemms", "expert_gemms", "check_transformable", "fc2_input_amax", "smoothing_scales",
           "searched_scales", "spread_order", "moe_layers", "scale_fc1_inputs", "scale_channels", "permute_channels",
           "apply_transform", "parse_transform", "run", "main"]

BLOCK = 16  # NVFP4's block along fc2's input channels (the activations' and fc2 weight's last dim)
VARIANTS = ("none", "smooth0.25", "smooth0.5", "smooth0.75", "smooth0.5p2", "blockeq", "awq", "perm",
            "spread", "awq+spread")


@dataclasses.dataclass
class ExpertGemms:
    """One expert's two GEMMs: ``fc1_weight`` ``[2F or F, H]`` (gated: gate rows, then up rows), ``fc2_weight``
    ``[H, F]``, fc1's bias (or None), and the Megatron ``TransformerConfig`` that defines its activation."""

    name: str
    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor | None
    fc2_weight: torch.Tensor
    config: object


def expert_gemms(model: torch.nn.Module) -> list[ExpertGemms]:
    """Every expert of ``model`` (Megatron ``SequentialMLP`` or grouped ``TEGroupedMLP``-style experts with
    ``weight0..weight{N-1}``), in module order.

    Raises:
        ValueError: the model has no experts of a known kind.
    """
    from modelopt_moe.plugins.megatron.smooth_experts import megatron_expert_mlps  # the library's finder

    out = []
    for m in megatron_expert_mlps(model):
        config = model.get_submodule(m.name).config
        for i in range(len(m.fc2_weights)):
            name = f"{m.name}.linear_fc1.weight{i}" if m.grouped else f"{m.name}.local_experts.{i}"
            out.append(ExpertGemms(name, m.fc1_weights[i], m.fc1_biases[i], m.fc2_weights[i], config))
    if not out:
        raise ValueError(f"{type(model).__name__}: no SequentialMLP or grouped experts to transform")
    return out


def check_transformable(model: torch.nn.Module, scales: bool) -> list[ExpertGemms]:
    """The experts, after checking that a per-channel scale (``scales``) or a permutation preserves their function.

    Raises:
        ValueError: naming the expert and the setting: scales on a non-gated MLP, a clamped or offset GLU, or a
            Transformer Engine activation module (whose clamping cannot be read); a permutation of an activation
            that is not elementwise (the TE module).
    """
    from modelopt_moe.plugins.megatron.smooth_experts import refusal

    experts = expert_gemms(model)
    for e in experts:
        c = e.config
        if getattr(c, "use_te_activation_func", False):
            raise ValueError(f"expert {e.name}: use_te_activation_func=True (a Transformer Engine activation module, "
                             "possibly clamped): cannot prove a channel transform preserves it")
        reason = refusal(c, e.fc1_weight.shape[0], e.fc2_weight.shape[1]) if scales else None
        if reason is not None:  # the library's rule (what mtq.quantize's smooth_expert_inputs refuses)
            if not c.gated_linear_unit:
                reason += "; expected a gated linear unit (e.g. SwiGLU), or use 'perm'"
            raise ValueError(f"expert {e.name}: {reason}")
    return experts


def _fc2_input(e: ExpertGemms, fc1_out: torch.Tensor) -> torch.Tensor:
    """The expert's fc2 input from its fc1 output (bias included), as Megatron's MLP computes it."""
    if e.config.gated_linear_unit:
        gate, up = torch.chunk(fc1_out, 2, dim=-1)
        return e.config.activation_func(gate) * up
    return e.config.activation_func(fc1_out)


@torch.no_grad()
def fc2_input_amax(model: torch.nn.Module, forward_loop, inputs: dict | None = None) -> dict[str, torch.Tensor]:
    """Per expert (by :func:`expert_gemms` name): the fp32 ``[F]`` largest ``|fc2 input|`` per channel over the tokens
    routed to it while ``forward_loop(model)`` runs (zeros for an expert no token reached); with ``inputs`` (a dict),
    also each expert's fc2 inputs ``[tokens, F]`` there. One process: a data-parallel run would reduce these with
    MAX first."""
    experts = expert_gemms(model)
    amax = {e.name: torch.zeros(e.fc2_weight.shape[1], dtype=torch.float32, device=e.fc2_weight.device)
            for e in experts}
    by_weight = {id(e.fc1_weight): e for e in experts}
    handles = []
    seen: dict[str, list[torch.Tensor]] = {e.name: [] for e in experts}

    def record(e, out):
        if out.numel():
            h = _fc2_input(e, out.reshape(-1, out.shape[-1]))
            torch.maximum(amax[e.name], h.abs().amax(0).float(), out=amax[e.name])
            if inputs is not None:
                seen[e.name].append(h.clone())

    for module in model.modules():
        if hasattr(module, "local_experts"):
            for expert in module.local_experts:
                e = by_weight[id(expert.linear_fc1.weight)]

                def seq_hook(mod, args, output, e=e):  # returns None: the output stays the module's
                    out, bias = output
                    record(e, out if bias is None else out + bias)

                handles.append(expert.linear_fc1.register_forward_hook(seq_hook))
        elif hasattr(getattr(module, "linear_fc1", None), "weight0"):
            fc1 = module.linear_fc1
            group = [by_weight[id(getattr(fc1, f"weight{i}"))] for i in range(fc1.num_gemms)]

            def grouped_hook(mod, args, output, group=group):  # returns None
                out, bias = output if isinstance(output, tuple) else (output, None)
                splits = [int(m) for m in args[1]]
                for i, (e, part) in enumerate(zip(group, torch.split(out, splits), strict=True)):
                    record(e, part if not bias else part + bias[i])

            handles.append(fc1.register_forward_hook(grouped_hook))
    try:
        forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    if inputs is not None:
        inputs.update({n: torch.cat(v) if v else None for n, v in seen.items()})
    return amax


def smoothing_scales(amax_x: torch.Tensor, amax_w: torch.Tensor, alpha: float | None = None, *,
                     pow2: bool = False, block: int = BLOCK) -> torch.Tensor:
    """``s`` per channel: SmoothQuant's ``amax_x**alpha / amax_w**(1 - alpha)`` (``alpha`` in [0, 1]), or with
    ``alpha=None`` the block equalizer ``amax_x / max over the channel's block of amax_x``; 1 where ``amax_x`` or
    ``amax_w`` is 0 (no token, a dead channel); ``pow2``: rounded to the nearest power of two (``round(log2(s))``; at an
    exact tie the float rounding of ``s`` decides, which the library's exact rule,
    :func:`modelopt_moe.quantization.smooth_experts.power_of_two_exponents`, avoids).

    Raises:
        ValueError: an ``alpha`` outside [0, 1], or non-finite statistics.
    """
    if not (torch.isfinite(amax_x).all() and torch.isfinite(amax_w).all()):
        raise ValueError("smoothing_scales: non-finite amax_x or amax_w")
    x, w = amax_x.double(), amax_w.double()
    if alpha is None:
        pad = (-x.numel()) % block
        peak = torch.nn.functional.pad(x, (0, pad)).view(-1, block).amax(1).repeat_interleave(block)[:x.numel()]
        s = x / peak
    else:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"smoothing_scales: alpha={alpha}; expected a value in [0, 1]")
        s = x.pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where((x > 0) & (w > 0), s, torch.ones_like(s))
    if pow2:  # s itself rounded; mtq.quantize's smooth_expert_inputs rounds exactly (power_of_two_exponents)
        s = torch.exp2(torch.round(torch.log2(s)))
    return s.float()


AWQ_ALPHAS = tuple(i / 10 for i in range(11))


@torch.no_grad()
def searched_scales(h: torch.Tensor | None, w: torch.Tensor, amax_x: torch.Tensor,
                    alphas: tuple[float, ...] = AWQ_ALPHAS) -> tuple[torch.Tensor, float | None]:
    """AWQ-style: of ``s = 1`` and :func:`smoothing_scales` at each of ``alphas``, the ``s`` whose NVFP4 fake-quantized
    GEMM ``Q(h / s) @ Q(w * s)^T`` is closest (squared error) to ``h @ w^T`` on the expert's calibration inputs ``h``
    (``[tokens, F]``; None: no token, ``s = 1``). Each operand takes its own amax as the per-tensor scale (the model's
    input amax is the layer's, shared by its experts: only the E4M3 rounding of the block scales differs). Returns
    ``s`` and its alpha (None: ``s = 1``)."""
    from modelopt_moe.numerics.registry import get_format

    ones = torch.ones_like(amax_x)
    if h is None or not h.numel():
        return ones, None
    fmt = get_format("nvfp4")
    hf, wf = h.float(), w.float()
    ref = hf @ wf.T

    def error(s):
        x, v = (hf / s).to(h.dtype), (wf * s).to(w.dtype)
        y = fmt.fake_quant(x, x.abs().amax().float()).float() @ fmt.fake_quant(v, v.abs().amax().float()).float().T
        return float((y - ref).square().sum())

    amax_w = wf.abs().amax(0)
    candidates = [(ones, None)] + [(smoothing_scales(amax_x, amax_w, a), a) for a in alphas]
    return min(candidates, key=lambda c: error(c[0]))


@torch.no_grad()
def scale_channels(e: ExpertGemms, s: torch.Tensor) -> None:
    """fc1's up row ``j`` (and bias) divided by ``s_j``, fc2's column ``j`` multiplied by it (in fp32, stored in the
    weights' dtype). The caller has checked the expert (:func:`check_transformable`)."""
    f = e.fc2_weight.shape[1]
    up = e.fc1_weight[f:]
    up.copy_((up.float() / s[:, None]).to(up.dtype))
    if e.fc1_bias is not None:
        e.fc1_bias[f:].copy_((e.fc1_bias[f:].float() / s).to(e.fc1_bias.dtype))
    e.fc2_weight.copy_((e.fc2_weight.float() * s[None, :]).to(e.fc2_weight.dtype))


@torch.no_grad()
def permute_channels(e: ExpertGemms, perm: torch.Tensor) -> None:
    """Channel ``perm[k]`` becomes channel ``k``: fc1's rows (of each half when gated, and its bias) and fc2's
    columns. Exact for every elementwise activation."""
    f = e.fc2_weight.shape[1]
    rows = torch.cat([perm, perm + f]) if e.config.gated_linear_unit else perm
    e.fc1_weight.copy_(e.fc1_weight[rows].clone())
    if e.fc1_bias is not None:
        e.fc1_bias.copy_(e.fc1_bias[rows].clone())
    e.fc2_weight.copy_(e.fc2_weight[:, perm].clone())


def moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module, list[ExpertGemms]]]:
    """Per MoE layer: its name, its pre-MLP norm, its router and its experts (what ``fc1in`` rescales).

    Raises:
        ValueError: naming the layer: a norm without a weight (fused into fc1, or none), or shared experts (their
            fc1 reads the same input and is not rescaled here).
    """
    out = []
    for name, layer in model.named_modules():
        mlp, norm = getattr(layer, "mlp", None), getattr(layer, "pre_mlp_layernorm", None)
        if not hasattr(mlp, "router") or not hasattr(mlp, "experts"):
            continue
        if not isinstance(getattr(norm, "weight", None), torch.Tensor):
            raise ValueError(f"layer {name}: pre_mlp_layernorm {type(norm).__name__} has no weight to fold fc1's "
                             "input scales into; expected a LayerNorm or RMSNorm module")
        if getattr(mlp, "shared_experts", None) is not None:
            raise ValueError(f"layer {name}: shared experts read the MoE input too; fc1in rescales the routed experts "
                             "and the router only")
        out.append((name, norm, mlp.router, expert_gemms(mlp.experts)))
    if not out:
        raise ValueError(f"{type(model).__name__}: no MoE layer (pre_mlp_layernorm, router and experts) to rescale")
    return out


@torch.no_grad()
def scale_fc1_inputs(model: torch.nn.Module, forward_loop, alpha: float, pow2: bool = False) -> None:
    """SmoothQuant on fc1's inputs, one ``s`` per MoE layer: the pre-MLP norm's weight (and bias) divided by ``s_j``,
    column ``j`` of the router's and of every expert's fc1 weight multiplied by it. ``amax_x_j``: the largest
    ``|MoE input_j|`` over ``forward_loop``'s tokens; ``amax_w_j``: the largest ``|fc1[:, j]|`` over the layer's
    experts. Exact for any activation (the scales act before it)."""
    layers = moe_layers(model)
    amax = {name: None for name, *_ in layers}
    handles = []
    for name, layer in model.named_modules():
        if name in amax:
            def hook(mod, args, name=name):  # returns None: the input stays the module's
                a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
                amax[name] = a if amax[name] is None else torch.maximum(amax[name], a)

            handles.append(layer.mlp.register_forward_pre_hook(hook))
    try:
        forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    for name, norm, router, experts in layers:
        if amax[name] is None:
            continue
        w = torch.stack([e.fc1_weight.detach().abs().amax(0).float() for e in experts]).amax(0)
        s = smoothing_scales(amax[name], w, alpha, pow2=pow2)
        for t in (norm.weight, getattr(norm, "bias", None)):
            if isinstance(t, torch.Tensor):
                t.copy_((t.float() / s).to(t.dtype))
        for t in (router.weight, *(e.fc1_weight for e in experts)):
            t.copy_((t.float() * s[None, :]).to(t.dtype))


PERMUTATIONS = ("perm", "spread")  # the steps that only reorder channels (exact for any elementwise activation)


def spread_order(order: torch.Tensor, name: str = "expert", block: int = BLOCK) -> torch.Tensor:
    """The permutation that deals the channels of ``order`` (largest first) round-robin over the blocks: block ``b``
    gets the ``b``-th, ``b + nblocks``-th, ... largest.

    Raises:
        ValueError: a channel count that is not a multiple of ``block`` (naming ``name``).
    """
    f = order.numel()
    if f % block:
        raise ValueError(f"{name}: {f} channels is not a multiple of the block {block}; 'spread' needs whole blocks")
    nb = f // block
    k = torch.arange(f, device=order.device)
    perm = torch.empty_like(order)
    perm[(k % nb) * block + k // nb] = order
    return perm


_STEP = re.compile(r"^(none|perm|spread|blockeq|awq|(smooth|fc1in|ship)(\d*\.?\d+)(p2)?)$")
# the steps that scale fc2's input channels (a gated, unclamped GLU only); fc1in scales fc1's inputs, before the
# activation, and permutations reorder channels: both hold for any elementwise activation
FC2_SCALES = ("smooth", "blockeq", "awq", "ship")


def parse_transform(spec: str) -> list[tuple[str, float | None, bool]]:
    """``"smooth0.5p2+perm"`` -> ``[("smooth", 0.5, True), ("perm", None, False)]`` (``none`` -> ``[]``).

    Raises:
        ValueError: an unknown step or an alpha outside [0, 1], naming the spec.
    """
    steps = []
    for part in spec.split("+"):
        m = _STEP.match(part)
        if not m:
            raise ValueError(f"transform {spec!r}: unknown step {part!r}; expected none, perm, spread, blockeq, awq, "
                             "smooth<alpha>[p2], fc1in<alpha>[p2] or ship<alpha> (e.g. smooth0.5), joined with '+'")
        if m[1] == "none":
            continue
        if m[2] is not None:
            alpha = float(m[3])
            if not 0.0 <= alpha <= 1.0:
                raise ValueError(f"transform {spec!r}: alpha {alpha} outside [0, 1]")
            steps.append((m[2], alpha, m[4] is not None or m[2] == "ship"))
        else:
            steps.append((m[1], None, False))
    if any(kind == "ship" for kind, _, _ in steps[:-1]):
        raise ValueError(f"transform {spec!r}: 'ship<alpha>' runs inside mtq.quantize, after every other step: put "
                         "it last")
    return steps


def apply_transform(model: torch.nn.Module, spec: str, forward_loop) -> dict:
    """Applies ``spec`` (:func:`parse_transform`) to every expert of ``model`` in place, each step on the fc2-input
    statistics that ``forward_loop(model)`` gives the model as the previous steps left it. Returns what the steps
    chose: ``{"awq_alphas": {alpha or "s=1": experts}}`` for ``awq``.

    Raises:
        ValueError: a bad spec, or experts that the transform does not preserve (:func:`check_transformable`).
    """
    steps = parse_transform(spec)
    check_transformable(model, scales=any(kind in FC2_SCALES for kind, _, _ in steps))
    if any(kind == "fc1in" for kind, _, _ in steps):
        moe_layers(model)  # checked before any weight changes
    info: dict = {}
    for kind, alpha, pow2 in steps:
        if kind == "ship":  # the library's smooth_expert_inputs, applied by mtq.quantize (the study's _worker)
            continue
        if kind == "fc1in":
            scale_fc1_inputs(model, forward_loop, alpha, pow2)
            continue
        inputs = {} if kind == "awq" else None
        amax = fc2_input_amax(model, forward_loop, inputs)
        for e in expert_gemms(model):
            x = amax[e.name]
            if kind in ("perm", "spread"):
                order = torch.argsort(x, descending=True, stable=True)
                permute_channels(e, order if kind == "perm" else spread_order(order, e.name))
            elif kind == "awq":
                scales, chosen = searched_scales(inputs[e.name], e.fc2_weight.detach(), x)
                key = "s=1" if chosen is None else f"{chosen:g}"
                info.setdefault("awq_alphas", {})[key] = info.get("awq_alphas", {}).get(key, 0) + 1
                scale_channels(e, scales)
            else:
                scale_channels(e, smoothing_scales(x, e.fc2_weight.detach().abs().amax(0).float(),
                                                   alpha if kind == "smooth" else None, pow2=pow2))
    return info


# ----------------------------------------------------------------------------------------------------- the study
def _worker(rank, world_size, overrides: dict, variants: tuple[str, ...], verbose: bool):
    import megatron_harness.models as mm
    from megatron.core import parallel_state
    from megatron_harness.configs import expert_quant_config
    from qad_study import StudyConfig, _top1, study_data, study_model, train_teacher

    import modelopt_moe.quantization as mtq
    from modelopt_moe.distill import logits_kl_loss, vocab_parallel_cross_entropy

    t_start = time.perf_counter()
    cfg = StudyConfig(**overrides)
    mm.init_model_parallel(cfg.tp, cfg.ep, seed=cfg.seed)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    probe = study_model(cfg)  # every transform is checked against the experts before the teacher trains
    for spec in variants:
        check_transformable(probe, scales=any(kind in FC2_SCALES for kind, _, _ in parse_transform(spec)))
    del probe
    data = study_data(cfg)
    calib, held_out = data["recover"][:cfg.calib_batches], data["held_out"]
    teacher, losses = train_teacher(cfg, data["pretrain"])
    weights = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    device = next(teacher.parameters()).device

    def forward(model, b):
        b = {k: v.to(device) for k, v in b.items()}
        return model(b["tokens"], b["position_ids"], b["attention_mask"]), b["labels"]

    def calib_loop(model):
        for b in calib:
            forward(model, b)

    with torch.no_grad():
        t_logits = [forward(teacher, b)[0] for b in held_out]
        t_top1 = [_top1(x, tp_group) for x in t_logits]

    def evaluate(model) -> dict:
        model.eval()
        kl, flips, loss = [], [], []
        with torch.no_grad():
            for b, tl, tt in zip(held_out, t_logits, t_top1, strict=True):
                logits, labels = forward(model, b)
                kl.append(float(logits_kl_loss(logits, tl, tp_group=tp_group).mean()))
                flips.append(float((_top1(logits, tp_group) != tt).double().mean()))
                loss.append(float(vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group).mean()))
        return {"kl": statistics.fmean(kl), "top1_flips": statistics.fmean(flips), "loss": statistics.fmean(loss)}

    only = {"kl_fc2_inputs_only": ("*experts*weight_quantizer", "*experts*linear_fc1*input_quantizer"),
            "kl_fc1_inputs_only": ("*experts*weight_quantizer", "*experts*linear_fc2*input_quantizer"),
            "kl_weights_only": ("*experts*input_quantizer",)}
    out = {"config": {**dataclasses.asdict(cfg), "model_overrides": {k: getattr(v, "__name__", v)
                                                                     for k, v in cfg.model_overrides.items()}},
           "teacher": {**evaluate(teacher), "pretrain_loss": [losses[0], losses[-1]]}, "variants": {}}
    for spec in variants:
        t0 = time.perf_counter()
        model = study_model(cfg, weights).eval()
        r = {"chosen": apply_transform(model, spec, calib_loop), "bf16": evaluate(model)}
        quant_config = expert_quant_config("nvfp4", "dynamic", "max")
        ship = [alpha for kind, alpha, _ in parse_transform(spec) if kind == "ship"]
        if ship:  # the shipped path: mtq.quantize rescales, then calibrates
            quant_config["smooth_expert_inputs"] = {"alpha": ship[0]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, quant_config, calib_loop)
        if ship:  # the rescaled bf16 model: every quantizer off for a moment
            enabled = [q for _, q, _ in mtq.named_quantizers(model) if q.is_enabled]
            mtq.disable_quantizer(model, "*")
            r["bf16"] = evaluate(model)
            for q in enabled:
                q.enable()
        r["nvfp4"] = evaluate(model)
        for key, off in only.items():
            for pattern in off:
                mtq.disable_quantizer(model, pattern)
            r[key] = evaluate(model)["kl"]
            for pattern in off:
                mtq.enable_quantizer(model, pattern)
        r["seconds"] = time.perf_counter() - t0
        out["variants"][spec] = r
        if verbose:
            print(f"[{time.perf_counter() - t_start:5.0f} s] {spec}: bf16 KL {r['bf16']['kl']:.2e}, NVFP4 KL "
                  f"{r['nvfp4']['kl']:.6f} (fc2 inputs only {r['kl_fc2_inputs_only']:.6f}), top-1 flips "
                  f"{100 * r['nvfp4']['top1_flips']:.2f}%", flush=True)
        del model
    mm.destroy_model_parallel()
    out["seconds"] = time.perf_counter() - t_start
    return out


def run(overrides: dict, variants: tuple[str, ...], seeds: list[int], verbose: bool = True) -> dict:
    """One study per seed (each trains its own teacher), one gloo process each: ``{seed: results}``."""
    from modelopt_moe.launch import spawn

    return {seed: spawn(_worker, 1, args=({**overrides, "seed": seed}, variants, verbose), timeout=7200)[0]
            for seed in seeds}


def format_results(runs: dict) -> str:
    """A Markdown table: per transform, each seed's value joined by ``/``."""
    seeds = list(runs)
    first = runs[seeds[0]]
    c = first["config"]
    glu = c["model_overrides"].get("activation_func", "gelu") if c["model_overrides"].get("gated_linear_unit") \
        else "gelu (non-gated)"
    lines = [f"{c['num_layers']} layers, hidden {c['hidden']}, {c['num_experts']} experts top-{c['topk']}, expert FFN "
             f"{c['ffn_hidden']}, {glu}, {c['experts']} experts; teacher {c['pretrain_steps']} bf16 steps; "
             f"calibration {c['calib_batches']} x {c['batch']} x {c['seq']} tokens; {c['eval_batches']} held-out "
             f"batches; seeds {' / '.join(str(s) for s in seeds)}; teacher held-out loss "
             + " / ".join(f"{runs[s]['teacher']['loss']:.4f}" for s in seeds), "",
             "| transform | bf16 KL to teacher (transform alone) | NVFP4 PTQ KL | x none | top-1 flips % | fc2 inputs "
             "only KL | x none | fc1 inputs only KL | weights only KL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(spec, get, fmt):
        vals = [get(runs[s]["variants"][spec], runs[s]["variants"].get("none")) for s in seeds]
        return " / ".join("-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)
                          for v in vals)

    for spec in first["variants"]:
        lines.append("| " + " | ".join([
            spec, cell(spec, lambda r, n: r["bf16"]["kl"], ".1e"), cell(spec, lambda r, n: r["nvfp4"]["kl"], ".3g"),
            cell(spec, lambda r, n: r["nvfp4"]["kl"] / n["nvfp4"]["kl"] if n else None, ".2f"),
            cell(spec, lambda r, n: 100 * r["nvfp4"]["top1_flips"], ".2f"),
            cell(spec, lambda r, n: r["kl_fc2_inputs_only"], ".3g"),
            cell(spec, lambda r, n: r["kl_fc2_inputs_only"] / n["kl_fc2_inputs_only"] if n else None, ".2f"),
            cell(spec, lambda r, n: r["kl_fc1_inputs_only"], ".3g"),
            cell(spec, lambda r, n: r["kl_weights_only"], ".3g")]) + " |")
    for s in seeds:
        for spec, r in runs[s]["variants"].items():
            if r.get("chosen", {}).get("awq_alphas"):
                counts = sorted(r["chosen"]["awq_alphas"].items(), key=lambda kv: (kv[0] != "s=1", kv[0]))
                lines.append(f"seed {s}, {spec}: experts per chosen alpha " + ", ".join(f"{k}: {v}" for k, v in counts))
    lines.append(f"({sum(runs[s]['seconds'] for s in seeds):.0f} s)")
    return "\n".join(lines)


QUICK = {"pretrain_steps": 3, "eval_batches": 2, "calib_batches": 1}


def main(argv=None) -> int:
    """Parses the options, runs the study per seed and prints the table (``--json``: the raw results too)."""
    from bench_qat_recovery import CPU_STUDY, STUDY_MODELS, _parse_value
    from qad_study import GLUS, StudyConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(STUDY_MODELS), default="study")
    parser.add_argument("--glu", choices=sorted(GLUS), default="none", help="the experts' MLP: none (the study "
                        "models' GELU), swiglu or geglu (gated_linear_unit)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), metavar="TRANSFORM",
                        help="transforms, 'none' first (the baseline), e.g. none smooth0.5 perm smooth0.5p2+perm")
    parser.add_argument("--seeds", default="1234", help="comma-separated seeds, one teacher each")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="StudyConfig overrides")
    parser.add_argument("--quick", action="store_true", help="a few steps only (checks that the tool runs)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in CPU_STUDY.items() if k != "steps"}
    overrides.update(STUDY_MODELS[args.model])
    overrides.update(QUICK if args.quick else {})
    fields = {f.name: f for f in dataclasses.fields(StudyConfig)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            parser.error(f"--set {item}: unknown key {key!r}; expected one of {sorted(fields)}")
        overrides[key] = _parse_value(fields[key], value)
    overrides["model_overrides"] = {**overrides.get("model_overrides", {}), **GLUS[args.glu]}
    for spec in args.variants:
        try:
            steps = parse_transform(spec)
        except ValueError as e:
            parser.error(str(e))
        if args.glu == "none" and any(kind in FC2_SCALES for kind, _, _ in steps):
            parser.error(f"transform {spec!r} scales fc2's input channels: --glu none (the study models' GELU MLP, "
                         "non-gated) keeps only 'none', 'perm', 'spread' and 'fc1in<alpha>'; use --glu swiglu")
    if args.variants[0] != "none":
        parser.error(f"--variants {' '.join(args.variants)}: the first must be 'none' (the baseline)")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 1234,4321")
    runs = run(overrides, tuple(args.variants), seeds)
    print(format_results(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
