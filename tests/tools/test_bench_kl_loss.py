"""tools/bench_kl_loss.py: the distillation KL's memory beside the whole-tensor formula it replaced (CPU, measured
with ``torch.profiler``), and the tool's table."""

import re
import subprocess
import sys
from pathlib import Path

from limits import seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_kl_peak_memory_above_logits_and_gradient_is_under_a_quarter_of_one_logits_tensor():
    import bench_kl_loss

    chunked = bench_kl_loss.measure("chunked", 256, 32768, repeats=1)
    whole = bench_kl_loss.measure("whole-tensor", 256, 32768, repeats=1)
    assert chunked["x_logits"] <= 0.25, chunked
    assert whole["x_logits"] > 10, whole  # fp32 logits, exponentials and both softmaxes saved


def test_quick_run_prints_the_memory_top_k_and_top_p_tables():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_kl_loss.py"), "--quick", "--top-k", "64",
                          "--top-p", "0.9"], capture_output=True, text=True, timeout=seconds(120))
    assert res.returncode == 0, res.stderr[-3000:]
    for impl in ("whole-tensor", "chunked"):
        assert re.search(rf"^\s+64\s+32768\s+{impl}\s+\d+\.\d+\s+\d+\.\d+\s+\d", res.stdout, re.M), res.stdout
    for value in ("64", "0.9"):  # vocab, scale, entropy, k or p, kept, exact KL, truncated KL, errors
        row = rf"^\s+32768\s+3\.0\s+\d+\.\d+\s+{value}\s+\d+\.\d\s+\d\.\d+\s+\d\.\d+\s+\d+\.\d+%\s+\d+\.\d+%"
        assert re.search(row, res.stdout, re.M), res.stdout
    assert "top-p teacher distribution" in res.stdout
