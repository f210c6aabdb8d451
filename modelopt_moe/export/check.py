"""A GPU-free check of an exported checkpoint (ours or another tool's) against a serving engine's loader contract.

::

    from modelopt_moe.export import check_checkpoint

    report = check_checkpoint("out/", engine="vllm")
    print(report.verdict())        # one line: PASS / FAIL, the format, how many linears, the first error
    print(report.details())        # every finding and the per-layer input-scale spread

What it checks, per quantized linear of the config's model (Qwen3-MoE, Mixtral), from the rules of
:mod:`.check_rules` (FP8 per tensor / channel / 128x128 blocks, NVFP4, INT4 W4A16 groups, MXFP4, MXFP8, in
compressed-tensors and Model Optimizer checkpoints): every tensor the format stores is present in the shard the index
names, with the dtype and shape the loaders take; every per-tensor, per-channel, per-group or per-block float scale is
finite, positive and normal and so is its reciprocal (engines invert them: a missing scale loads as zero or
uninitialised memory and a never-routed expert then gives NaN), E4M3 block scales finite and non-negative, E8M0 scales
not NaN; the gate and up projections of each expert share the scales the engine fuses; what the engine's MoE loader
refuses; Model Optimizer ``MIXED_PRECISION`` configs list every quantized layer in ``quantized_layers``; every
attention layer's KV-cache ``k_scale`` / ``v_scale`` where the config quantizes the KV cache. It reports, per MoE
layer, how far each expert's own input scale is from the one the engine uses after collapsing them (one per layer or
per expert), as the ratio of the two amaxes (1: nothing lost), and, from ``calibration_tokens.json`` where the export
wrote one, the fewest and median calibration tokens per expert, flagging those below the export's threshold.

Scales compare as the amaxes they stand for (:attr:`.check_rules.TensorRule.to_amax`; NVFP4's second-level scales
``amax / 2688``, or ``amax / 1536`` for the weights and inputs the ``nvfp4_four_over_six`` marker names:
:meth:`.checkpoint_layout.CheckpointLayout.format_rule`).

Findings are ``error`` (the engine fails to load, produces NaN, or dequantizes with a wrong scale) or ``warning``
(the engine requantizes, losing accuracy). Only tensor data of scales is read.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .calibration_coverage import CALIBRATION_TOKENS_FILE, read_calibration_tokens
from .check_rules import ENGINE_RULES, ENGINES, KV_RULES, EngineRule, FormatRule, TensorRule
from .checkpoint_layout import Finding, LinearScheme, checkpoint_layout
from .errors import ExportError

__all__ = ["check_checkpoint", "check_all_engines", "CheckReport", "Finding", "InputScaleSpread", "CalibrationTokens"]

_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class InputScaleSpread:
    """One MoE layer's input scales of one GEMM (``gate_up`` or ``down``) against the one the engine uses: the
    worst expert's ratio engine amax / own amax (1.0: it keeps its own) and the median over experts."""

    layer: int
    gemm: str
    worst_ratio: float
    worst_expert: int
    median_ratio: float


@dataclass(frozen=True)
class CalibrationTokens:
    """One MoE layer's calibration tokens per expert for one GEMM (``gate_up`` or ``down``), from the checkpoint's
    ``calibration_tokens.json``: the fewest (and which expert), the median, and the experts below the threshold the
    export warned at (``{expert: tokens}``)."""

    layer: int
    gemm: str
    min_tokens: int
    min_expert: int
    median_tokens: float
    cold: dict[int, int]


