"""The user-facing verbs: ``quantize``, ``calibrate``, ``print_quant_summary``, ``enable/disable_quantizer``,
``fold_weight``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .calibration import calibrate
from .config import QuantizeConfig, to_config
from .conversion import convert, is_quantized, named_quantizers, set_quantizer_by_pattern
from .utils import is_rank0
from .weight_amax import update_weight_amax

__all__ = ["quantize", "calibrate", "print_quant_summary", "enable_quantizer", "disable_quantizer", "fold_weight"]


def quantize(model: nn.Module, config: QuantizeConfig | dict, forward_loop: Callable | None = None) -> nn.Module:
    """Converts ``model`` in place to fake-quantized modules per ``config`` and max-calibrates it.

    Args:
        model: any model whose layers have registered quantized wrappers (``nn.Linear``, grouped expert linears;
            Megatron-Core and Transformer Engine layers when the program has imported those frameworks).
        config: a :class:`QuantizeConfig`, a dict of the same shape, a preset such as ``mtq.FP8_DEFAULT_CFG``, or
            ``mtq.load_config("file.yaml")``.
        forward_loop: ``forward_loop(model)`` feeds calibration data; without it only weights are calibrated.

    Returns:
        ``model`` (the same object).

    Raises:
        ConfigError: an invalid config. ValueError: nothing quantizable.
    """
    cfg = to_config(config)
    convert(model, cfg)
    return calibrate(model, cfg.algorithm, forward_loop)


def enable_quantizer(model: nn.Module, pattern: str) -> int:
    """Enables quantizers whose full name matches the wildcard ``pattern``; returns the count."""
    return set_quantizer_by_pattern(model, pattern, True)


def disable_quantizer(model: nn.Module, pattern: str) -> int:
    """Disables quantizers whose full name matches the wildcard ``pattern``; returns the count."""
    return set_quantizer_by_pattern(model, pattern, False)


def fold_weight(model: nn.Module) -> nn.Module:
    """Writes each fake-quantized weight into the weight and disables its weight quantizer (for export). Dynamic
    weight amaxes are recomputed from the current weights first (every rank must call it then)."""
    update_weight_amax(model)
    for module in model.modules():
        if is_quantized(module):
            module.fold_weight()
    return model


def print_quant_summary(model: nn.Module, file=None) -> str:
    """Prints (rank 0) and returns one line per quantizer and a count of enabled ones."""
    lines = []
    enabled = 0
    for name, q, _ in named_quantizers(model):
        enabled += q.is_enabled
        lines.append(f"{name:<80} {q.extra_repr()}")
    lines.append(f"{enabled} of {len(lines)} quantizers enabled")
    text = "\n".join(lines)
    if is_rank0():
        print(text, file=file, flush=True)
    return text
