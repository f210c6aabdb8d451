"""Framework adapters of the Hugging Face export, registered by plugins (like the quantized-module registry).

The core never imports a framework. A plugin's ``register()`` (called by
:func:`modelopt_moe.quantization.conversion.register_framework_plugins`, the core's one registration call) adds its
adapter with :func:`register_export_adapter`; :func:`adapter_for` finds the adapter of a model, :func:`adapter_named`
the adapter of a framework, importing its plugin on request (``register_framework_plugins(require=name)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import nn

from .errors import ExportError

__all__ = ["ExportAdapter", "register_export_adapter", "adapter_for", "adapter_named", "registered_adapters"]


@runtime_checkable
class ExportAdapter(Protocol):
    """What a framework plugin provides for Hugging Face export and import.

    Attributes:
        name: the plugin name (``"megatron"``), the one ``register_framework_plugins(require=...)`` takes.
    """

    name: str

    def owns(self, model: nn.Module) -> bool:
        """Whether ``model`` (possibly wrapped) is this framework's."""

    def export_hf(self, model: nn.Module, out_dir: str | os.PathLike, *, format: str, family: str | None,
                  **options) -> Path:
        """Writes ``model`` as a Hugging Face checkpoint (every rank calls it)."""

    def import_hf(self, model: nn.Module, hf_dir: str | os.PathLike) -> None:
        """Loads a Hugging Face checkpoint's weights into the already built ``model``."""

    def build_model(self, hf_dir_or_config, *, spec: str, **overrides) -> nn.Module:
        """Builds the framework's model matching a Hugging Face config."""


_ADAPTERS: dict[str, ExportAdapter] = {}


def register_export_adapter(adapter: ExportAdapter) -> None:
    """Adds (or replaces) the adapter of framework ``adapter.name``.

    Raises:
        TypeError: ``adapter`` lacks a method of :class:`ExportAdapter`.
    """
    if not isinstance(adapter, ExportAdapter):
        raise TypeError(f"{type(adapter).__name__} is not an ExportAdapter (needs name, owns, export_hf, import_hf, "
                        "build_model)")
    _ADAPTERS[adapter.name] = adapter


def registered_adapters() -> list[str]:
    """The framework names with a registered export adapter, sorted."""
    return sorted(_ADAPTERS)


def adapter_for(model: nn.Module) -> ExportAdapter:
    """The adapter that owns ``model`` (registering the plugins of every imported framework first).

    Raises:
        ExportError: no registered adapter owns the model (names its class and the registered adapters).
    """
    from ..quantization.conversion import register_framework_plugins

    register_framework_plugins()
    for adapter in _ADAPTERS.values():
        if adapter.owns(model):
            return adapter
    raise ExportError(f"no export adapter for a {type(model).__name__} (registered: {registered_adapters()}); "
                      "Hugging Face export and import support Megatron-Core GPT models (import megatron.core first)")


def adapter_named(name: str) -> ExportAdapter:
    """The adapter of framework ``name``, importing and registering its plugin if needed.

    Raises:
        ExportError: the plugin does not exist, its framework cannot be imported, or it has no export adapter.
    """
    from ..quantization.conversion import register_framework_plugins

    if name not in _ADAPTERS:
        try:
            register_framework_plugins(require=name)
        except (ImportError, ValueError) as e:
            raise ExportError(f"cannot load the {name!r} plugin: {e}") from e
    if name not in _ADAPTERS:
        raise ExportError(f"plugin {name!r} registers no export adapter (registered: {registered_adapters()})")
    return _ADAPTERS[name]