@dataclass
class CheckReport:
    """The result of :func:`check_checkpoint`."""

    path: str
    engine: str
    format: str | None = None
    schemes: dict[str, int] = field(default_factory=dict)  # scheme -> number of linears
    findings: list[Finding] = field(default_factory=list)
    spreads: list[InputScaleSpread] = field(default_factory=list)
    collapse: str | None = None
    kl: list[float] | None = None
    kv_cache: str | None = None  # the KV cache's quantization (FP8, NVFP4) where the config has one
    calibration: list[CalibrationTokens] = field(default_factory=list)
    calibration_threshold: int | None = None

    @property
    def errors(self) -> list[Finding]:
        """The findings of severity ``error``."""
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        """The findings of severity ``warning``."""
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        """No errors (warnings allowed)."""
        return not self.errors

    def verdict(self) -> str:
        """One line: PASS or FAIL for the engine, the format and schemes, counts, the first error."""
        schemes = ", ".join(f"{n} {s}" for s, n in sorted(self.schemes.items())) or "no quantized linear"
        head = (f"check {self.engine}: {'PASS' if self.ok else 'FAIL'} ({self.format or 'unknown format'}: "
                f"{schemes}; {_count(self.errors, 'error')}, {_count(self.warnings, 'warning')}")
        worst = max(self.spreads, key=lambda s: s.worst_ratio, default=None)
        if worst is not None and worst.worst_ratio > 1.0:
            head += (f"; input scales: the engine's is up to {worst.worst_ratio:.3g}x an expert's own, layer "
                     f"{worst.layer} {worst.gemm} expert {worst.worst_expert}")
        elif worst is not None:
            head += "; input scales: every expert keeps its own"
        if self.calibration:
            low = min(self.calibration, key=lambda c: c.min_tokens)
            cold = sum(len(c.cold) for c in self.calibration)
            head += (f"; calibration tokens per expert: min {low.min_tokens} (layer {low.layer} {low.gemm} expert "
                     f"{low.min_expert}), {cold} below {self.calibration_threshold}")
        if self.kl:
            head += f"; engine-order forward KL to the reference {max(self.kl):.3g} (max of {len(self.kl)} batches)"
        head += ")"
        return head + (f": {self.errors[0]}" if self.errors else "")

    def details(self) -> str:
        """Every finding, then the input-scale spread per MoE layer."""
        lines = [self.verdict()] + [f"  {f}" for f in self.findings]
        if self.spreads:
            lines.append(f"  input scales per MoE layer ({self.engine} uses one per {self.collapse}); engine amax / "
                         "expert's own amax:")
            lines += [f"    layer {s.layer} {s.gemm}: worst {s.worst_ratio:.4g} (expert {s.worst_expert}), median "
                      f"{s.median_ratio:.4g}" for s in self.spreads]
        if self.calibration:
            lines.append(f"  calibration tokens per expert (calibration_tokens.json; export warned below "
                         f"{self.calibration_threshold}; flagged experts as expert: tokens, 0: the layer's shared "
                         "input amax):")
            lines += [f"    layer {c.layer} {c.gemm}: min {c.min_tokens} (expert {c.min_expert}), median "
                      f"{c.median_tokens:g}" + (f"; FLAGGED, below {self.calibration_threshold}: {c.cold}" if c.cold
                                                else "") for c in self.calibration]
        return "\n".join(lines)


