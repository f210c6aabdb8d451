"""A GPU-free check of an exported checkpoint (ours or another tool's) against a serving engine's loader contract.

::

    from modelopt_moe.export import check_checkpoint

    report = check_checkpoint("out/", engine="vllm")
    print(report.verdict())        # one line: PASS / FAIL, the format, how many linears, the first error
    print(report.details())        # every finding and the per-layer input-scale spread

What it checks, per quantized linear of the config's model (Qwen3-MoE, Mixtral), from the rules of
:mod:`.check_rules`: every tensor the format stores is present in the shard the index names, with the dtype and
shape the loaders take; every per-tensor or per-channel scale is finite, positive and normal and so is its
reciprocal (engines invert them: a missing scale loads as zero or uninitialised memory and a never-routed expert
then gives NaN), block scales finite and non-negative; the gate and up projections of each expert share the scales
the engine fuses; Model Optimizer ``MIXED_PRECISION`` configs list every quantized layer in ``quantized_layers``.
It reports, per MoE layer, how far each expert's own input scale is from the one the engine uses after collapsing
them (one per layer or per expert), as the ratio of the two amaxes (1: nothing lost).

Findings are ``error`` (the engine fails to load, produces NaN, or dequantizes with a wrong scale) or ``warning``
(the engine requantizes, losing accuracy). Only tensor data of scales is read.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .check_rules import ENGINE_RULES, ENGINES, FORMAT_RULES, EngineRule, FormatRule, TensorRule, rule_key
from .errors import ExportError
from .families import canonical_shapes, family_for_architecture, read_hf_config
from .safetensors_files import TensorHeader, read_header, read_weight_map

__all__ = ["check_checkpoint", "check_all_engines", "checkpoint_layout", "CheckpointLayout", "CheckReport", "Finding",
           "InputScaleSpread"]

_TINY = torch.finfo(torch.float32).tiny
_MODELOPT_ALGOS = {"FP8": ("fp8", True), "NVFP4": ("nvfp4", True), "W4A16_NVFP4": ("nvfp4", False)}


@dataclass(frozen=True)
class Finding:
    """One problem: ``severity`` (``error`` / ``warning``), a rule id (``missing``, ``dtype``, ``shape``, ``scale``,
    ``gate_up``, ``quantized_layers``, ``config``), the tensor or module, and what was found and expected."""

    severity: str
    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: [{self.rule}] {self.where}: {self.message}"


@dataclass(frozen=True)
class InputScaleSpread:
    """One MoE layer's input scales of one GEMM (``gate_up`` or ``down``) against the one the engine uses: the
    worst expert's ratio engine amax / own amax (1.0: it keeps its own) and the median over experts."""

    layer: int
    gemm: str
    worst_ratio: float
    worst_expert: int
    median_ratio: float


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
    layout = checkpoint_layout(path, report)
    if layout is None:
        return report
    family, arch, shapes, assign, headers = layout.family, layout.arch, layout.shapes, layout.schemes, layout.headers
    values = {}
    for module, shape in shapes.items():
        scheme = assign.get(module)
        if scheme is None:
            if not any(f.rule == "quantized_layers" and f.where == module for f in report.findings):
                _check_unquantized(module, shape, headers, report)
            continue
        key, inputs = scheme
        report.schemes[key + ("" if inputs else "_a16")] = report.schemes.get(key + ("" if inputs else "_a16"), 0) + 1
        values[module] = _check_linear(path, module, shape, FORMAT_RULES[(report.format, key)], inputs, headers,
                                       report)
    _check_experts(arch, family, assign, values, report)
    if reference is not None and report.ok:
        from .engine_forward import engine_order_kl

        report.kl = engine_order_kl(path, reference, engine=engine)
        if not all(math.isfinite(k) for k in report.kl):
            report.findings.append(Finding("error", "forward", str(path), f"the engine-order forward's KL to the "
                                           f"reference is not finite: {report.kl}"))
    return report


@dataclass(frozen=True)
class CheckpointLayout:
    """What the files and config say: the family and architecture, every linear's ``[R, C]`` shape by Hugging Face
    module name, its (rule key, inputs quantized) scheme (absent: unquantized), each tensor's (file, header)."""

    family: object
    arch: object
    format: str
    shapes: dict
    schemes: dict
    headers: dict


