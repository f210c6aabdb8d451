"""Which experts calibrated their input amax on few tokens: named by global expert index at export, written beside
the checkpoint, and reported per layer by the checker.

An expert that few calibration tokens reached has an input scale from little data (and one no token reached, the
layer's shared input amax): engines serve it with that scale. :func:`warn_cold_experts` names them, once on rank 0,
from the token counts calibration keeps (:mod:`modelopt_moe.quantization.calib.tokens`). The export writes the counts
into the checkpoint as :data:`CALIBRATION_TOKENS_FILE` (:func:`calibration_tokens_json`), by the Hugging Face name of
each expert linear, with the threshold it warned at; :func:`read_calibration_tokens` reads them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from ..quantization.calib.tokens import expert_token_counts
from ..quantization.utils import is_rank0, warn_once
from .errors import ExportError

__all__ = ["DEFAULT_MIN_CALIB_TOKENS", "CALIBRATION_TOKENS_FILE", "warn_cold_experts", "calibration_tokens_json",
           "read_calibration_tokens"]

# Fewer calibration tokens than this make an expert's input amax a guess from a handful of activations.
DEFAULT_MIN_CALIB_TOKENS = 32
CALIBRATION_TOKENS_FILE = "calibration_tokens.json"


def warn_cold_experts(model: nn.Module, min_tokens: int,
                      counts: dict[str, dict[int, int]] | None = None) -> dict[str, dict[int, int]]:
    """Warns once on rank 0 naming every expert (global index, with its token count) whose input quantizer
    calibrated on fewer than ``min_tokens`` tokens; returns them. ``counts``: :func:`expert_token_counts` of the
    model, when the caller has them; otherwise every rank calls it (a collective)."""
    counts = expert_token_counts(model) if counts is None else counts
    cold = {name: {g: c for g, c in sorted(cells.items()) if c < min_tokens} for name, cells in counts.items()}
    cold = {name: cells for name, cells in cold.items() if cells}
    if cold and is_rank0():
        lines = [f"{name}: experts {cells}" for name, cells in cold.items()]
        warn_once(f"export_hf: these experts calibrated their input amax on fewer than {min_tokens} tokens "
                  "(global expert: tokens; 0: the layer's shared input amax), so their input scales rest on little "
                  "data; calibrate with more data or algorithm.moe_calib_experts_ratio:\n  " + "\n  ".join(lines))
    return cold


def calibration_tokens_json(tokens: dict[str, int], min_tokens: int, producer: dict) -> dict:
    """The payload of :data:`CALIBRATION_TOKENS_FILE`: ``{"producer", "min_tokens", "experts": {Hugging Face expert
    linear: calibration tokens of its input}}``."""
    return {"producer": dict(producer), "min_tokens": int(min_tokens),
            "experts": {name: int(n) for name, n in sorted(tokens.items())}}


def read_calibration_tokens(path: str | os.PathLike) -> tuple[dict[str, int], int] | None:
    """The per-expert-linear token counts and the threshold of a checkpoint's :data:`CALIBRATION_TOKENS_FILE`
    (None: the checkpoint has none).

    Raises:
        ExportError: the file is not the JSON this module writes (names the file and what was expected).
    """
    file = Path(path) / CALIBRATION_TOKENS_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
        tokens = {str(k): int(v) for k, v in data["experts"].items()}
        return tokens, int(data["min_tokens"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{file}: expected {{'min_tokens': int, 'experts': {{expert linear: int}}}} "
                          f"({type(e).__name__}: {e})") from None
