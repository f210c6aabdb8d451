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


def test_cpu_quick_study_over_seeds_prints_medians_and_ranges(tmp_path):
    out = tmp_path / "seeds.json"
    learned = "nvfp4/qad:input_amax_update=learned,amax_lr_mult=100"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--study", "--quick",
                          "--seeds", "1234,4321,777", "--variants", "nvfp4/qad", learned, "--json", str(out)],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result) == ["1234", "4321", "777"]
    ratios = {spec: sorted(result[s]["variants"][spec]["kl_vs_ptq"] for s in result) for spec in ("nvfp4/qad", learned)}
    summary = res.stdout[res.stdout.index("seeds 1234, 4321, 777: median [min..max] over the seeds"):]
    for spec, (lo, mid, hi) in ratios.items():
        row = next(line for line in summary.splitlines() if line.startswith(spec + " "))
        assert f"{mid:.2f} [{lo:.2f}..{hi:.2f}]" in row, row
        assert row.split()[-1] == "3"
    assert len({tuple(result[s]["teacher"]["loss"]) for s in result}) == 3  # each seed its own teacher


def test_cpu_quick_study_of_calibrations_on_the_64_expert_model(tmp_path):
    out = tmp_path / "calib.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--study", "--quick",
                          "--model", "moe64", "--variants", "nvfp4/qad:calib=fp8_sweep", "fp8/ptq:calib=percentile",
                          "--json", str(out)], capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["config"]["num_experts"], result["config"]["topk"]) == (64, 8)
    # a start per format and calibration, max first; method ptq trains nothing
    assert list(result["ptq"]) == ["nvfp4", "nvfp4:calib=fp8_sweep", "fp8", "fp8:calib=percentile"]
    assert list(result["variants"]) == ["nvfp4/qad:calib=fp8_sweep"]
    sweep, qad = result["ptq"]["nvfp4:calib=fp8_sweep"], result["variants"]["nvfp4/qad:calib=fp8_sweep"]
    assert sweep["calibration"] == "fp8_sweep"
    assert qad["ptq_key"] == "nvfp4:calib=fp8_sweep"
    assert qad["recipe"]["weight_amax_update"] == "static"
    assert sweep["kl"] != result["ptq"]["nvfp4"]["kl"]  # another start
    assert qad["kl_vs_ptq"] == pytest.approx(sum(qad["kl"]) / sum(sweep["kl"]))
    assert qad["kl_vs_max_ptq"] == pytest.approx(sum(qad["kl"]) / sum(result["ptq"]["nvfp4"]["kl"]))
    for r in [*result["ptq"].values(), qad]:
        assert len(r["top1_flips"]) == result["config"]["eval_batches"]
        assert all(0 <= f <= 1 for f in r["top1_flips"])
    for row in ("nvfp4/ptq:calib=fp8_sweep", "fp8/ptq:calib=percentile", "nvfp4/qad:calib=fp8_sweep"):
        assert row in res.stdout, res.stdout


def test_cpu_quick_study_from_a_smoothed_start_on_swiglu_experts(tmp_path):
    out = tmp_path / "smooth.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--study", "--quick",
                          "--glu", "swiglu", "--variants", "nvfp4/qad", "nvfp4/qad:calib=smooth", "--json", str(out)],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["model_overrides"] == {"gated_linear_unit": True, "activation_func": "silu"}
    assert "gated silu" in res.stdout
    assert list(result["ptq"]) == ["nvfp4", "nvfp4:calib=smooth"]
    smooth, qad = result["ptq"]["nvfp4:calib=smooth"], result["variants"]["nvfp4/qad:calib=smooth"]
    assert smooth["kl"] != result["ptq"]["nvfp4"]["kl"]  # the rescaled experts round otherwise
    assert qad["ptq_key"] == "nvfp4:calib=smooth"
    assert qad["recipe"]["weight_amax_update"] == "dynamic"
    assert qad["kl_vs_ptq"] == pytest.approx(sum(qad["kl"]) / sum(smooth["kl"]))
    for row in ("nvfp4/ptq:calib=smooth", "nvfp4/qad:calib=smooth"):
        assert row in res.stdout, res.stdout


def test_smooth_start_and_glu_are_checked_before_training():
    tool = str(ROOT / "tools" / "bench_qat_recovery.py")
    for args, message in [(["--study", "--variants", "nvfp4/qad:calib=smooth"], "calib=smooth rescales gated experts"),
                          (["--glu", "swiglu"], "--glu needs --study")]:
        res = subprocess.run([sys.executable, tool, "--cpu", *args], capture_output=True, text=True,
                             timeout=seconds(600))
        assert res.returncode != 0
        assert message in res.stderr, res.stderr[-2000:]


def test_model_needs_the_study():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--model", "moe64"],
                         capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode != 0
    assert "--model needs --study" in res.stderr, res.stderr[-2000:]


def test_seeds_are_checked_before_training():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qat_recovery.py"), "--cpu", "--study",
                          "--seeds", "1234,x"], capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode != 0
    assert "--seeds '1234,x': expected comma-separated integers" in res.stderr, res.stderr[-2000:]
