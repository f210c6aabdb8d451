"""tools/bench_qat_recovery.py runs (its short CPU variant: 4 gloo ranks, a few steps) and reports every run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from limits import seconds  # noqa: E402

pytestmark = pytest.mark.slow  # runs the tool: processes and training

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_quick_variant_reports_every_run(tmp_path):
    out = tmp_path / "result.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--quick",
                          "--set", "amax_updates=static,dynamic", "--json", str(out)],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    for row in ("bf16-continued", "nvfp4/static/ptq", "nvfp4/static/qat", "nvfp4/dynamic/qad"):
        assert row in res.stdout, res.stdout
    result = json.loads(out.read_text())
    assert result["config"]["amax_updates"] == ["static", "dynamic"]
    assert all(r["kl"] >= 0 and r["loss"] > 0 for k, r in result.items() if "/" in k)


def test_unknown_override_is_an_error():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--set", "stepz=3"],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode != 0
    assert "unknown key 'stepz'" in res.stderr


def test_cpu_quick_study_reports_every_variant(tmp_path):
    out = tmp_path / "study.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--study", "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result.get("partial")
    assert not result["skipped"]
    assert sorted(result["ptq"]) == ["fp8", "nvfp4"]
    for spec, r in result["variants"].items():
        assert "error" not in r, (spec, r)
        assert spec in res.stdout
        assert len(r["kl"]) == len(r["loss"]) == result["config"]["eval_batches"]
        assert r["kl_vs_ptq"] > 0
        assert len(r["curve"]) == len(result["checkpoints"])
    # the former recipe trains every group; the default only the experts
    assert set(result["variants"]["nvfp4/qad"]["grads"]) == {"experts"}
    former = "nvfp4/qad:train=all,lr=1e-4,lr_decay_style=constant,warmup_fraction=0"
    assert {"experts", "router", "dense"} <= set(result["variants"][former]["grads"])


def test_study_refuses_a_bad_variant_before_training():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--study",
                          "--variants", "nvfp4/qad:lr=1e-4,train=experts+routers"],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode != 0, res.stderr[-2000:]
    assert "unknown parameter group 'routers'" in res.stderr, res.stderr[-2000:]