def _count(items, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def check_checkpoint(path: str | os.PathLike, engine: str = "vllm", reference=None) -> CheckReport:
    """Checks the Hugging Face checkpoint at ``path`` against ``engine``'s loader (no GPU, scales only read).

    Args:
        path: a checkpoint directory (``config.json``, safetensors shards, ``hf_quant_config.json`` if any).
        engine: ``vllm``, ``sglang`` or ``trtllm``.
        reference: optional ``[(tokens [B, S], logits [B, S, V]), ...]`` of a model (the fake-quant model the
            checkpoint was exported from): the report's ``kl`` then holds, per batch, the mean over tokens of
            KL(reference || engine-order forward of the files with the scales this engine uses)
            (:mod:`.engine_forward`; needs ``transformers``). Run only when no error was found.

    Returns:
        The report: ``ok``, ``verdict()``, ``details()``, ``findings``, ``spreads``.

    Raises:
        ExportError: an unknown engine; a directory without a readable ``config.json``, or of a family the checker
            does not know (names the file and what was expected).
    """
    if engine not in ENGINES:
        raise ExportError(f"engine={engine!r}: expected one of {list(ENGINES)}")
    path = Path(path)
    report = CheckReport(str(path), engine)
    layout = checkpoint_layout(path, report.findings)
    if layout is None:
        return report
    report.format = layout.format
    family, arch, shapes, assign, headers = layout.family, layout.arch, layout.shapes, layout.schemes, layout.headers
    values = {}
    for module, shape in shapes.items():
        scheme = assign.get(module)
        if scheme is None:
            if not any(f.rule == "quantized_layers" and f.where == module for f in report.findings):
                _check_unquantized(module, shape, headers, report)
            continue
        report.schemes[scheme.label] = report.schemes.get(scheme.label, 0) + 1
        values[module] = _check_linear(path, module, shape, layout.format_rule(module), scheme, headers, report)
    _check_refusals(assign, report)
    _check_experts(arch, family, assign, values, shapes, report)
    _check_kv_cache(path, layout, report)
    _report_calibration_tokens(path, arch, family, report)
    if reference is not None and report.ok:
        from .engine_forward import engine_order_kl

        report.kl = engine_order_kl(path, reference, engine=engine)
        if not all(math.isfinite(k) for k in report.kl):
            report.findings.append(Finding("error", "forward", str(path), f"the engine-order forward's KL to the "
                                           f"reference is not finite: {report.kl}"))
    return report


def _refuses(report: CheckReport) -> bool:
    """Whether every error of ``report`` is a scheme its engine has no loader for (the checkpoint is whole; that engine
    does not serve it), not a broken loader contract."""
    return bool(report.errors) and all(f.rule == "scheme" for f in report.errors)


def check_all_engines(path: str | os.PathLike, engines=ENGINES) -> tuple[bool, str]:
    """Checks ``path`` against every engine of ``engines``; returns whether it passes and one line saying so
    (``check vllm PASS, sglang PASS, trtllm FAIL (...): <first error>``), for the end of an export.

    An engine with no loader for the checkpoint's schemes is ``REFUSES``, not ``FAIL``: it passes as long as another
    engine reads the checkpoint (an FP8 per-tensor compressed-tensors export is for vLLM and SGLang, whatever
    TensorRT-LLM reads); a broken contract of any engine fails it.

    Raises:
        ExportError: as :func:`check_checkpoint`.
    """
    reports = [check_checkpoint(path, engine=e) for e in engines]
    first = reports[0]
    schemes = ", ".join(f"{n} {s}" for s, n in sorted(first.schemes.items())) or "no quantized linear"
    warnings = sum(len(r.warnings) for r in reports)
    verdicts = ", ".join(f"{r.engine} {'PASS' if r.ok else 'REFUSES' if _refuses(r) else 'FAIL'}" for r in reports)
    line = f"check {verdicts} ({first.format}: {schemes}; {_count(range(warnings), 'warning')})"
    failed = next((r for r in reports if not r.ok and not _refuses(r)), None)
    refused = next((r for r in reports if _refuses(r)), None)
    shown = failed or refused
    if shown is not None:
        line += f": {shown.engine}: {shown.errors[0]} (modelopt-moe check {path} --details)"
    passed = failed is None and any(r.ok for r in reports)
    return passed, line


def _load(path: Path, file: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path / file), "pt") as f:
        return f.get_tensor(name)


def _check_unquantized(module: str, shape, headers: dict, report: CheckReport) -> None:
    name = module + ".weight"
    if name not in headers:
        report.findings.append(Finding("error", "missing", name, f"absent (an unquantized linear of shape "
                                       f"{list(shape)})"))
        return
    _, h = headers[name]
    if h.dtype not in ("BF16", "F16", "F32"):
        report.findings.append(Finding("error", "dtype", name, f"{h.dtype}, but the quantization config leaves "
                                       "this linear unquantized (expected BF16, F16 or F32)"))


