"""Framework plugins, installed as ``modelopt_moe.plugins``: the only place that imports megatron.core or
transformer_engine.

Importing this package imports no framework. :func:`register_imported` is what the core calls
(``modelopt_moe.quantization.conversion.register_framework_plugins``, made by ``mtq.quantize``, every restore and the
Hugging Face export), found through the package's entry point (group ``modelopt_moe.plugins`` in pyproject.toml), so
the core never imports this package: for every plugin whose frameworks the program has imported, and every plugin
the caller requires by name, it imports the plugin and calls its ``register()``, which adds the plugin's quantized
classes, parallel groups and export adapter to the core's registries.

:func:`quiet_known_warnings` hides the known harmless messages of Megatron, torch.distributed and transformers (the
list, each with why: :mod:`.known_warnings`), as the ``modelopt-moe`` commands do.
"""

import importlib
import sys

from .known_warnings import quiet_known_warnings

__all__ = ["register_imported", "quiet_known_warnings"]

# plugin module -> the framework modules that must all be imported for it to apply
_PLUGINS = {
    "megatron": ("megatron.core",),
    "transformer_engine": ("transformer_engine.pytorch",),
    "megatron.te_experts": ("megatron.core", "transformer_engine.pytorch"),  # Megatron's TE grouped linears
    "megatron.te_linears": ("megatron.core", "transformer_engine.pytorch"),  # Megatron's TE dense linears
}
_registered: set[str] = set()


def register_imported(require: str | tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Registers every plugin whose frameworks are imported, and every plugin in ``require`` (importing its
    framework), once each; returns the names registered so far.

    Raises:
        ValueError: ``require`` names an unknown plugin.
        ImportError: a required plugin's framework cannot be imported (the message names the plugin).
    """
    required = {require} if isinstance(require, str) else set(require or ())
    unknown = sorted(required - set(_PLUGINS))
    if unknown:
        raise ValueError(f"unknown plugin(s) {unknown}; expected one of {sorted(_PLUGINS)}")
    for plugin, frameworks in _PLUGINS.items():
        if plugin in _registered:
            continue
        if plugin in required or all(f in sys.modules for f in frameworks):
            try:
                module = importlib.import_module(f"{__name__}.{plugin}")
            except ImportError as e:
                raise ImportError(f"plugin {plugin!r} needs {' and '.join(frameworks)}: {e}") from e
            module.register()
            _registered.add(plugin)
    return sorted(_registered)
