"""A quantizer's mode: what its forward does, derived once from its inputs rather than re-decided at every call.

The inputs are the quantizer's switches (enabled, calibrating, quantizing), its config (a dynamic amax, an amax at
all), whether it holds an amax, and how its amax follows the weights while training (``weight_amax_update``). The
quantizer recomputes its mode where one of them changes (:meth:`TensorQuantizer._update_mode`); forwards dispatch on
it.
"""

from __future__ import annotations

import enum

__all__ = ["QuantMode", "derive_mode"]


class QuantMode(enum.Enum):
    """What a quantizer's forward does.

    * ``OFF``: passes its input through (disabled, or neither calibrating nor quantizing).
    * ``CALIBRATING``: collects the amax (and fake-quantizes when quantization is on too).
    * ``DYNAMIC``: fake-quantizes with the amax of each tensor it gets (``type: dynamic``, per token); stores none.
    * ``UNCALIBRATED``: fake-quantizes with no amax yet, so with the amax of the current tensors (warned once).
    * ``STATIC``: fake-quantizes with its stored amax (or none: int formats with dynamic block scales).
    * ``REFRESHED``: ``weight_amax_update: dynamic``: recomputes the amax from the current weights at each
      quantization, stores it, and fake-quantizes with it.
    * ``LEARNED``: ``weight_amax_update: learned``: fake-quantizes with the amax parameter, which gets a gradient.
    """

    OFF = "off"
    CALIBRATING = "calibrating"
    DYNAMIC = "dynamic"
    UNCALIBRATED = "uncalibrated"
    STATIC = "static"
    REFRESHED = "refreshed"
    LEARNED = "learned"

    @property
    def settled(self) -> bool:
        """The amax of a call is known before it (stored, refreshed from the weights, learned, or not needed), so
        every expert of the call goes through one kernel launch; the other modes work tensor by tensor."""
        return self in (QuantMode.STATIC, QuantMode.REFRESHED, QuantMode.LEARNED)


def derive_mode(*, enabled: bool, if_calib: bool, if_quant: bool, dynamic: bool, needs_amax: bool, has_amax: bool,
                amax_update: str, learns_amax: bool) -> QuantMode:
    """The mode of a quantizer with these inputs (a ``dynamic`` amax wins over an amax update: it has nothing to
    store, refresh or learn)."""
    if not enabled:
        return QuantMode.OFF
    if if_calib:
        return QuantMode.CALIBRATING
    if not if_quant:
        return QuantMode.OFF
    if dynamic:
        return QuantMode.DYNAMIC
    if not needs_amax:
        return QuantMode.STATIC
    if amax_update == "dynamic":
        return QuantMode.REFRESHED
    if not has_amax:
        return QuantMode.UNCALIBRATED
    if amax_update == "learned" and learns_amax:
        return QuantMode.LEARNED
    return QuantMode.STATIC
