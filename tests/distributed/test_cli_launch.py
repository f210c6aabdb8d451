"""``modelopt-moe qat`` as a cluster runs it: under ``torchrun --nproc-per-node 4`` on CPU (gloo, TP=2 x EP=2), QAD of
a Hugging Face Qwen3-MoE checkpoint with NVFP4 experts, saved, then resumed from the checkpoint at another layout
(TP=1 x EP=4) and exported; every line printed once (rank 0), whatever the number of processes."""

import json
import os
import re
import socket
import subprocess
import sys

import torch
from limits import seconds  # noqa: E402

from modelopt_moe.quantization.config import preset_path


def _hf_checkpoint(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = json.loads(preset_path("qwen3_moe_tiny.json").read_text())
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, timeout=None):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "modelopt_moe.plugins.cli", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=timeout or seconds(900))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


def test_qat_under_torchrun_saves_resumes_at_another_layout_and_exports(tmp_path):
    hf = _hf_checkpoint(tmp_path / "hf")
    common = ["--hf", str(hf), "--config", "nvfp4_experts.yaml", "--distill", "--micro-batches", "2",
              "--batch-size", "2", "--seq-len", "32", "--calib-batches", "2", "--lr", "1e-4"]
    out = _torchrun(["qat", *common, "--tp", "2", "--ep", "2", "--steps", "2", "--save", str(tmp_path / "ck"),
                     "--teacher-fp8", "per_channel"])
    assert out.count("modelopt-moe qat: steps 1..2, loss") == 1, out
    fp8, bf16 = map(float, re.search(r"teacher weights in FP8 E4M3 \(per_channel scales\): ([\d.]+) MiB on rank 0, "
                                     r"([\d.]+) MiB before", out).groups())
    assert 0.2 < fp8 / bf16 < 0.6, out  # the teacher's weights, stored in FP8
    assert out.count(f"saved {tmp_path / 'ck'} (iteration 2)") == 1, out
    assert (tmp_path / "ck" / "modelopt_moe_state.pt").is_file()
    assert (tmp_path / "ck" / "hf_config.json").is_file()

    out = _torchrun(["qat", *common, "--tp", "1", "--ep", "4", "--steps", "3", "--load", str(tmp_path / "ck"),
                     "--export", str(tmp_path / "export")])
    assert out.count(f"resuming from {tmp_path / 'ck'}") == 1, out
    assert out.count("modelopt-moe qat: steps 3..3, loss") == 1, out
    # the layout line, once; the quantizer summary after the checkpoint loaded (every expert amax restored)
    assert out.count("modelopt-moe qat: 4 CPU processes (gloo), TP=1 x EP=4") == 1, out
    summary = out[out.index("expert amax by global expert index"):]
    assert "amax=None" not in out, out
    assert "None" not in summary.split("quantizers enabled")[0], out
    assert re.search(" ".join(rf"{e}:[0-9.]+" for e in range(8)), summary), summary
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["quantization_config"]["format"] == "nvfp4-pack-quantized", exported["quantization_config"]
