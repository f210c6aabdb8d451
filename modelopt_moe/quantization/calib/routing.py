"""Wider routing while calibrating (Model Optimizer's ``moe_calib_experts_ratio``): each calibration token also
reaches ``max(top_k, round(ratio * num_experts))`` experts, so that experts the router seldom picks still calibrate
their input amaxes, while the model's outputs (what the next layers see) come from its own top-k.

The core knows no MoE layer: frameworks register a *router widener* (the Megatron plugin does,
:func:`register_router_widener`), a function ``widener(model, ratio)`` returning a context manager inside which every
MoE layer of ``model`` runs so, and whose ``__enter__`` returns how many layers it widened. A layer then calibrates
on its widened forward only (its quantizers' calibration paused for the forward whose output it returns), so each
expert's token count is the number of tokens the widened routing sent it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn

from ..utils import warn_once

__all__ = ["register_router_widener", "widened_routing"]

_WIDENERS: list[Callable[[nn.Module, float], contextlib.AbstractContextManager]] = []


def register_router_widener(fn: Callable[[nn.Module, float], contextlib.AbstractContextManager]) -> None:
    """Registers ``fn(model, ratio) -> context manager`` (frameworks' MoE layers; plugins do this)."""
    if fn not in _WIDENERS:
        _WIDENERS.append(fn)


@contextlib.contextmanager
def widened_routing(model: nn.Module, ratio: float | None):
    """Inside: every registered framework's MoE layers in ``model`` route calibration tokens to
    ``max(top_k, round(ratio * num_experts))`` experts (nothing changes when ``ratio`` is None). Warns once on rank 0
    when a ratio widens no layer."""
    with contextlib.ExitStack() as stack:
        if ratio is not None:
            widened = sum(stack.enter_context(fn(model, ratio)) for fn in _WIDENERS)
            if widened == 0:
                warn_once(f"calibrate: moe_calib_experts_ratio={ratio} widens no MoE layer of this model (none with a "
                          "registered router, or each routes to at least ratio * experts already); calibration "
                          "routes tokens as the model does")
        yield
