r"""One scheme per linear: checkpoints whose layers carry different formats, in the configs the readers parse.

A quantization config whose rules give different formats to different linears (NVFP4 routed experts, FP8 attention,
bf16 router and output layer) exports as ONE checkpoint, each linear with its own scheme (:mod:`.schemes`) and its
own tensors; linears left unquantized are stored in the model's dtype and listed as such. A checkpoint whose
quantized linears all share one scheme gets exactly the single-scheme configs of :mod:`.schemes`.

Several schemes are written as the readers of each format parse them:

* **Model Optimizer** (``config.json`` ``quantization_config`` and ``hf_quant_config.json``'s ``quantization``):
  ``quant_algo: MIXED_PRECISION`` and ``quantized_layers``, one entry per quantized linear by its Hugging Face name
  (``{"quant_algo": "NVFP4", "group_size": 16}``, ``{"quant_algo": "FP8"}``); unquantized linears in
  ``exclude_modules`` (and ``ignore`` in ``config.json``). vLLM's ``ModelOptMixedPrecisionConfig`` reads
  ``quantized_layers`` from either file, looks a layer up by its name (a fused ``qkv_proj`` by its shards, all of
  which must share one ``quant_algo``; its fused experts ``...mlp.experts`` by the first entry under that prefix) and
  takes ``group_size`` from the first NVFP4 entry.
* **compressed-tensors**: ``format: mixed-precision`` and one config group per scheme, each with its own ``format``
  and ``targets``; ``ignore`` the unquantized linears. A target is an exact module name, or ``re:<regex>`` matched
  with ``re.match`` (compressed-tensors and vLLM alike). The experts of an ``...experts`` module that all share the
  group's scheme are one target ``re:^<prefix>($|\.)``, with the layer index generalised (``\d+``) when every layer
  agrees: it matches the per-expert linears (``...experts.7.gate_proj``, what compressed-tensors and transformers
  see) and the fused experts module itself (``...mlp.experts``, the name vLLM matches for its fused MoE layer).
  transformers 5.23 picks the experts' group as the one with a ``re:`` target naming ``experts``, and the dense
  linears' group as the first other one: every other linear is an exact name.

``kv_cache_*`` and every other key come from the single-scheme configs of :mod:`.schemes`, so what those carry, the
per-layer configs carry too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .errors import ExportError
from .fused_mxfp4 import FILE_FORMAT
from .schemes import FORMATS, SCHEMES, LinearQuant, Scheme, hf_quant_config, quantization_config, scheme_of

__all__ = ["MIXED_ALGO", "CT_MIXED_FORMAT", "resolve_schemes", "layers_quantization_config",
           "layers_hf_quant_config", "ct_targets"]

MIXED_ALGO = "MIXED_PRECISION"
CT_MIXED_FORMAT = "mixed-precision"
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.\d+\.[^.]+$")


def resolve_schemes(linears: Mapping[str, LinearQuant], fmt: str) -> dict[str, Scheme | None]:
    """Every linear's scheme (None: unquantized), each checked against format ``fmt``.

    Args:
        linears: Hugging Face module name -> its quantizers, for every exported linear.
        fmt: ``compressed-tensors``, ``modelopt``, ``hf`` (unquantized) or ``hf-mxfp4`` (MXFP4 fused experts).

    Returns:
        Module name -> scheme, in the order of ``linears`` (all None for ``hf``).

    Raises:
        ExportError: an unknown format; ``hf`` on a quantized model; a quantized format on a model with no quantized
            linear; a linear whose quantizers no format expresses, or whose scheme ``fmt`` cannot express (naming
            the linear and the formats that would take it).
    """
    if fmt not in (*FORMATS, FILE_FORMAT):
        raise ExportError(f"format={fmt!r}: expected one of {(*FORMATS, FILE_FORMAT)}")
    schemes = {name: scheme_of(q, name) for name, q in linears.items()}
    quantized = [name for name, s in schemes.items() if s is not None]
    if fmt == FILE_FORMAT and quantized:
        raise ExportError(f"format={fmt!r} stores the fused experts in MXFP4 and every other layer unquantized (as the "
                          f"published gpt-oss checkpoints), but {quantized[0]} is quantized ({linears[quantized[0]]}); "
                          "disable its quantizers (e.g. mtq.disable_quantizer(model, '*self_attention*')), or use "
                          "format='compressed-tensors' for the other layers")
    if fmt == "hf" and quantized:
        raise ExportError(f"format='hf' writes unquantized weights, but the model is quantized ({quantized[0]}: "
                          f"{linears[quantized[0]]}); use format='compressed-tensors' or 'modelopt'")
    if fmt not in ("hf", FILE_FORMAT) and not quantized:
        raise ExportError(f"format={fmt!r}: the model is not quantized (none of its {len(linears)} exported linears "
                          "has an enabled quantizer); run mtq.quantize first, or use format='hf'")
    if fmt == "modelopt":
        for name in quantized:
            if schemes[name].modelopt_algo is None:
                algos = sorted({s.modelopt_algo for s in SCHEMES.values() if s.modelopt_algo is not None})
                raise ExportError(f"format='modelopt': scheme {schemes[name].name} ({name}: {linears[name]}) has no "
                                  f"Model Optimizer quant_algo that an engine reads (those are {', '.join(algos)}); "
                                  "export it with format='compressed-tensors', or give that linear a scheme Model "
                                  "Optimizer names")
    return schemes


def _by_scheme(layers: Mapping[str, Scheme]) -> dict[Scheme, list[str]]:
    groups: dict[Scheme, list[str]] = {}
    for name, s in layers.items():
        groups.setdefault(s, []).append(name)
    return groups


def layers_quantization_config(layers: Mapping[str, Scheme], fmt: str, ignore: list[str]) -> dict:
    """The ``quantization_config`` entry of ``config.json`` for linears with their own schemes.

    Args:
        layers: every quantized linear's Hugging Face name -> its scheme (at least one).
        fmt: ``compressed-tensors`` or ``modelopt``.
        ignore: the unquantized linears' names.

    Returns:
        One scheme: :func:`~.schemes.quantization_config`'s entry. Several: the same entry of the first scheme with
        per-layer schemes (Model Optimizer ``MIXED_PRECISION`` + ``quantized_layers``; compressed-tensors
        ``mixed-precision`` with a config group per scheme), as the module docstring says.

    Raises:
        ExportError: no quantized linear, or a format without a ``quantization_config``.
    """
    groups = _by_scheme(layers)
    if not groups:
        raise ExportError(f"format={fmt!r}: no quantized linear to write a quantization_config for")
    first = next(iter(groups))
    cfg = quantization_config(first, fmt, ignore)
    if len(groups) == 1:
        return cfg
    if fmt == "modelopt":
        cfg.pop("group_size", None)  # per layer: vLLM takes it from the first NVFP4 entry
        return {**cfg, "quant_algo": MIXED_ALGO, "quantized_layers": _quantized_layers(layers)}
    names = {**dict.fromkeys(ignore), **{n: s.name for n, s in layers.items()}}
    config_groups = {}
    for i, (s, modules) in enumerate(groups.items()):
        group = quantization_config(s, fmt, ignore)["config_groups"]["group_0"]
        config_groups[f"group_{i}"] = {**group, "targets": ct_targets(modules, s.name, names)}
    return {**cfg, "format": CT_MIXED_FORMAT, "config_groups": config_groups}


def layers_hf_quant_config(layers: Mapping[str, Scheme], ignore: list[str]) -> dict:
    """Model Optimizer's ``hf_quant_config.json`` for linears with their own schemes: one scheme,
    :func:`~.schemes.hf_quant_config`; several, its ``quantization`` with ``quant_algo: MIXED_PRECISION`` and
    ``quantized_layers`` (the same entries as ``config.json``'s).

    Raises:
        ExportError: no quantized linear.
    """
    groups = _by_scheme(layers)
    if not groups:
        raise ExportError("format='modelopt': no quantized linear to write hf_quant_config.json for")
    cfg = hf_quant_config(next(iter(groups)), ignore)
    if len(groups) > 1:
        quant = {k: v for k, v in cfg["quantization"].items() if k != "group_size"}
        cfg["quantization"] = {**quant, "quant_algo": MIXED_ALGO, "quantized_layers": _quantized_layers(layers)}
    return cfg


def _quantized_layers(layers: Mapping[str, Scheme]) -> dict[str, dict]:
    """Model Optimizer's per-layer entries: ``quant_algo`` and, for block formats, ``group_size``."""
    out = {}
    for name, s in layers.items():
        entry = {"quant_algo": s.modelopt_algo}
        if s.codec.group_size is not None:
            entry["group_size"] = s.codec.group_size
        out[name] = entry
    return out


def _regex(prefix: str, generalise: bool) -> str:
    parts = [r"\d+" if generalise and p.isdigit() else re.escape(p) for p in prefix.split(".")]
    return r"\.".join(parts)


def ct_targets(modules: list[str], scheme: str, names: Mapping[str, str | None]) -> list[str]:
    """compressed-tensors ``targets`` of one config group (see the module docstring).

    Args:
        modules: the group's linears (Hugging Face names), in model order.
        scheme: the group's scheme name.
        names: every exported linear -> its scheme name (None: unquantized), to know which experts modules hold
            only this group's scheme.

    Returns:
        ``re:`` targets for whole experts modules of this scheme (one per layer, or one for all layers where every
        layer's experts are in it), then the exact names of the other linears.
    """
    held: dict[str, set] = {}  # experts module -> the schemes of the linears under it
    for name, s in names.items():
        m = _EXPERT.match(name)
        if m:
            held.setdefault(m["prefix"], set()).add(s)
    whole = {p for p, s in held.items() if s == {scheme}}
    by_pattern: dict[str, set] = {}  # layer-generalised pattern -> its experts modules, whatever their schemes
    for p in held:
        by_pattern.setdefault(_regex(p, True), set()).add(p)
    targets, exact = [], []
    for name in modules:
        m = _EXPERT.match(name)
        if not (m and m["prefix"] in whole):
            exact.append(name)
            continue
        pattern = _regex(m["prefix"], True)
        target = pattern if by_pattern[pattern] <= whole else _regex(m["prefix"], False)
        target = f"re:^{target}($|\\.)"
        if target not in targets:
            targets.append(target)
    return targets + exact