def checkpoint_layout(path: str | os.PathLike, report: CheckReport | None = None) -> CheckpointLayout | None:
    """The :class:`CheckpointLayout` of a checkpoint (None: not a quantized checkpoint the rules know; why is in
    ``report``'s findings).

    Raises:
        ExportError: no readable ``config.json``, or a family the checker does not know.
    """
    path = Path(path)
    report = report if report is not None else CheckReport(str(path), "vllm")
    cfg = read_hf_config(path)
    family = family_for_architecture(cfg)
    arch = family.arch_from_hf(cfg)
    qcfg, report.format = _quant_config(path, cfg, report)
    if report.format is None:
        return None
    headers = _headers(path, report)
    shapes = {family.hf_module(name): shape for name, shape in canonical_shapes(arch).items()
              if len(shape) == 2 and name != "embed_tokens"}
    schemes = _schemes_per_module(report.format, qcfg, shapes, headers, report)
    return CheckpointLayout(family, arch, report.format, shapes, schemes, headers)


def check_all_engines(path: str | os.PathLike, engines=ENGINES) -> tuple[bool, str]:
    """Checks ``path`` against every engine of ``engines``; returns whether all pass and one line saying so
    (``check vllm PASS, sglang PASS, trtllm FAIL (...): <first error>``), for the end of an export.

    Raises:
        ExportError: as :func:`check_checkpoint`.
    """
    reports = [check_checkpoint(path, engine=e) for e in engines]
    first = reports[0]
    schemes = ", ".join(f"{n} {s}" for s, n in sorted(first.schemes.items())) or "no quantized linear"
    warnings = sum(len(r.warnings) for r in reports)
    verdicts = ", ".join(f"{r.engine} {'PASS' if r.ok else 'FAIL'}" for r in reports)
    line = f"check {verdicts} ({first.format}: {schemes}; {_count(range(warnings), 'warning')})"
    failed = next((r for r in reports if not r.ok), None)
    if failed is not None:
        line += f": {failed.engine}: {failed.errors[0]} (modelopt-moe check {path} --details)"
    return failed is None, line


# ------------------------------------------------------------------------------------------------ config


def _quant_config(path: Path, cfg: dict, report: CheckReport) -> tuple[dict, str | None]:
    """The quantization config (``config.json``'s, else ``hf_quant_config.json``'s) and its format."""
    q = cfg.get("quantization_config")
    if q is None and (path / "hf_quant_config.json").is_file():
        q = dict(json.loads((path / "hf_quant_config.json").read_text()).get("quantization") or {})
        q.setdefault("quant_method", "modelopt")
    if not isinstance(q, dict):
        report.findings.append(Finding("error", "config", str(path / "config.json"),
                                       "no quantization_config (nor hf_quant_config.json): not a quantized "
                                       "checkpoint"))
        return {}, None
    method = q.get("quant_method")
    if method not in ("compressed-tensors", "modelopt"):
        report.findings.append(Finding("error", "config", "quantization_config.quant_method",
                                       f"{method!r}; the checker knows 'compressed-tensors' and 'modelopt'"))
        return q, None
    return q, method


def _matches(name: str, patterns) -> bool:
    """compressed-tensors' ``re:`` targets, exact names, Model Optimizer's wildcards."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name or fnmatch.fnmatchcase(name, p):
            return True
    return False


def _ct_scheme(group: dict, where: str, report: CheckReport) -> tuple[str, bool] | None:
    w, x = group.get("weights") or {}, group.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") not in (4, 8):
        report.findings.append(Finding("warning", "config", where, f"weights {w.get('type')} {w.get('num_bits')} "
                                       "bits: no rules for it yet, its linears are not checked"))
        return None
    inputs = bool(x) and x.get("dynamic", False) is not True  # NVFP4's "local": dynamic blocks, a static global
    return rule_key(w["num_bits"], w.get("strategy") == "channel"), inputs


def _schemes_per_module(fmt: str, q: dict, shapes: dict, headers: dict, report: CheckReport) -> dict:
    """Module -> (rule key, inputs quantized) for every quantized linear the config assigns a scheme."""
    out: dict[str, tuple[str, bool]] = {}
    if fmt == "compressed-tensors":
        groups = [(name, g, _ct_scheme(g, f"quantization_config.config_groups.{name}", report))
                  for name, g in (q.get("config_groups") or {}).items()]
        for module in shapes:
            if _matches(module, q.get("ignore")):
                continue
            for _, g, scheme in groups:
                if scheme is not None and ("Linear" in g.get("targets", ()) or _matches(module, g.get("targets"))):
                    out[module] = scheme
                    break
        return out
    algo = q.get("quant_algo")
    excluded = list(q.get("exclude_modules") or []) + list(q.get("ignore") or [])
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers") or {}
        for module in shapes:
            entry = layers.get(module)
            if entry is None:
                if any(module + "." + s in headers for s in ("weight_scale", "weight_scale_2", "input_scale")):
                    report.findings.append(Finding(
                        "error", "quantized_layers", module,
                        "stores quantized tensors but quantization_config.quantized_layers has no entry for it: the "
                        "engines load it as unquantized"))
                continue
            scheme = _MODELOPT_ALGOS.get(entry.get("quant_algo"))
            if scheme is None:
                report.findings.append(Finding("warning", "config", f"quantized_layers.{module}",
                                               f"quant_algo {entry.get('quant_algo')!r}: no rules for it yet"))
            else:
                out[module] = scheme
        return out
    scheme = _MODELOPT_ALGOS.get(algo)
    if scheme is None:
        report.findings.append(Finding("warning", "config", "quant_algo", f"{algo!r}: no rules for it yet (known: "
                                       f"{sorted(_MODELOPT_ALGOS)}, MIXED_PRECISION)"))
        return out
    return {m: scheme for m in shapes if not _matches(m, excluded)}


# ------------------------------------------------------------------------------------------------ tensors


def _headers(path: Path, report: CheckReport) -> dict[str, tuple[str, TensorHeader]]:
    """Tensor name -> (file, header entry), from the index and every shard's header."""
    try:
        weight_map = read_weight_map(path)
    except ExportError as e:
        report.findings.append(Finding("error", "missing", str(path), str(e)))
        return {}
    out, cache = {}, {}
    for name, file in weight_map.items():
        if file not in cache:
            try:
                cache[file] = read_header(path / file)
            except ExportError as e:
                report.findings.append(Finding("error", "missing", file, str(e)))
                cache[file] = {}
        if name in cache[file]:
            out[name] = (file, cache[file][name])
        elif cache[file]:
            report.findings.append(Finding("error", "missing", name, f"the index places it in {file}, which has no "
                                           "such tensor"))
    return out


