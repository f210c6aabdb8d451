"""The registered calibration algorithms, by the name ``algorithm`` / ``{"method": ...}`` selects them with.

Adding an algorithm: its options (a :class:`~..config_schema.MaxCalibConfig` subclass, named in
``config_schema.CALIBRATION_OPTIONS``), a :class:`~.calibrator.Calibrator` subclass in its own file, and one line
here.
"""

from __future__ import annotations

from .calibrator import Calibrator
from .histogram import HistogramCalibrator
from .max import MaxCalibrator
from .mse import MseCalibrator

__all__ = ["CALIBRATORS", "calibrator_class"]

CALIBRATORS: dict[str, type[Calibrator]] = {
    MaxCalibrator.name: MaxCalibrator,
    MseCalibrator.name: MseCalibrator,
    HistogramCalibrator.name: HistogramCalibrator,
}


def calibrator_class(method: str) -> type[Calibrator] | None:
    """The calibrator registered as ``method``, or None."""
    return CALIBRATORS.get(method)