def _check_linear(path: Path, module: str, shape, rule: FormatRule, scheme: LinearScheme, headers: dict,
                  report: CheckReport) -> dict[str, float]:
    """Checks one quantized linear's tensors; returns the amaxes its per-tensor scales stand for, by role (``rule``:
    the linear's own, 4-over-6 bounds included)."""
    values: dict[str, float] = {}
    for t in rule.stored(scheme.inputs):
        value = _check_tensor(path, f"{module}.{t.suffix}", t, shape, scheme.group, headers, report)
        if value is not None and value.numel() == 1 and t.role in ("weight_scale", "input_scale"):
            values[t.role] = t.amax(value.item())
    return values


def _check_tensor(path: Path, name: str, t: TensorRule, shape, group, headers: dict,
                  report: CheckReport) -> torch.Tensor | None:
    """Checks one stored tensor against its rule (presence, dtype, shape, values); returns a scale's values when
    they are sound (None otherwise, and for weights). ``shape``: the linear's ``[R, C]`` (None: a scalar of no
    linear, a KV-cache scale)."""
    r, c = shape or (0, 0)
    if name not in headers:
        why = " (engines read a missing scale as zero, one or uninitialised memory: NaN, inf or a wrong scale)" \
            if "scale" in t.role else ""
        report.findings.append(Finding("error", "missing", name, f"absent{why}"))
        return None
    file, h = headers[name]
    if h.dtype not in t.dtypes:
        report.findings.append(Finding("error", "dtype", name, f"{h.dtype}, expected {' or '.join(t.dtypes)}"))
    allowed, why = t.expected_shapes(r, c, group)
    if h.shape not in allowed:
        expected = why or "expected " + " or ".join(str(list(s)) for s in allowed)
        of = "" if shape is None else f" for a [{r}, {c}] weight" + ("" if group is None else f" in groups of {group}")
        report.findings.append(Finding("error", "shape", name, f"{list(h.shape)}{of}: {expected}"))
        return None
    if t.role == "weight":
        return None
    v = _load(path, file, name)
    if t.role == "weight_shape":
        if v.tolist() != [r, c]:
            report.findings.append(Finding("error", "shape", name, f"{v.tolist()}, expected the weight's [{r}, {c}]"))
        return None
    if t.role == "e8m0_scale":
        bad = v == 255
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            report.findings.append(Finding("error", "scale", name, f"{int(bad.sum())} E8M0 scales are 255, which "
                                           f"encodes NaN (first at flat index {i})"))
        return None
    v = v.float()
    if t.role == "block_scale":
        bad = ~torch.isfinite(v) | (v < 0)
        if bad.any():
            report.findings.append(Finding("error", "scale", name, f"{int(bad.sum())} block scales not finite "
                                           f"or negative (first {v[bad].flatten()[0].item()})"))
        return None
    problem = _scale_problem(v)
    if problem:
        report.findings.append(Finding("error", "scale", name, problem))
        return None
    return v


def _scale_problem(v: torch.Tensor) -> str | None:
    """Why a per-tensor / per-channel scale would break an engine (None: it would not)."""
    flat = v.flatten()
    for what, bad in (("not finite", ~torch.isfinite(flat)), ("not positive", flat <= 0),
                      ("subnormal", flat.abs() < _TINY), ("with a subnormal reciprocal", flat.abs() > 1 / _TINY)):
        if bad.any():
            i = int(bad.nonzero()[0])
            where = f"[{i}] " if flat.numel() > 1 else ""
            return f"{where}{flat[i].item():.6g} is {what} (engines divide by it or by its reciprocal)"
    return None


# ------------------------------------------------------------------------------------------------ experts


