"""The QAD teacher's memory on one GPU.

* ``tools/teacher_memory.py --device cuda`` at a reduced Qwen3-MoE shape: every variant's row with a measured forward
  peak; the FP8 teacher holds about half the bf16 teacher's bytes and peaks lower; stored logits hold nothing.
* FP8 teacher weights on CUDA: the teacher's logits are bit for bit those of the teacher whose weights are FP8
  fake-quantized (grouped experts, local spec); a Transformer Engine teacher (``TEGroupedMLP``) is refused by name.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import megatron_harness.models as mm  # noqa: E402

from modelopt_moe.distill import param_group, store_weights_fp8  # noqa: E402
from modelopt_moe.numerics.formats import fake_quant  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "2", "--hidden", "512", "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--experts", "16",
         "--topk", "4", "--moe-ffn-hidden", "256", "--vocab", "32000", "--seq", "1024", "--logits-k", "512"]


def test_memory_tool_measures_every_variant_on_the_gpu(tmp_path):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "teacher_memory.py"), "--device", "cuda", *SMALL,
                          "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["forward_mib"] is not None and r["forward_mib"] > 0 for r in rows.values()), rows
    assert 0.45 < rows["fp8"]["resident_mib"] / rows["bf16"]["resident_mib"] < 0.6, rows
    assert rows["fp8"]["peak_mib"] < rows["bf16"]["peak_mib"], rows
    assert rows["stored"]["resident_mib"] == 0.0
    assert rows["stored"]["peak_mib"] < rows["bf16"]["peak_mib"], rows


def test_fp8_teacher_on_cuda_is_the_fake_quantized_teacher_and_te_is_refused(megatron_one_gpu):
    build = dict(num_experts=8, hidden=128, ffn_hidden=256, params_dtype=torch.bfloat16, seed=3)
    teacher, reference = mm.build_moe_gpt(experts="grouped", **build).eval(), mm.build_moe_gpt(
        experts="grouped", **build).eval()
    for name, p in reference.named_parameters():
        if p.dim() >= 2 and param_group(name) not in ("router", "norms"):
            rows = p.detach().reshape(p.shape[0], -1)
            amax = rows.float().abs().amax(-1, keepdim=True)
            p.data.copy_(fake_quant(rows, "e4m3", amax).reshape(p.shape))
    store_weights_fp8(teacher, "per_channel")
    batch = mm.text_batches(2, 32, 1)[0]
    args = [batch[k].cuda() if batch[k] is not None else None for k in ("tokens", "position_ids", "attention_mask")]
    with torch.no_grad():
        assert torch.equal(teacher(*args), reference(*args))
    pytest.importorskip("transformer_engine.pytorch")
    te_teacher = mm.build_moe_gpt(experts="te", **build)
    with pytest.raises(ValueError, match="is a Transformer Engine module"):
        store_weights_fp8(te_teacher)