def _expected_shape(rule: TensorRule, r: int, c: int) -> tuple[tuple[int, ...], ...]:
    return {"w": ((r, c),), "packed": ((r, c // 2),), "blocks16": ((r, c // 16),), "scalar": ((), (1,)),
            "rows": ((r, 1), (r,))}[rule.shape]


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


def _check_linear(path: Path, module: str, shape, rule: FormatRule, inputs: bool, headers: dict,
                  report: CheckReport) -> dict[str, float]:
    """Checks one quantized linear's tensors; returns its per-tensor scale values by role."""
    r, c = shape
    values: dict[str, float] = {}
    for t in rule.stored(inputs):
        name = f"{module}.{t.suffix}"
        if name not in headers:
            why = " (engines read a missing scale as zero or uninitialised memory: NaN or inf)" if "scale" in t.role \
                else ""
            report.findings.append(Finding("error", "missing", name, f"absent{why}"))
            continue
        file, h = headers[name]
        if h.dtype != t.dtype:
            report.findings.append(Finding("error", "dtype", name, f"{h.dtype}, expected {t.dtype}"))
        allowed = _expected_shape(t, r, c)
        if h.shape not in allowed:
            report.findings.append(Finding("error", "shape", name, f"{list(h.shape)}, expected "
                                           f"{' or '.join(str(list(s)) for s in allowed)}"))
            continue
        if t.role == "weight":
            continue
        v = _load(path, file, name).float()
        if t.role == "block_scale":
            bad = ~torch.isfinite(v) | (v < 0)
            if bad.any():
                report.findings.append(Finding("error", "scale", name, f"{int(bad.sum())} block scales not finite "
                                               f"or negative (first {v[bad].flatten()[0].item()})"))
            continue
        problem = _scale_problem(v)
        if problem:
            report.findings.append(Finding("error", "scale", name, problem))
        elif v.numel() == 1:
            values[t.role] = t.amax(v.item())
    return values


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


def _check_experts(arch, family, assign: dict, values: dict, report: CheckReport) -> None:
    """Gate and up sharing the scales the engine fuses; the input-scale spread after the engine's collapse."""
    for layer in range(arch.num_layers):
        modules = {k: [family.hf_module(f"layers.{layer}.experts.{e}.{k}") for e in range(arch.num_experts)]
                   for k in ("gate", "up", "down")}
        scheme = assign.get(modules["gate"][0])
        if scheme is None:
            continue
        engine_rule: EngineRule | None = ENGINE_RULES.get((report.engine, report.format, scheme[0]))
        if engine_rule is None:
            if layer == 0:
                report.findings.append(Finding("warning", "config", f"{report.engine} x {report.format}",
                                               f"no engine rules for {scheme[0]} experts here; gate/up and input "
                                               "scale collapse not checked"))
            continue
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
        if not scheme[1]:
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


def _gate_up_effect(engine: str) -> str:
    return "TensorRT-LLM refuses to load it" if engine == "trtllm" else "the up projection is dequantized with the " \
        "gate's scale"
