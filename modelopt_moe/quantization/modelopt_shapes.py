"""Model Optimizer's config shapes and names, normalized to this package's configs (no Model Optimizer import).

NVIDIA Model Optimizer 0.47 accepts ``quant_cfg`` in several shapes (its ordered list of
``{"quantizer_name", "parent_class", "cfg", "enable"}`` entries, the legacy flat dict ``{"*weight_quantizer": {...},
"default": {...}}``, legacy single-key list items and ``{"nn.Linear": {"*input_quantizer": {...}}}`` scopes) and names
parent classes by its registry keys (``"nn.Linear"``, ``"megatron_ColumnParallelLinear"``). This module turns them
into the list form :class:`~.config_schema.QuantizeConfig` validates, and builds the one kind of error every deliberate
difference raises: it names the key and value and points to :data:`COMPAT_DOC`.

It sits below the config schema, which uses it; :mod:`.modelopt_compat` gathers it with the translation of Model
Optimizer's quantizer state (which needs the schema).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "COMPAT_DOC",
    "unsupported",
    "normalize_quant_cfg",
    "parent_class_name",
    "UNSUPPORTED_ALGORITHMS",
]

# Where the table of deliberate differences lives (shipped with the sources; the error names the section).
COMPAT_DOC = "docs/modelopt_compat.md"

# Model Optimizer's calibration methods that this package does not implement (it has max and mse).
UNSUPPORTED_ALGORITHMS = ("local_hessian", "smoothquant", "awq_lite", "awq_clip", "awq_full", "svdquant",
                          "gptq", "nvfp4_act_headroom", "lsq")

# Model Optimizer's registry-key prefixes -> the framework class names they stand for.
_PARENT_PREFIXES = (("megatron_moe_", ""), ("megatron_", ""), ("te_mcore_", "TE"), ("nn.", ""))


def unsupported(what: str, value: Any, hint: str, section: str = "differences-from-model-optimizer") -> str:
    """The message of a deliberate difference: ``what`` (a key path), its ``value``, what to do instead and where
    the table of differences explains why."""
    return (f"{what}={value!r} is not supported by modelopt_moe ({hint}); see {COMPAT_DOC}#{section} "
            "(Differences from Model Optimizer)")


def parent_class_name(pattern: str) -> str:
    """A ``parent_class`` as written for Model Optimizer (``"nn.Linear"``, ``"megatron_RowParallelLinear"``,
    ``"te_mcore_ColumnParallelLinear"``) as the class-name wildcard this package matches; other patterns pass
    through unchanged."""
    for prefix, replacement in _PARENT_PREFIXES:
        if pattern.startswith(prefix) and len(pattern) > len(prefix):
            return replacement + pattern[len(prefix):]
    return pattern


def _legacy_entries(key: str, value: Any) -> list[dict]:
    """One legacy ``{key: value}`` pair as list entries (Model Optimizer's conversion rules)."""
    if key == "default":  # the legacy catch-all
        key = "*"
    if isinstance(key, str) and key.startswith("nn."):
        if not isinstance(value, Mapping):
            raise ValueError(f"quant_cfg[{key!r}]: a parent-class scope needs a mapping of quantizer patterns, got "
                             f"{value!r}")
        out = []
        for name, sub in value.items():
            sub = dict(sub) if isinstance(sub, Mapping) else {"cfg": sub}
            enable = sub.pop("enable", None)
            entry = {"quantizer_name": name, "parent_class": key, "cfg": sub or None}
            if enable is not None:
                entry["enable"] = enable
            out.append(entry)
        return out
    if isinstance(value, Mapping):
        cfg = {k: v for k, v in value.items() if k != "enable"} or None
        entry = {"quantizer_name": key, "cfg": cfg}
        if "enable" in value:
            entry["enable"] = value["enable"]
        return [entry]
    return [{"quantizer_name": key, "cfg": value}]


def normalize_quant_cfg(value: Any) -> Any:
    """``quant_cfg`` in any shape Model Optimizer 0.47 accepts, as a list of entry dicts (other values pass through
    for the validator to reject with its own message).

    Raises:
        ValueError: an item that is neither an entry nor a legacy ``{pattern: attributes}`` pair.
    """
    if isinstance(value, Mapping):
        if "quantizer_name" in value:
            raise ValueError("expected a list of entries; a mapping with 'quantizer_name' is one entry: put it in a "
                             "list")
        return [e for k, v in value.items() for e in _legacy_entries(k, v)]
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        return value
    out: list = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping) or "quantizer_name" in item:
            out.append(item)  # an entry (or a QuantCfgEntry, or something the validator rejects by name)
        elif len(item) == 1 or any(str(k).startswith("nn.") for k in item):
            for k, v in item.items():
                out.extend(_legacy_entries(k, v))
        else:
            raise ValueError(f"quant_cfg.{i}: expected an entry with 'quantizer_name' or a legacy "
                             f"{{pattern: attributes}} pair, got keys {sorted(map(str, item))}")
    return out
