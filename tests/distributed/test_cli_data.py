"""``modelopt-moe qat --data`` / ``--eval-data`` with a user's own data module, run from a shell as a user runs them:
batches that break the contract stop the run before calibration with one clear error and a non-zero exit, and the
held-out loss, perplexity and KL are measured on the user's evaluation data."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
from limits import seconds  # noqa: E402

from modelopt_moe.quantization.config import preset_path

USER_DATA = textwrap.dedent('''
    import os

    import torch


    def _batch(batch_size, seq_len, seed, shift=0):
        ids = torch.randint(0, 256, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(seed)) + shift
        return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                "position_ids": torch.arange(seq_len).expand(batch_size, seq_len).contiguous(),
                "attention_mask": torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)[None, None]}


    def batches(split, num_batches, batch_size, seq_len, offset):
        with open(os.environ["USER_DATA_LOG"], "a") as log:
            log.write(f"{split} {num_batches} {batch_size} {seq_len} {offset}\\n")
        return [_batch(batch_size, seq_len, seed=offset + i + (1000 if split == "eval" else 0))
                for i in range(num_batches)]


    def no_position_ids(split, num_batches, batch_size, seq_len, offset):
        out = batches(split, num_batches, batch_size, seq_len, offset)
        for b in out:
            del b["position_ids"]
        return out


    def beyond_vocab(split, num_batches, batch_size, seq_len, offset):
        return [_batch(batch_size, seq_len, seed=i, shift=100) for i in range(num_batches)]  # ids 100..355
''')


@pytest.fixture
def user_project(tmp_path):
    """The user's project directory, with the data module (put on the Python path)."""
    (tmp_path / "userdata.py").write_text(USER_DATA)
    return tmp_path


def _hf_checkpoint(path):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = json.loads(preset_path("qwen3_moe_tiny.json").read_text())
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16).save_pretrained(path)
    return path


def _qat(project, *args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(project), USER_DATA_LOG=str(project / "calls.log"))
    cmd = [sys.executable, "-m", "modelopt_moe.plugins.cli", "qat", "--hf", str(project / "hf"), "--config",
           "fp8_experts.yaml", "--world-size", "1", "--cpu", "--batch-size", "2", "--seq-len", "16",
           "--calib-batches", "2", "--micro-batches", "1", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds(600), cwd=project)


@pytest.mark.parametrize(("function", "expected"), [
    ("no_position_ids", "--data userdata:no_position_ids('calib', 2, 2, 16, 0), batch 0: no position_ids (its keys: "
                        "['attention_mask', 'labels', 'tokens'])"),
    ("beyond_vocab", "--data userdata:beyond_vocab('calib', 2, 2, 16, 0), batch 0: tokens hold ids from 1"),
])
def test_qat_refuses_data_that_breaks_the_batch_contract_before_calibration(user_project, function, expected):
    _hf_checkpoint(user_project / "hf")
    done = _qat(user_project, "--data", f"userdata:{function}", "--steps", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert expected in done.stderr, done.stderr
    assert "expected a dict of tokens, labels, position_ids (int64 [batch, seq]" in done.stderr, done.stderr
    if function == "beyond_vocab":
        assert "outside the model's vocabulary of 256: ids 0..255" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    failed = [line for line in done.stderr.splitlines() if line.startswith("modelopt-moe qat: failed: rank 0 of 1: ")]
    assert len(failed) == 1, done.stderr  # one error line, not a traceback
    assert "quantizers enabled" not in done.stdout, done.stdout  # stopped before calibration


def test_qat_eval_data_reports_held_out_loss_perplexity_and_kl_on_the_users_data(user_project):
    _hf_checkpoint(user_project / "hf")
    done = _qat(user_project, "--data", "userdata:batches", "--eval-data", "userdata:batches", "--eval-batches", "3",
                "--distill", "--steps", "2", "--lr", "1e-3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = re.search(r"modelopt-moe qat: held-out \(userdata:batches, 3 batches\): loss (\S+) -> (\S+), perplexity "
                     r"(\S+) -> (\S+), KL to the bf16 model (\S+) -> (\S+)\n", done.stdout)
    assert line, done.stdout
    loss0, loss1, ppl0, ppl1, kl0, kl1 = (float(v) for v in line.groups())
    assert math.isclose(ppl0, math.exp(loss0), rel_tol=2e-3)
    assert math.isclose(ppl1, math.exp(loss1), rel_tol=2e-3)
    assert 3.0 < loss0 < 8.0  # an untrained byte-level model on random ids: about ln(256) = 5.5
    assert min(kl0, kl1) >= 0
    assert "eval 3 2 16 0" in (user_project / "calls.log").read_text().splitlines()
