"""Loading configs: YAML files with ``$import``, dicts, and shipped presets by bare name.

``$import: other.yaml`` at the top of a file merges that file first (its ``quant_cfg`` entries come before this
file's); ``- $import: other.yaml`` inside ``quant_cfg`` splices the other file's entries at that place. An imported
name is looked up beside the importing file first, then among the shipped presets. A key given twice in one mapping
of one file is an error (YAML readers keep the last silently); a file overriding a key of a file it imports is not.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .config_errors import ConfigError, format_validation_error
from .config_schema import QuantizeConfig
from .modelopt_shapes import normalize_quant_cfg
from .presets import find_preset, preset_names

__all__ = ["load_config", "to_config"]


def _import_target(importing: Path, target: str) -> Path:
    """``$import: target`` of file ``importing``: beside it first, else a shipped preset by bare name."""
    beside = importing.parent / target
    for candidate in (beside, beside.with_name(beside.name + ".yaml")):
        if candidate.is_file():
            return candidate
    return find_preset(target) or beside  # a missing file is reported with its path by _read_yaml


def _check_unique_keys(node: yaml.Node, path: Path, where: str = "") -> None:
    """Refuses a key that appears twice in one mapping of the composed document (at any depth)."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, path, f"{where}{i}.")
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, key.value) in lines:
                    raise ConfigError(f"{path}: key '{where}{key.value}' appears twice, on lines "
                                      f"{lines[key.tag, key.value]} and {line}; a config takes each key once (remove "
                                      "one)")
                lines[key.tag, key.value] = line
                _check_unique_keys(value, path, f"{where}{key.value}.")


def _read_yaml(path: Path, imported_from: Path | None) -> Any:
    if not path.is_file():
        where = f" (imported from {imported_from})" if imported_from else ""
        raise ConfigError(f"config file not found: {path}{where}")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_unique_keys(node, path)
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def _resolve_imports(path: Path, stack: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError(f"{stack[-1]}: key '$import': import cycle {chain}")
    data = _read_yaml(path, stack[-1] if stack else None)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base: dict = {}
    imports = data.pop("$import") if "$import" in data else []
    if not isinstance(imports, str | list):
        raise ConfigError(f"{path}: key '$import': expected a file name or a list of them, "
                          f"got {json.dumps(imports, default=str)}")
    for target in [imports] if isinstance(imports, str) else imports:
        if not isinstance(target, str):
            raise ConfigError(f"{path}: key '$import': expected a file name or a list of them, got {target!r}")
        base = _merge(base, _resolve_imports(_import_target(path, target), (*stack, path)))
    entries = data.get("quant_cfg")
    if isinstance(entries, dict):  # Model Optimizer's legacy {pattern: attributes} form
        try:
            entries = normalize_quant_cfg(entries)
        except ValueError as e:
            raise ConfigError(f"{path}: key 'quant_cfg': {e}") from None
    if entries is not None:
        if not isinstance(entries, list):
            raise ConfigError(f"{path}: key 'quant_cfg': expected a list of entries, got {type(entries).__name__}")
        spliced = []
        for i, entry in enumerate(entries):
            if isinstance(entry, dict) and "$import" in entry:
                if len(entry) != 1 or not isinstance(entry["$import"], str):
                    raise ConfigError(f"{path}: key 'quant_cfg.{i}.$import': expected a lone file name, got {entry!r}")
                sub = _resolve_imports(_import_target(path, entry["$import"]), (*stack, path))
                spliced.extend(sub.get("quant_cfg", []))
            else:
                spliced.append(entry)
        data["quant_cfg"] = spliced
    return _merge(base, data)


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge, ``quant_cfg`` lists concatenate (later wins), anything else is replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k == "quant_cfg" and isinstance(out.get(k), list) and isinstance(v, list):
            out[k] = out[k] + v
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def to_config(config: QuantizeConfig | dict, source: str = "<dict config>") -> QuantizeConfig:
    """Validates a dict (or passes a :class:`QuantizeConfig` through).

    Raises:
        ConfigError: naming ``source``, the key path and the bad value.
    """
    if isinstance(config, QuantizeConfig):
        return config
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a mapping or QuantizeConfig, got {type(config).__name__}")
    try:
        return QuantizeConfig.model_validate(config)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, config)) from None


def load_config(path: str | Path) -> QuantizeConfig:
    """Loads and validates a YAML config (resolving ``$import``).

    A bare name that is not a file here finds a shipped preset, with or without ``.yaml``
    (``load_config("nvfp4_default")``), or by its constant's name (``"NVFP4_DEFAULT_CFG"``). ``$import`` inside a
    file looks beside that file first, then among the shipped presets.

    Raises:
        ConfigError: missing file, bad YAML, a key given twice in one mapping (naming both lines), bad ``$import``,
            unknown key or bad value, naming the file and key.
    """
    p = Path(path)
    if not p.is_file():
        preset = find_preset(p)
        if preset is None and not p.suffix and len(p.parts) == 1:
            raise ConfigError(f"config file not found: {p}; shipped presets (loadable by bare name from anywhere): "
                              f"{', '.join(preset_names())}")
        p = preset or p
    data = _resolve_imports(p)
    return to_config(data, source=str(p))
