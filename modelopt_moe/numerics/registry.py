"""The registry of number formats: every format object, registered once, and the two ways to look one up (by name,
and by Model Optimizer's ``num_bits``). Adding a format is its home module and one entry in :data:`FORMATS`."""

from __future__ import annotations

from .format import Format
from .fp8 import E4M3, E5M2
from .integer import INT_FORMATS
from .nvfp4 import NVFP4

__all__ = ["FORMATS", "get_format", "format_from_num_bits"]

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2, NVFP4, *INT_FORMATS)}

# Float formats in registry order, then the int widths from the widest down (the order of the error message).
_LOOKUP_ORDER = [f for f in FORMATS.values() if not f.integer] + sorted(
    (f for f in FORMATS.values() if f.integer), key=lambda f: f.name, reverse=True)
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