def _check_experts(arch, family, assign: dict, values: dict, shapes: dict, report: CheckReport) -> None:
    """Gate and up sharing the scales the engine fuses; the input-scale spread after the engine's collapse."""
    for layer in range(arch.num_layers):
        modules = {k: [family.hf_module(f"layers.{layer}.experts.{e}.{k}") for e in range(arch.num_experts)]
                   for k in ("gate", "up", "down")}
        scheme = assign.get(modules["gate"][0])
        if scheme is None:
            continue
        engine_rule: EngineRule | None = ENGINE_RULES.get((report.engine, report.format, scheme.key))
        if engine_rule is None:
            if layer == 0:
                report.findings.append(Finding("warning", "config", f"{report.engine} x {report.format}",
                                               f"no engine rules for {scheme.key} experts here; gate/up and input "
                                               "scale collapse not checked"))
            continue
        if engine_rule.refuses:
            continue  # one error for the whole checkpoint (check_checkpoint)
        _check_expert_layout(layer, modules, assign, shapes, engine_rule, report)
        if engine_rule.input_collapse != "none":
            report.collapse = engine_rule.input_collapse
        for role, how in engine_rule.gate_up.items():
            for gate, up in zip(modules["gate"], modules["up"], strict=True):
                g, u = values.get(gate, {}).get(role), values.get(up, {}).get(role)
                if g is None or u is None or math.isclose(g, u, rel_tol=1e-5):
                    continue
                if how == "equal":
                    report.findings.append(Finding(
                        "error", "gate_up", f"{gate} / {up}",
                        f"{role} amax {g:.6g} != {u:.6g}: {report.engine} fuses gate and up with one {role} "
                        f"({_gate_up_effect(report.engine)})"))
                else:
                    report.findings.append(Finding(
                        "warning", "gate_up", f"{gate} / {up}",
                        f"{role} amax {g:.6g} != {u:.6g}: {report.engine} requantizes both onto the larger, a "
                        f"{max(g, u) / min(g, u):.4g}x coarser grid for the other"))
        if not scheme.inputs or engine_rule.input_collapse == "none":
            continue
        own = {"gate_up": [max(values.get(g, {}).get("input_scale", 0.0), values.get(u, {}).get("input_scale", 0.0))
                           for g, u in zip(modules["gate"], modules["up"], strict=True)],
               "down": [values.get(d, {}).get("input_scale", 0.0) for d in modules["down"]]}
        for gemm, amaxes in own.items():
            if not all(a > 0 for a in amaxes):
                continue  # reported as missing / bad scales
            used = [max(amaxes)] * len(amaxes) if engine_rule.input_collapse == "layer" else amaxes
            ratios = [u / a for u, a in zip(used, amaxes, strict=True)]
            worst = max(range(len(ratios)), key=ratios.__getitem__)
            report.spreads.append(InputScaleSpread(layer, gemm, ratios[worst], worst, sorted(ratios)[len(ratios) // 2]))


def _check_expert_layout(layer: int, modules: dict, assign: dict, shapes: dict, rule: EngineRule,
                         report: CheckReport) -> None:
    """What the engine's MoE loader refuses in one layer's experts: static input scales where it takes dynamic
    inputs only; 2-D weight blocks that would straddle the fused gate and up."""
    scheme = assign[modules["gate"][0]]
    if rule.dynamic_expert_inputs and scheme.inputs:
        report.findings.append(Finding(
            "error", "scheme", f"layer {layer} experts", f"{scheme.key} experts with static input scales: "
            f"{report.engine}'s MoE method takes them only with dynamic per-token inputs ({rule.source}); export "
            "them with dynamic inputs (FP8_DYNAMIC)"))
    if rule.whole_row_blocks and isinstance(scheme.group, tuple):
        rows = shapes[modules["gate"][0]][0]
        if rows % scheme.group[0]:
            report.findings.append(Finding(
                "error", "shape", f"layer {layer} experts", f"expert FFN size {rows} is not a multiple of the "
                f"{scheme.group[0]}-row weight block: {report.engine} stacks gate and up into one weight and refuses "
                f"blocks across them ({rule.source})"))


def _check_refusals(assign: dict, report: CheckReport) -> None:
    """One error per scheme this engine has no loader for, and per scheme whose inputs' strategy or weight group
    its config reader refuses (naming the first such linear and the config field)."""
    for key in sorted({s.key for s in assign.values()}):
        rule = ENGINE_RULES.get((report.engine, report.format, key))
        if rule is not None and rule.refuses:
            n = sum(s.key == key for s in assign.values())
            report.findings.append(Finding("error", "scheme", f"{report.engine} x {report.format}",
                                           f"{n} linears in {key}: {rule.refuses}"))
        if rule is None or rule.refuses:
            continue
        for scheme in dict.fromkeys(s for s in assign.values() if s.key == key):
            linears = sorted(m for m, s in assign.items() if s == scheme)
            if rule.input_strategies and scheme.input_strategy not in rule.input_strategies:
                report.findings.append(Finding(
                    "error", "scheme", f"{linears[0]} input_activations",
                    f"{len(linears)} linears in {key} with input_activations strategy {scheme.input_strategy!r}: "
                    f"{report.engine} reads {key} only with {list(rule.input_strategies)} ({rule.source})"))
            if rule.groups and scheme.group not in rule.groups:
                report.findings.append(Finding(
                    "error", "scheme", f"{linears[0]} weights.group_size",
                    f"{len(linears)} linears in {key} with group_size {scheme.group}: {report.engine} reads {key} "
                    f"only in groups of {list(rule.groups)} ({rule.source})"))


def _check_kv_cache(path: Path, layout, report: CheckReport) -> None:
    """Every attention layer's ``k_scale`` / ``v_scale`` present where the config quantizes the KV cache: the scalar
    fp32 the engines read, finite, positive and normal; scales without a quantized KV cache are a warning (the
    engines leave them unused)."""
    rule = KV_RULES[layout.format]
    names = []
    for layer in range(layout.arch.num_layers):
        try:
            k, v = (layout.family.hf_module(f"layers.{layer}.{p}") for p in ("k_proj", "v_proj"))
        except ExportError:
            return  # no k_proj / v_proj (multi-latent attention): no per-layer KV scales to check
        names += [f"{k}.k_scale", f"{v}.v_scale"] if rule.on == "projection" else \
            [f"{k.rpartition('.')[0]}.{s}" for s in ("k_scale", "v_scale")]
    if layout.kv_cache is None:
        stored = [n for n in names if n in layout.headers]
        if stored:
            report.findings.append(Finding("warning", "kv_cache", stored[0], f"{len(stored)} KV-cache scales stored "
                                           "but the config quantizes no KV cache: the engines leave them unused"))
        return
    report.kv_cache = layout.kv_cache
    for name in names:
        _check_tensor(path, name, rule.scale, None, None, layout.headers, report)


def _report_calibration_tokens(path: Path, arch, family, report: CheckReport) -> None:
    """Per MoE layer and GEMM, the min / median calibration tokens over experts and the experts below the export's
    threshold, from ``calibration_tokens.json`` where the checkpoint has one. They are flagged in the verdict and
    the details, not as findings: the engines load such scales, and the export already warned."""
    try:
        recorded = read_calibration_tokens(path)
    except ExportError as e:
        report.findings.append(Finding("error", "calibration", CALIBRATION_TOKENS_FILE, str(e)))
        return
    if recorded is None:
        return
    tokens, threshold = recorded
    report.calibration_threshold = threshold
    for layer in range(arch.num_layers):
        for gemm, linear in (("gate_up", "gate"), ("down", "down")):
            counts = {e: tokens.get(family.hf_module(f"layers.{layer}.experts.{e}.{linear}"))
                      for e in range(arch.num_experts)}
            counts = {e: n for e, n in counts.items() if n is not None}
            if not counts:
                continue
            low = min(counts, key=counts.__getitem__)
            ordered = sorted(counts.values())
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
            cold = {e: n for e, n in counts.items() if n < threshold}
            report.calibration.append(CalibrationTokens(layer, gemm, counts[low], low, median, cold))


def _gate_up_effect(engine: str) -> str:
    return "TensorRT-LLM refuses to load it" if engine == "trtllm" else "the up projection is dequantized with the " \
        "gate's scale"
