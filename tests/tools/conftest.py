"""Tests of ``tools/``: the tools' own modules (``qat_recovery``, ``qad_study``, ``bench_megatron_step``, ...) import
by name, as they do when a tool runs, and so do the ranks that ``modelopt_moe.launch.spawn`` starts (they inherit
``sys.path``)."""

import sys
from pathlib import Path

TOOLS = str(Path(__file__).resolve().parents[2] / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
