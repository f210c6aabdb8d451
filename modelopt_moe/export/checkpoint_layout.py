"""What a Hugging Face checkpoint holds, read from its config and the shards' headers: the family and
architecture, every linear's shape, the quantization scheme each linear gets from the config (compressed-tensors
``config_groups`` / ``ignore``; Model Optimizer ``quant_algo`` / ``exclude_modules`` / ``quantized_layers``), the
NVFP4 linears whose weights or inputs the ``nvfp4_four_over_six`` marker (:mod:`.four_over_six`) names, the KV
cache's quantization, and each tensor's file and header entry. Shared by the engine-contract checker (:mod:`.check`)
and the engine-order forward (:mod:`.engine_forward`); what cannot be read becomes a :class:`Finding`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .check_rules import FORMAT_RULES, FormatRule, rule_key
from .errors import ExportError
from .families import canonical_shapes, family_for_architecture, read_hf_config
from .four_over_six import MARKER_KEY
from .safetensors_files import TensorHeader, read_header, read_weight_map

__all__ = ["Finding", "LinearScheme", "CheckpointLayout", "checkpoint_layout", "matches_targets"]


class LinearScheme(NamedTuple):
    """One quantized linear's scheme as the config states it: the rule key of
    :data:`~.check_rules.FORMAT_RULES`, whether a static input scale is stored, the weight's group (an int) or 2-D
    block (``(rows, cols)``) where the format has one, and whether inputs are quantized with scales from the data at
    run time (no stored input scale), and the inputs' compressed-tensors strategy (``token``, ``tensor_group``,
    ``group128`` with its group size; ``none``: inputs not quantized; None: the format does not say it this way)."""

    key: str
    inputs: bool
    group: int | tuple[int, int] | None = None
    dynamic: bool = False
    input_strategy: str | None = None

    @property
    def label(self) -> str:
        """The key with how inputs are quantized (``fp8_channel_dyn``: dynamic, ``_a16``: not at all)."""
        return self.key + ("" if self.inputs else "_dyn" if self.dynamic else "_a16")


_FP8_BLOCK = (128, 128)  # Model Optimizer's FP8_PB_WO block (its group_size, where given, is both sides)
_MODELOPT_ALGOS = {  # quant_algo -> (rule key, static input scale, group, dynamic inputs)
    "FP8": ("fp8_tensor", True, None, False), "NVFP4": ("nvfp4_blocks", True, 16, False),
    "W4A16_NVFP4": ("nvfp4_blocks", False, 16, False),
    "FP8_PER_CHANNEL_PER_TOKEN": ("fp8_channel", False, None, True),
    "FP8_PB_WO": ("fp8_block", False, _FP8_BLOCK, True),  # vLLM runs its inputs in dynamic 1x128 groups
    "MXFP8": ("mxfp8_blocks", False, 32, True),
}


@dataclass(frozen=True)
class Finding:
    """One problem: ``severity`` (``error`` / ``warning``), a rule id (``missing``, ``dtype``, ``shape``, ``scale``,
    ``gate_up``, ``quantized_layers``, ``config``, ``kv_cache``, ``calibration``), the tensor or module, and what
    was found and expected."""

    severity: str
    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: [{self.rule}] {self.where}: {self.message}"


@dataclass(frozen=True)
class CheckpointLayout:
    """What the files and config say: the family and architecture, every linear's ``[R, C]`` shape by Hugging Face
    module name, its :class:`LinearScheme` (absent: unquantized), each tensor's (file, header), the KV cache's
    quantization as the config names it (``FP8``, ``NVFP4``; None: not quantized), and the NVFP4 linears whose
    weights (``four_over_six_weights``) and inputs (``four_over_six_inputs``) the checkpoint's 4-over-6 marker names:
    their second-level scales stand for ``amax / 1536``, not NVFP4's ``amax / 2688``."""

    family: object
    arch: object
    format: str
    shapes: dict
    schemes: dict
    headers: dict
    kv_cache: str | None = None
    four_over_six_weights: frozenset = frozenset()
    four_over_six_inputs: frozenset = frozenset()

    def format_rule(self, module: str) -> FormatRule:
        """The :class:`~.check_rules.FormatRule` of a quantized linear, its scales converted to amaxes with the
        4-over-6 bound where the marker names the linear's weights or inputs."""
        return FORMAT_RULES[(self.format, self.schemes[module].key)].four_over_six(
            weights=module in self.four_over_six_weights, inputs=module in self.four_over_six_inputs)


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
    fos_weights, fos_inputs = _four_over_six(path, qcfg, schemes, findings)
    return CheckpointLayout(family, arch, fmt, shapes, schemes, headers, _kv_cache(fmt, qcfg, findings),
                            fos_weights, fos_inputs)


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


