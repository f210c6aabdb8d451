"""Config errors: :class:`ConfigError` and the messages built from pydantic's validation errors (the file, the
key path, the bad value, and for an unknown key the allowed keys with a did-you-mean)."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from .config_schema import (
    AutoswitchConfig,
    BackwardConfig,
    ExpertsConfig,
    MaxCalibConfig,
    QuantCfgEntry,
    QuantizeConfig,
    QuantizerAttributeConfig,
    SmoothExpertInputsConfig,
)

__all__ = ["ConfigError", "format_validation_error"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file (if any), the key and the value."""


def format_validation_error(err: ValidationError, source: str, data: Any = None) -> str:
    """One line per error of ``err``: ``<source>: key '<path>': <message> (got <value>)``; an unknown key gets the
    allowed keys of its model and the closest one."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            key = str(e["loc"][-1])
            allowed = _allowed_keys(e["loc"][:-1])
            hint = difflib.get_close_matches(key, allowed, n=1)
            msg = f"unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            msg += f"; allowed keys: {', '.join(allowed)}"
        else:
            msg = msg.removeprefix("Value error, ")
            got = repr(e.get("input"))
            # A whole entry or config as the bad value says little; the message names the key and value itself.
            if not isinstance(e.get("input"), dict) and len(got) <= 200:
                msg = f"{msg} (got {got})"
        lines.append(f"{source}: key '{loc}': {msg}" if loc else f"{source}: {msg}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names of the model found at ``loc`` inside :class:`QuantizeConfig` (for error hints)."""
    model: type[BaseModel] = QuantizeConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            break
        nxt = {"quant_cfg": QuantCfgEntry, "cfg": QuantizerAttributeConfig, "experts": ExpertsConfig,
               "backward": BackwardConfig, "max_calib": MaxCalibConfig, "algorithm": MaxCalibConfig,
               "autoswitch": AutoswitchConfig, "smooth_expert_inputs": SmoothExpertInputsConfig}.get(str(part))
        if nxt is None:
            break
        model = nxt
    return sorted(model.model_fields)
