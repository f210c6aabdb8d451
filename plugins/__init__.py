"""Framework plugins, installed as ``modelopt_moe.plugins``: the only place that imports megatron.core or
transformer_engine.

Importing this package imports no framework. :func:`register_imported` is the one entry point the core calls
(``modelopt_moe.quantization.conversion.register_framework_plugins``, made by ``mtq.quantize`` and every restore):
for every plugin whose frameworks the program has imported, it imports the plugin and calls its ``register()``,
which adds the plugin's quantized classes (and parallel groups) to the core's registries.
"""

import importlib
import sys

# plugin module -> the framework modules that must all be imported for it to apply
_PLUGINS = {
    "megatron": ("megatron.core",),
    "transformer_engine": ("transformer_engine.pytorch",),
    "megatron.te_experts": ("megatron.core", "transformer_engine.pytorch"),  # Megatron's TE grouped linears
}
_registered: set[str] = set()


def register_imported() -> list[str]:
    """Registers every plugin whose frameworks are imported (once each); returns the names registered so far."""
    for plugin, frameworks in _PLUGINS.items():
        if plugin not in _registered and all(f in sys.modules for f in frameworks):
            importlib.import_module(f"{__name__}.{plugin}").register()
            _registered.add(plugin)
    return sorted(_registered)
