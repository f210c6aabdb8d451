"""tools/bench_megatron_step.py runs a whole Megatron training step of every variant and mode and reports each one.

A tiny smoke configuration on CPU (its own process: world size 1, gloo, the project's CPU shims and grouped experts
in Megatron's local spec instead of Transformer Engine). Not a timing test: only the table's structure is checked.
"""

import argparse
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from limits import seconds  # noqa: E402

pytestmark = pytest.mark.slow  # runs the tool: processes and training

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "64", "--experts", "4", "--moe-ffn-hidden", "32", "--topk", "2", "--heads", "4",
        "--kv-heads", "2", "--seq", "32", "--vocab", "256", "--dispatcher", "allgather", "--micro-batches", "2",
        "--rounds", "2", "--steps", "1", "--warmup", "0", "--calib-batches", "1"]
OURS = ("bf16", "fp8", "nvfp4", "fp8-te_fp8")
MODES = {"re-quantize": 1, "reuse": 2}


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_tiny_cpu_run_reports_every_variant_and_mode(tmp_path):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_megatron_step.py"), *TINY, "--json", str(out)],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    for variant in OURS:
        for mode, micro_batches in MODES.items():
            assert re.search(rf"^{variant}\s+{mode} \({micro_batches} mb\)\s+\d", res.stdout, re.M), res.stdout
    if importlib.util.find_spec("modelopt") is None:
        assert "skipped modelopt-fp8, " not in res.stdout  # one line per variant, each with its reason
        assert re.search(r"^skipped modelopt-fp8: modelopt does not import", res.stdout, re.M), res.stdout
        assert re.search(r"^skipped modelopt-nvfp4: ", res.stdout, re.M), res.stdout

    rows = {(r["variant"], r["mode"]): r for r in json.loads(out.read_text())}
    assert {key for key in rows if key[0] in OURS} == {(v, m) for v in OURS for m in MODES}
    for (variant, mode), row in rows.items():
        assert row["micro_batches"] == MODES[mode]
        for key in ("ms", "ms_per_micro_batch", "x_bf16", "x_bf16_min", "x_bf16_max"):
            assert _positive(row[key]), (variant, mode, key, row[key])
        assert row["x_bf16_min"] <= row["x_bf16"] <= row["x_bf16_max"]
        assert row["ms_per_micro_batch"] == pytest.approx(row["ms"] / MODES[mode])
        assert row["peak_mib"] is None  # CUDA memory statistics only
    assert rows["bf16", "reuse"]["x_bf16"] == 1.0


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_megatron_step", ROOT / "tools" / "bench_megatron_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_residency_parks_only_what_does_not_fit_and_reversed_rounds_reuse_the_residents():
    """Three variants, room for two: building the third parks the first; after that each round moves one variant
    (the reversed order lets the two still resident go first). Moves are recorded instead of done (no GPU here)."""
    tool = _load_tool()
    moves = []

    class Recorded(tool.Residency):
        def _park(self, variant):
            moves.append(("park", variant.name))

        def _unpark(self, variant):
            moves.append(("unpark", variant.name))

    residency = Recorded(limit=2)
    variants = []
    for name in ("a", "b", "c"):
        residency.make_room()
        variants.append(tool.Variant(name, trainer=None, weight_quantizers=0))
        residency.resident.append(variants[-1])
    assert moves == [("park", "a")]
    times = tool.time_rounds(variants, _NoSteps(), argparse.Namespace(rounds=3, warmup=1, steps=1), residency)
    assert moves[1:] == [("park", "c"), ("unpark", "a"), ("park", "a"), ("unpark", "c"), ("park", "c"),
                         ("unpark", "a")]
    assert {key: len(ms) for key, ms in times.items()} == {(n, m): 3 for n in "abc" for m in MODES}


class _NoSteps:
    """Stands in for the tool's ``Steps``: every mode's step does nothing."""

    modes = MODES

    def __call__(self, variant, mode):
        return lambda: None
