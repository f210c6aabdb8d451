"""Framework plugins, installed as ``modelopt_moe.plugins``: the only place that imports megatron.core or
transformer_engine. Importing this package imports no framework; each submodule guards its own imports."""

import importlib
import importlib.util
import sys

# plugin module -> the framework module it needs
_PLUGINS = {"megatron": "megatron.core", "transformer_engine": "transformer_engine.pytorch"}


def load_imported() -> list[str]:
    """Imports (and so registers) the plugin of every framework the program has imported; returns their names.

    Called by ``convert`` (``mtq.quantize``, checkpoint restore): a model built with a framework means that framework
    is imported, so importing ``modelopt_moe.quantization`` itself never pulls in Megatron or Transformer Engine.
    """
    loaded = []
    for plugin, framework in _PLUGINS.items():
        if framework in sys.modules and importlib.util.find_spec(f"{__name__}.{plugin}") is not None:
            importlib.import_module(f"{__name__}.{plugin}")
            loaded.append(plugin)
    return loaded
