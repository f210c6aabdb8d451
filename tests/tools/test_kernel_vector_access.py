"""tools/kernel_vector_access.py: every Triton kernel reads and writes bf16 in 16-byte vectors, in every case its
launcher takes (compiled for sm_90 on the CPU; an alignment hint the compiler cannot use would leave single-element
accesses, with the same bits)."""

import os
import re
import subprocess
import sys
from pathlib import Path

from limits import seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_reads_and_writes_bf16_in_16_byte_vectors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not the interpreter's
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_vector_access.py")], capture_output=True,
                         text=True, timeout=seconds(180), env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "every bf16 access is a 16-byte vector" in res.stdout, res.stdout
    for kernel in ("weight fake quant, per-row tiles, several shapes, partial tiles", "weight clipped gradient, "
                   "per-row tiles", "weight amax, per row", "weight fake quant + statistics, flat tiles",
                   "FP8 128x128 blocks, prefetch (the default), several shapes, partial",
                   "token fake quant, nvfp4, row scale", "token fake quant, nvfp4_four_over_six, row scale",
                   "weight fake quant, NVFP4 4-over-6, per-row tiles, several shapes, partial"):
        assert re.search(rf"^{re.escape(kernel)}.*\s[1-9]\d*\s+0\s+\d+\s+0$", res.stdout, re.M), (kernel, res.stdout)
