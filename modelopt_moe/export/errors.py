"""Errors of the Hugging Face export and import."""

from __future__ import annotations

__all__ = ["ExportError"]


class ExportError(ValueError):
    """An export or import that cannot be done as asked: an unsupported model family or feature, a model that is not
    quantized, a quantization the chosen format cannot express, an output directory that is not empty, a checkpoint
    that does not fit the model. The message names the module, tensor, file or key, the value and what was expected.
    Raised before anything is written."""
