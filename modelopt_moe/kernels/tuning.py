"""Launch options of the grouped weight fake-quant kernel: the shipped defaults and a hook to override them.

Every option gives the same bits (the kernel tests check each); they trade registers, masks and instruction choices
for speed. The defaults were chosen with ``tools/tune_weight_kernel.py`` on an H200 (docs/benchmarks.md), which
compares variants through :func:`set_weight_kernel_config`. The rounding options (``hw_cvt``, ``lean``,
``fast_max``) apply to the token kernels as well.

Example::

    from modelopt_moe.kernels import tuning

    tuning.set_weight_kernel_config(tile=8192, warps=8)  # every format
    tuning.set_weight_kernel_config("int4", tile=2048)  # INT4 only (replaces the "*" options for it)
    tuning.reset_weight_kernel_config()  # the shipped defaults again
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ..numerics import get_format
from .launch import NUM_WARPS, TILE_ELEMS

__all__ = ["WEIGHT_KERNEL_DEFAULTS", "set_weight_kernel_config", "reset_weight_kernel_config",
           "weight_kernel_config"]

WEIGHT_KERNEL_DEFAULTS: Mapping[str, object] = MappingProxyType({
    "tile": TILE_ELEMS,  # elements per program
    "warps": NUM_WARPS,
    "uniform": True,  # experts of one shape: expert = tile // tiles_per_expert instead of a table search
    "even": True,  # with uniform, and every tile full: no masks
    "hw_cvt": True,  # GPU: fp8 rounding (and NVFP4's e4m3 block scale) by the hardware converter
    "lean": True,  # drop the upper exponent clamp that saturation makes redundant
    "fast_max": True,  # GPU: NVFP4 block max by the NaN-ignoring hardware max
})
_INT_OPTIONS = ("tile", "warps")

_overrides: dict[str, dict] = {}  # format (or "*") -> options set through set_weight_kernel_config
_effective: dict[str, Mapping[str, object]] = {}  # format -> merged options, rebuilt after every change


def set_weight_kernel_config(fmt: str = "*", **options) -> None:
    """Overrides launch options of the grouped weight fake-quant kernel (same bits, another speed).

    Args:
        fmt: a format name (``"e4m3"``, ``"int4"``, ...) or ``"*"`` for every format without options of its own.
            A format's options replace the ``"*"`` ones for it; either replaces what the same ``fmt`` set before.
        **options: keys of :data:`WEIGHT_KERNEL_DEFAULTS`: ``tile`` (elements per program) and ``warps`` (powers
            of two), ``uniform``, ``even``, ``hw_cvt``, ``lean``, ``fast_max`` (bools). Keys left out keep their
            defaults.

    Raises:
        ValueError: on an unknown format or option, or a value of the wrong type.
    """
    if fmt != "*":
        get_format(fmt)  # ValueError on an unknown format
    for key, value in options.items():
        if key not in WEIGHT_KERNEL_DEFAULTS:
            raise ValueError(f"set_weight_kernel_config: unknown option {key!r}; expected one of "
                             f"{sorted(WEIGHT_KERNEL_DEFAULTS)}")
        if key in _INT_OPTIONS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"set_weight_kernel_config: {key} must be a power of two, got {value!r}")
        elif not isinstance(value, bool):
            raise ValueError(f"set_weight_kernel_config: {key} must be a bool, got {value!r}")
    _overrides[fmt] = dict(options)
    _effective.clear()


def reset_weight_kernel_config() -> None:
    """Drops every override of :func:`set_weight_kernel_config`: the shipped defaults again."""
    _overrides.clear()
    _effective.clear()


def weight_kernel_config(fmt: str) -> Mapping[str, object]:
    """The launch options in force for format ``fmt``: defaults, the format's own (its ``KernelSpec.tile``), then the
    overrides (the format's own, else ``"*"``'s). Read-only."""
    cfg = _effective.get(fmt)
    if cfg is None:
        # A format's own default tile (its KernelSpec; NVFP4: fewer registers per program for the block scales).
        tile = get_format(fmt).kernel.tile
        merged = {**WEIGHT_KERNEL_DEFAULTS, **({"tile": tile} if tile is not None else {})}
        merged.update(_overrides.get(fmt, _overrides.get("*", {})))
        cfg = _effective[fmt] = MappingProxyType(merged)
    return cfg
