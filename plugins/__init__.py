"""Framework plugins, installed as ``modelopt_moe.plugins``: the only place that imports megatron.core or
transformer_engine. Importing this package imports no framework; each submodule guards its own imports."""

import importlib
import importlib.util

# plugin module -> the framework it needs (imported only if that framework is installed)
_PLUGINS = {"megatron": "megatron.core", "transformer_engine": "transformer_engine.pytorch"}


def load_available() -> list[str]:
    """Imports (and so registers) every plugin whose framework is installed; returns their names."""
    loaded = []
    for plugin, framework in _PLUGINS.items():
        try:
            found = importlib.util.find_spec(framework.split(".")[0]) is not None
        except (ImportError, ValueError):
            found = False
        if not found or importlib.util.find_spec(f"{__name__}.{plugin}") is None:
            continue
        importlib.import_module(f"{__name__}.{plugin}")
        loaded.append(plugin)
    return loaded
