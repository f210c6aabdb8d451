"""The registry of number formats: every format object, registered once, and the ways to look one up (by name, by
Model Optimizer's ``num_bits``, and by ``num_bits`` with the block scales' ``scale_bits``, which select the MX formats).
Adding a format is its home module and one entry in :data:`FORMATS`."""

from __future__ import annotations

from .format import Format
from .fp8 import E4M3, E5M2
from .integer import INT_FORMATS
from .mx import MX_FORMATS
from .nvfp4 import NVFP4, NVFP4_FOUR_OVER_SIX

__all__ = ["FORMATS", "get_format", "format_from_num_bits", "format_of", "scale_bits_tuple"]

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2, NVFP4, NVFP4_FOUR_OVER_SIX, *INT_FORMATS, *MX_FORMATS)}

# Float formats in registry order, then the int widths from the widest down (the order of the error message). Formats
# selected by their scale_bits are found by format_of only: num_bits alone keeps naming the others.
_LOOKUP_ORDER = [f for f in FORMATS.values() if not f.integer and f.scale_bits is None
                 and f is not NVFP4_FOUR_OVER_SIX] + sorted(
    (f for f in FORMATS.values() if f.integer), key=lambda f: f.name, reverse=True)
_BY_SCALE_BITS = {(f.num_bits, key): f.name for f in FORMATS.values() if f.scale_bits is not None
                  for key in (f.scale_bits, f.block_scale)}
_NUM_BITS_TO_FORMAT = {f.num_bits: f.name for f in _LOOKUP_ORDER}
_NUM_BITS_ALIASES = {alias: f.name for f in _LOOKUP_ORDER for alias in f.aliases}


def get_format(fmt: str) -> Format:
    """Returns the :class:`~.format.Format` named ``fmt``.

    Raises:
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(FORMATS)}") from None


def format_from_num_bits(num_bits: int | str | tuple | list) -> str:
    """Maps a Model-Optimizer style ``num_bits`` (``(4, 3)``, ``8``, ``"e2m1"``, ...) to a format name.

    Raises:
        ValueError: ``num_bits`` names no supported format.
    """
    if isinstance(num_bits, str):
        key = num_bits.strip().lower()
        if key in _NUM_BITS_ALIASES:
            return _NUM_BITS_ALIASES[key]
    else:
        key = tuple(num_bits) if isinstance(num_bits, list | tuple) else num_bits
        try:
            if key in _NUM_BITS_TO_FORMAT and not isinstance(key, bool):
                return _NUM_BITS_TO_FORMAT[key]
        except TypeError:  # unhashable (a nested list, a mapping): not a format either
            pass
    allowed = [*(str(k) for k in _NUM_BITS_TO_FORMAT), *(repr(k) for k in _NUM_BITS_ALIASES)]
    raise ValueError(f"unsupported num_bits {num_bits!r}; expected one of {', '.join(allowed)}")


def _scale_key(scale_bits):
    if isinstance(scale_bits, str):
        return scale_bits.strip().lower()
    return tuple(scale_bits) if isinstance(scale_bits, list) else scale_bits


def format_of(num_bits, block_sizes: dict | None = None) -> str:
    """The format a quantizer config names: its ``num_bits``, and where a format is selected by its block scales
    (E8M0 ``scale_bits: (8, 0)``: the MX formats), ``block_sizes["scale_bits"]`` too; NVFP4 with ``four_over_six``
    and block scales from the data (``type`` dynamic, NVFP4's default) is the 4-over-6 format (static 4-over-6 block
    scales stay NVFP4's: calibration chooses them once).

    Raises:
        ValueError: ``num_bits`` names no supported format.
    """
    name = format_from_num_bits(num_bits)
    if (name == NVFP4.name and isinstance(block_sizes, dict) and block_sizes.get("four_over_six") is True
            and block_sizes.get("type", "dynamic") != "static"):
        return NVFP4_FOUR_OVER_SIX.name
    scale_bits = block_sizes.get("scale_bits") if isinstance(block_sizes, dict) else None
    if scale_bits is None:
        return name
    try:
        return _BY_SCALE_BITS.get((FORMATS[name].num_bits, _scale_key(scale_bits)), name)
    except TypeError:  # unhashable scale_bits: the format's own config check names it
        return name


def scale_bits_tuple(scale_bits) -> tuple[int, int]:
    """``scale_bits`` as Model Optimizer writes it: an (E, M) tuple (``"e4m3"``: ``(4, 3)``; ``"e8m0"``: ``(8, 0)``).

    Raises:
        ValueError: ``scale_bits`` names no block-scale format.
    """
    key = _scale_key(scale_bits)
    for f in FORMATS.values():
        if f.scale_bits is not None and key in (f.scale_bits, f.block_scale):
            return f.scale_bits
    return get_format(format_from_num_bits(scale_bits)).num_bits
