"""tools/cold_expert_calibration.py on the QAD study's 64-expert model (trained a few steps with ``--quick``): it
prints a row per calibration over all 256 expert inputs, and a ratio of 1.0 leaves no expert input without a token;
``--aux-loss`` trains the teacher with Megatron's load-balancing loss."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from limits import seconds  # noqa: E402

pytestmark = pytest.mark.slow  # runs the tool: a process and training

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "cold_expert_calibration.py")


@pytest.fixture(scope="module")
def quick_run():
    """The tool's output for ``--model moe64 --quick`` plus the given arguments (each run once)."""
    outputs = {}

    def run(*args):
        if args not in outputs:
            res = subprocess.run([sys.executable, TOOL, "--model", "moe64", "--quick", *args], capture_output=True,
                                 text=True, timeout=seconds(600))
            assert res.returncode == 0, res.stderr[-3000:]
            outputs[args] = res.stdout
        return outputs[args]

    return run


def test_quick_run_on_the_trained_64_expert_model_prints_every_calibration(quick_run):
    stdout = quick_run()
    assert "64 experts top-8" in stdout, stdout
    assert "no load-balancing loss" in stdout
    assert "median relative amax error, cold inputs" in stdout
    rows = {m[0]: int(m[1]) for m in re.findall(r"^\| (.+?) \| (\d+) of 256 \|", stdout, re.M)}
    assert list(rows) == ["short (1 x 64 tokens), model's routing", "short (1 x 64 tokens), ratio 0.25 (16 of 64 "
                          "experts)", "short (1 x 64 tokens), ratio 0.5 (32 of 64 experts)",
                          "short (1 x 64 tokens), ratio 1.0 (64 of 64 experts)", "long, ratio 1.0"], stdout
    assert rows["short (1 x 64 tokens), model's routing"] > 0  # the router favours some experts from the start
    assert rows["short (1 x 64 tokens), ratio 1.0 (64 of 64 experts)"] == rows["long, ratio 1.0"] == 0


def _tokens_per_expert(stdout):
    return re.findall(r"^teacher's tokens per expert on the reference, layer \d: (.+)$", stdout, re.M)


def test_aux_loss_trains_the_teacher_with_megatrons_load_balancing_loss(quick_run):
    plain, balanced = quick_run(), quick_run("--aux-loss")
    assert "load-balancing aux loss coeff 0.01" in balanced, balanced
    # Megatron's router recorded the loss while the teacher trained (an even split gives 1.0), only with the option
    assert "while the teacher trained (aux_loss / coeff, 1.0 for an even split; mean over the steps): none (no aux " \
           "loss)" in plain, plain
    losses = [float(v) for v in re.findall(r"while the teacher trained .*?: layer 1 ([\d.]+), layer 2 ([\d.]+)$",
                                           balanced, re.M)[0]]
    assert all(v > 0 for v in losses), losses
    # its gradient reached the router through Megatron's schedule: the trained teacher routes differently
    assert len(_tokens_per_expert(plain)) == len(_tokens_per_expert(balanced)) == 2
    assert _tokens_per_expert(plain) != _tokens_per_expert(balanced), (plain, balanced)
    spread = [[float(v) for v in re.findall(r"coefficient of variation ([\d.]+)", "\n".join(_tokens_per_expert(out)))]
              for out in (plain, balanced)]
    assert all(b < p for p, b in zip(*spread, strict=True)), spread  # more even, in every layer, after 2 steps


def test_bad_options_are_refused_before_training():
    import torch

    bad = [(["--gpu"], "--gpu needs --model moe64"),
           (["--quick"], "--quick needs --model moe64"),
           (["--aux-loss"], "--aux-loss needs --model moe64"),
           (["--model", "moe64", "--aux-loss", "0"], "--aux-loss 0.0: expected a positive, finite"),
           (["--model", "moe64", "--aux-loss", "nan"], "--aux-loss nan: expected a positive, finite"),
           (["--model", "moe64", "--pretrain-steps", "0"], "--pretrain-steps 0: expected a positive"),
           (["--model", "moe64", "--long-batches", "0"], "--long-batches 0: expected a positive"),
           (["--model", "moe64", "--short-seqs", "9"], "--short-seqs 9: expected 1 to 8")]
    if not torch.cuda.is_available():
        bad.append((["--model", "moe64", "--gpu"], "--gpu: no CUDA GPU is visible"))
    for args, message in bad:
        res = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=seconds(60))
        assert res.returncode != 0
        assert message in res.stderr, res.stderr
