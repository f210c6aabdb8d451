"""tools/cold_expert_calibration.py on the QAD study's 64-expert model (trained a few steps with ``--quick``): it
prints a row per calibration over all 256 expert inputs, and a ratio of 1.0 leaves no expert input without a token."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from limits import seconds  # noqa: E402

pytestmark = pytest.mark.slow  # runs the tool: a process and training

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "cold_expert_calibration.py")


def test_quick_run_on_the_trained_64_expert_model_prints_every_calibration():
    res = subprocess.run([sys.executable, TOOL, "--model", "moe64", "--quick"], capture_output=True, text=True,
                         timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "64 experts top-8" in res.stdout, res.stdout
    assert "median relative amax error, cold inputs" in res.stdout
    rows = {m[0]: int(m[1]) for m in re.findall(r"^\| (.+?) \| (\d+) of 256 \|", res.stdout, re.M)}
    assert list(rows) == ["short (1 x 64 tokens), model's routing", "short (1 x 64 tokens), ratio 0.25 (16 of 64 "
                          "experts)", "short (1 x 64 tokens), ratio 0.5 (32 of 64 experts)",
                          "short (1 x 64 tokens), ratio 1.0 (64 of 64 experts)", "long, ratio 1.0"], res.stdout
    assert rows["short (1 x 64 tokens), model's routing"] > 0  # the router favours some experts from the start
    assert rows["short (1 x 64 tokens), ratio 1.0 (64 of 64 experts)"] == rows["long, ratio 1.0"] == 0


def test_bad_options_are_refused_before_training():
    for args, message in [(["--quick"], "--quick needs --model moe64"),
                          (["--model", "moe64", "--long-batches", "0"], "--long-batches 0: expected a positive"),
                          (["--model", "moe64", "--short-seqs", "9"], "--short-seqs 9: expected 1 to 8")]:
        res = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=seconds(60))
        assert res.returncode != 0
        assert message in res.stderr, res.stderr
