"""tools/bench_qat_recovery.py runs (its short CPU variant: 4 gloo ranks, a few steps) and reports every run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_cpu_quick_variant_reports_every_run(tmp_path):
    out = tmp_path / "result.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--quick",
                          "--set", "amax_updates=static,dynamic", "--json", str(out)],
                         capture_output=True, text=True, timeout=550)
    assert res.returncode == 0, res.stderr[-3000:]
    for row in ("bf16-continued", "nvfp4/static/ptq", "nvfp4/static/qat", "nvfp4/dynamic/qad"):
        assert row in res.stdout, res.stdout
    result = json.loads(out.read_text())
    assert result["config"]["amax_updates"] == ["static", "dynamic"]
    assert all(r["kl"] >= 0 and r["loss"] > 0 for k, r in result.items() if "/" in k)


def test_unknown_override_is_an_error():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--set", "stepz=3"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "unknown key 'stepz'" in res.stderr
