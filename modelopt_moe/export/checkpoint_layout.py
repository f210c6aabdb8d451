"""What a Hugging Face checkpoint holds, read from its config and the shards' headers: the family and
architecture, every linear's shape, the quantization scheme each linear gets from the config (compressed-tensors
``config_groups`` / ``ignore``; Model Optimizer ``quant_algo`` / ``exclude_modules`` / ``quantized_layers``), and each
tensor's file and header entry. Shared by the engine-contract checker (:mod:`.check`) and the engine-order forward
(:mod:`.engine_forward`); what cannot be read becomes a :class:`Finding`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .check_rules import rule_key
from .errors import ExportError
from .families import canonical_shapes, family_for_architecture, read_hf_config
from .safetensors_files import TensorHeader, read_header, read_weight_map

__all__ = ["Finding", "CheckpointLayout", "checkpoint_layout"]

_MODELOPT_ALGOS = {"FP8": ("fp8_tensor", True), "NVFP4": ("nvfp4_blocks", True), "W4A16_NVFP4": ("nvfp4_blocks", False)}


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
class CheckpointLayout:
    """What the files and config say: the family and architecture, every linear's ``[R, C]`` shape by Hugging Face
    module name, its (rule key, inputs quantized) scheme (absent: unquantized), each tensor's (file, header)."""

    family: object
    arch: object
    format: str
    shapes: dict
    schemes: dict
    headers: dict


def checkpoint_layout(path: str | os.PathLike, findings: list | None = None) -> CheckpointLayout | None:
    """The :class:`CheckpointLayout` of a checkpoint (None: not a quantized checkpoint the rules know; why is
    appended to ``findings``).

    Raises:
        ExportError: no readable ``config.json``, or a family the checker does not know.
    """
    path = Path(path)
    findings = findings if findings is not None else []
    cfg = read_hf_config(path)
    family = family_for_architecture(cfg)
    arch = family.arch_from_hf(cfg)
    qcfg, fmt = _quant_config(path, cfg, findings)
    if fmt is None:
        return None
    headers = _headers(path, findings)
    shapes = {family.hf_module(name): shape for name, shape in canonical_shapes(arch).items()
              if len(shape) == 2 and name != "embed_tokens"}
    schemes = _schemes_per_module(fmt, qcfg, shapes, headers, findings)
    return CheckpointLayout(family, arch, fmt, shapes, schemes, headers)



# ------------------------------------------------------------------------------------------------ config


def _quant_config(path: Path, cfg: dict, findings: list) -> tuple[dict, str | None]:
    """The quantization config (``config.json``'s, else ``hf_quant_config.json``'s) and its format."""
    q = cfg.get("quantization_config")
    if q is None and (path / "hf_quant_config.json").is_file():
        q = dict(json.loads((path / "hf_quant_config.json").read_text()).get("quantization") or {})
        q.setdefault("quant_method", "modelopt")
    if not isinstance(q, dict):
        findings.append(Finding("error", "config", str(path / "config.json"),
                                       "no quantization_config (nor hf_quant_config.json): not a quantized "
                                       "checkpoint"))
        return {}, None
    method = q.get("quant_method")
    if method not in ("compressed-tensors", "modelopt"):
        findings.append(Finding("error", "config", "quantization_config.quant_method",
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


def _ct_scheme(group: dict, where: str, findings: list) -> tuple[str, bool] | None:
    w, x = group.get("weights") or {}, group.get("input_activations")
    # the rules know NVFP4 (4-bit tensor_group) and FP8 per tensor / channel; blocks, MX groups and ints: not yet
    known = {4: ("tensor_group",), 8: ("tensor", "channel")}
    if w.get("type") != "float" or w.get("strategy", "tensor") not in known.get(w.get("num_bits"), ()):
        findings.append(Finding("warning", "config", where, f"weights {w.get('type')} {w.get('num_bits')} "
                                       f"bits, strategy {w.get('strategy')}: no rules for it yet, its linears are "
                                       "not checked"))
        return None
    inputs = bool(x) and x.get("dynamic", False) is not True  # NVFP4's "local": dynamic blocks, a static global
    return rule_key(w["num_bits"], w.get("strategy") == "channel"), inputs


def _schemes_per_module(fmt: str, q: dict, shapes: dict, headers: dict, findings: list) -> dict:
    """Module -> (rule key, inputs quantized) for every quantized linear the config assigns a scheme."""
    out: dict[str, tuple[str, bool]] = {}
    if fmt == "compressed-tensors":
        groups = [(name, g, _ct_scheme(g, f"quantization_config.config_groups.{name}", findings))
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
                    findings.append(Finding(
                        "error", "quantized_layers", module,
                        "stores quantized tensors but quantization_config.quantized_layers has no entry for it: the "
                        "engines load it as unquantized"))
                continue
            scheme = _MODELOPT_ALGOS.get(entry.get("quant_algo"))
            if scheme is None:
                findings.append(Finding("warning", "config", f"quantized_layers.{module}",
                                               f"quant_algo {entry.get('quant_algo')!r}: no rules for it yet"))
            else:
                out[module] = scheme
        return out
    scheme = _MODELOPT_ALGOS.get(algo)
    if scheme is None:
        findings.append(Finding("warning", "config", "quant_algo", f"{algo!r}: no rules for it yet (known: "
                                       f"{sorted(_MODELOPT_ALGOS)}, MIXED_PRECISION)"))
        return out
    return {m: scheme for m in shapes if not _matches(m, excluded)}


# ------------------------------------------------------------------------------------------------ tensors


def _headers(path: Path, findings: list) -> dict[str, tuple[str, TensorHeader]]:
    """Tensor name -> (file, header entry), from the index and every shard's header."""
    try:
        weight_map = read_weight_map(path)
    except ExportError as e:
        findings.append(Finding("error", "missing", str(path), str(e)))
        return {}
    out, cache = {}, {}
    for name, file in weight_map.items():
        if file not in cache:
            try:
                cache[file] = read_header(path / file)
            except ExportError as e:
                findings.append(Finding("error", "missing", file, str(e)))
                cache[file] = {}
        if name in cache[file]:
            out[name] = (file, cache[file][name])
        elif cache[file]:
            findings.append(Finding("error", "missing", name, f"the index places it in {file}, which has no "
                                           "such tensor"))
    return out
