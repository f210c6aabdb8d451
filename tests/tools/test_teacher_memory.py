"""tools/teacher_memory.py: the QAD teacher's memory table (bf16 weights, FP8 weights, stored logits), in its tiny
CPU mode (a process of its own: world size 1, gloo, the project's CPU shims). Not a measurement: the table's rows
and what holds at any size (FP8 about halves the resident weights, stored logits hold none) are checked."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

pytestmark = pytest.mark.slow  # runs the tool: a Megatron model in its own process

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_cpu_run_prints_the_table_of_every_variant(tmp_path):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "teacher_memory.py"), "--tiny", "--json", str(out)],
                         capture_output=True, text=True, timeout=seconds(300))
    assert res.returncode == 0, res.stderr[-3000:]
    for variant in ("bf16", "fp8", "stored"):
        assert re.search(rf"^{variant}\s+[\d.]+\s+-\s+-\s+[\d.]+x", res.stdout, re.M), res.stdout
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert 0.45 < rows["fp8"]["resident_mib"] / rows["bf16"]["resident_mib"] < 0.6, rows
    assert rows["stored"]["resident_mib"] == 0.0
    assert rows["stored"]["disk_mib"] > 0
    assert rows["fp8"]["full_model_gib"] < rows["bf16"]["full_model_gib"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_a_gpu_is_refused():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "teacher_memory.py"), "--device", "cuda", "--tiny"],
                         capture_output=True, text=True, timeout=seconds(120))
    assert res.returncode == 2
    assert "--device cuda: no CUDA device" in res.stderr


def test_the_qad_study_takes_the_fp8_teacher_as_a_variant_field():
    from qad_study import parse_variant

    from modelopt_moe.distill import QADRecipe

    assert parse_variant("nvfp4/qad:teacher_fp8=per_channel")[2] == QADRecipe(teacher_fp8="per_channel")
    with pytest.raises(ValueError, match=r"variant 'nvfp4/qad:teacher_fp8=fp8': QADRecipe.teacher_fp8='fp8'"):
        parse_variant("nvfp4/qad:teacher_fp8=fp8")
