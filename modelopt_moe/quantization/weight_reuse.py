"""When fake-quantized weights may be reused instead of re-quantized: only inside a declared scope.

By default every forward fake-quantizes the weights it uses from their current values, so a forward can never see
stale weights, however the weights were updated (Megatron's optimizers write parameters through ``.data`` and
contiguous parameter buffers without bumping ``Tensor._version``, so no version check can prove freshness).

Inside ``with reuse_quantized_weights(model):`` the caller promises that the weights of ``model`` do not change
(the micro-batches of one optimizer step: Megatron's ``forward_backward_func`` call, for which
``modelopt_moe.plugins.megatron.get_forward_backward_func`` opens this scope by itself). A module then
fake-quantizes its weights on its first forward in the scope and reuses the result on later forwards, as long as
the weight tensors, their version counters, the amax and the format are also unchanged (in-place updates inside a
scope, a checkpoint load or a recalibration are still seen). Leaving the scope drops every cached value, so outside a
scope no fake-quantized copy of a weight outlives the GEMMs that use it.

Not used while ``torch.compile`` traces or a CUDA graph is captured (a replay runs no host code, so it must
recompute from the current weights).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Hashable, Iterator

import torch
from torch import nn

from .step_scope import StepScopes

__all__ = ["reuse_quantized_weights", "reused_or_computed", "weight_key", "active_reuse_scopes", "in_reuse_scope"]

_version_of = operator.attrgetter("_version")


class _Scope:
    """One ``reuse_quantized_weights`` block: the modules it covers and their cached values."""

    def __init__(self, models: list[nn.Module]):
        self.module_ids = {id(m) for model in models for m in model.modules()}
        self.entries: dict[int, tuple[Hashable, object]] = {}


_SCOPES: StepScopes[_Scope] = StepScopes()


def active_reuse_scopes() -> int:
    """How many reuse scopes are open (for tests and diagnostics)."""
    return len(_SCOPES)


@contextlib.contextmanager
def reuse_quantized_weights(model: nn.Module | list[nn.Module] | tuple) -> Iterator[None]:
    """Reuse each module's fake-quantized weights across the forwards inside this block.

    Use it around the micro-batches of one optimizer step, when nothing changes the weights in between::

        with mtq.reuse_quantized_weights(model):
            for micro_batch in micro_batches:
                loss_fn(model(micro_batch)).backward()
        optimizer.step()        # outside: the next forward re-quantizes

    Args:
        model: a quantized model or a list of model chunks (wrappers such as Megatron's DDP are fine).
    """
    models = list(model) if isinstance(model, list | tuple) else [model]
    scope = _Scope(models)
    try:
        with _SCOPES.opened(scope):
            yield
    finally:
        scope.entries.clear()  # after the scope closed: no forward finds it any more


def in_reuse_scope(module: nn.Module) -> bool:
    """Whether an open :func:`reuse_quantized_weights` block covers ``module``."""
    return _SCOPES.covering(module) is not None


def weight_key(weights: list[torch.Tensor], amax: torch.Tensor | None, *settings: Hashable) -> tuple:
    """What must be unchanged for fake-quantized weights to still be those of ``weights``: each weight's identity,
    storage and version, the amax's, the settings (read with ``map`` over C accessors: no Python work per expert)."""
    wkey = tuple(map(id, weights)), tuple(map(torch.Tensor.data_ptr, weights)), tuple(map(_version_of, weights))
    akey = None if amax is None else (id(amax), amax.data_ptr(), amax._version)
    return wkey, akey, settings


def reused_or_computed(module: nn.Module, key: Callable[[], Hashable], compute: Callable[[], object]) -> object:
    """``compute()``, or inside a reuse scope covering ``module`` the value stored under an equal ``key()``."""
    if torch.compiler.is_compiling():
        return compute()
    scope = _SCOPES.covering(module)
    if scope is None:
        return compute()
    k = key()
    entry = scope.entries.get(id(module))
    if entry is not None and entry[0] == k:
        return entry[1]
    value = compute()
    scope.entries[id(module)] = (k, value)
    return value