def matches_targets(name: str, patterns) -> bool:
    """compressed-tensors' ``re:`` targets, exact names, Model Optimizer's wildcards."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name or fnmatch.fnmatchcase(name, p):
            return True
    return False


def _ct_scheme(group: dict, where: str, findings: list) -> LinearScheme | None:
    w, x = group.get("weights") or {}, group.get("input_activations")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy", "tensor")
    key, size = None, None
    if kind == "float" and bits == 8 and strategy in ("tensor", "channel"):
        key = rule_key(8, strategy == "channel")
    elif kind == "float" and bits == 4 and strategy == "tensor_group":
        key, size = rule_key(4, False), w.get("group_size")
    elif kind == "float" and bits == 8 and strategy == "block" and len(w.get("block_structure") or ()) == 2:
        key, size = "fp8_block", tuple(w["block_structure"])
    elif kind == "float" and bits in (4, 8) and strategy == "group" and w.get("group_size"):
        key, size = ("mxfp4_blocks" if bits == 4 else "mxfp8_blocks"), w["group_size"]
    elif kind == "int" and bits == 4 and strategy == "group" and w.get("group_size"):
        key, size = "int4_groups", w["group_size"]
    if key is None:
        findings.append(Finding("warning", "config", where, f"weights {kind} {bits} bits, strategy {strategy}: no "
                                "rules for it yet, its linears are not checked"))
        return None
    # NVFP4's "local" inputs: dynamic blocks under a static global scale, which is stored
    dynamic = bool(x) and x.get("dynamic", False) is True
    x_strategy = "none" if not x else f"{x.get('strategy')}" + (f"{x.get('group_size')}" if x.get("strategy") == "group"
                                                                 else "")
    return LinearScheme(key, bool(x) and not dynamic, size, dynamic, x_strategy)


def _four_over_six(path: Path, q: dict, schemes: dict, findings: list) -> tuple[frozenset, frozenset]:
    """The NVFP4 linears whose weights and inputs the 4-over-6 marker names (``quantization_config``'s, else the top
    level of ``hf_quant_config.json``); a marker that is not the dict of target lists the export writes is an error
    finding, and the linears are then read as plain NVFP4."""
    marker, where = q.get(MARKER_KEY), f"quantization_config.{MARKER_KEY}"
    if marker is None and (path / "hf_quant_config.json").is_file():
        marker = json.loads((path / "hf_quant_config.json").read_text()).get(MARKER_KEY)
        where = f"hf_quant_config.json {MARKER_KEY}"
    if marker is None:
        return frozenset(), frozenset()
    keys = ("weights", "input_activations")
    targets = {k: marker.get(k, []) for k in keys} if isinstance(marker, dict) else {}
    if set(targets) != set(keys) or not all(isinstance(t, list) and all(isinstance(p, str) for p in t)
                                            for t in targets.values()):
        findings.append(Finding("error", "config", where, f"{marker!r}: expected a dict whose 'weights' and "
                                "'input_activations' are lists of names and 're:' patterns; its linears are read as "
                                "plain NVFP4"))
        return frozenset(), frozenset()
    nvfp4 = [m for m, s in schemes.items() if s.key == rule_key(4, False)]
    return tuple(frozenset(m for m in nvfp4 if matches_targets(m, targets[k])) for k in keys)


def _kv_cache(fmt: str, q: dict, findings: list) -> str | None:
    """The KV cache's quantization the config states (``FP8``, ``NVFP4``, ...; None: none)."""
    if fmt == "modelopt":
        return q.get("kv_cache_quant_algo") or None
    scheme = q.get("kv_cache_scheme")
    if not scheme:
        return None
    if scheme.get("type") == "float" and scheme.get("num_bits") == 8 and scheme.get("strategy", "tensor") == "tensor" \
            and not scheme.get("dynamic"):
        return "FP8"
    findings.append(Finding("warning", "config", "quantization_config.kv_cache_scheme", f"{scheme}: no rules for it "
                            "yet (known: FP8 E4M3 per tensor, static); its scales are not checked"))
    return None


def _schemes_per_module(fmt: str, q: dict, shapes: dict, headers: dict, findings: list) -> dict:
    """Module -> (rule key, inputs quantized) for every quantized linear the config assigns a scheme."""
    out: dict[str, LinearScheme] = {}
    if fmt == "compressed-tensors":
        groups = [(name, g, _ct_scheme(g, f"quantization_config.config_groups.{name}", findings))
                  for name, g in (q.get("config_groups") or {}).items()]
        for module in shapes:
            if matches_targets(module, q.get("ignore")):
                continue
            for _, g, scheme in groups:
                if scheme is not None and ("Linear" in g.get("targets", ())
                                           or matches_targets(module, g.get("targets"))):
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
            scheme = _modelopt_scheme(entry.get("quant_algo"), entry.get("group_size"))
            if scheme is None:
                findings.append(Finding("warning", "config", f"quantized_layers.{module}",
                                               f"quant_algo {entry.get('quant_algo')!r}: no rules for it yet"))
            else:
                out[module] = scheme
        return out
    scheme = _modelopt_scheme(algo, q.get("group_size"))
    if scheme is None:
        findings.append(Finding("warning", "config", "quant_algo", f"{algo!r}: no rules for it yet (known: "
                                       f"{sorted(_MODELOPT_ALGOS)}, MIXED_PRECISION)"))
        return out
    return {m: scheme for m in shapes if not matches_targets(m, excluded)}


def _modelopt_scheme(algo, group_size) -> LinearScheme | None:
    if algo not in _MODELOPT_ALGOS:
        return None
    key, inputs, group, dynamic = _MODELOPT_ALGOS[algo]
    if key == "fp8_block" and group_size:
        group = (int(group_size), int(group_size))
    return LinearScheme(key, inputs, group, dynamic)


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
