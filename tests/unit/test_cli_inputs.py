"""Bad inputs to the ``modelopt-moe`` command, run as a shell runs it (the installed console script, in a
subprocess): each is refused before any rank starts, at once, with a message naming the flag, the value and what
was expected; and what a shell user expects of ``module:function`` flags (the working directory is searched)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses

COMMAND = str(Path(sys.executable).parent / "modelopt-moe")  # the console script pip installed beside python
# Pre-flight answers in well under a second on an idle machine; the bound only proves no rank was started (ranks
# import torch and Megatron: tens of seconds) with room for a loaded machine.
FAST_S = 10.0


def _run(*args, cwd=None):
    """``modelopt-moe ARGS`` from ``cwd``, as a user's shell starts it (no launcher variables); (result, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH="")
    start = time.monotonic()
    done = subprocess.run([COMMAND, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    return done, time.monotonic() - start


def test_report_refuses_a_record_of_the_wrong_shape_and_writes_nothing(tmp_path):
    records = {
        "no_stages.json": ({"stages": [], "losses": {"loss": 1.0}}, "stages: expected a non-empty list of lines"),
        "losses_list.json": ({"stages": ["s"], "losses": [1.0, 2.0]}, "losses: expected an object"),
        "curve_points.json": ({"stages": ["s"], "curves": {"QAT": [1.0, 2.0]}},
                              "curves['QAT']: expected a list of [step, loss] pairs, found [1.0, 2.0]"),
        "eval_batches.json": ({"stages": ["s"], "eval": {"bf16": {"loss": [1.0, 2.0]}, "PTQ": {"loss": [1.0]}}},
                              "eval['PTQ']['loss']: 1 batches, the first model has 2"),
        "a_list.json": ([{"stages": ["s"]}], "expected a JSON object with a 'stages' list, found list"),
    }
    for name, (record, expected) in records.items():
        out = tmp_path / name.removesuffix(".json")
        out.mkdir()
        (out / "run.json").write_text(json.dumps(record))
        done, _ = _run("report", "--run", out / "run.json")
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        assert f"--run {out / 'run.json'}: not a run record" in done.stderr, (name, done.stderr)
        assert expected in done.stderr, (name, done.stderr)
        assert "nothing was written" in done.stderr
        assert "Traceback" not in done.stderr
        assert sorted(p.name for p in out.iterdir()) == ["run.json"], name


def test_data_and_model_provider_modules_are_found_in_the_working_directory(tmp_path):
    (tmp_path / "my_batches.py").write_text("def model(pre_process=True, post_process=True):\n    return None\n")
    # the module imports from the working directory; the missing function is then the only problem named
    done, _ = _run("qat", "--config", "fp8_default.yaml", "--model-provider", "my_batches:model",
                   "--data", "my_batches:no_such_function", "--cpu", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "--data 'my_batches:no_such_function': my_batches has no function 'no_such_function'" in done.stderr
    assert "cannot import" not in done.stderr
    help_text, _ = _run("qat", "--help")
    assert "searched in the working directory first" in " ".join(help_text.stdout.split())


def _hf_model_dir(path):
    """What the files of a Hugging Face model directory look like to the pre-flight (its weights are not read)."""
    from modelopt_moe.quantization.config import preset_path

    path.mkdir()
    (path / "config.json").write_text(preset_path("qwen3_moe_tiny.json").read_text())
    (path / "model.safetensors").write_bytes(b"\0" * 8)
    return path


def test_bad_model_and_checkpoint_paths_are_refused_before_any_rank_starts(tmp_path):
    hf = _hf_model_dir(tmp_path / "hf")
    out = tmp_path / "out"
    cases = [  # (argv, what the message must say)
        (["qat", "--config", "fp8_default.yaml", "--hf", tmp_path / "nonexistent"],
         f"--hf {tmp_path / 'nonexistent'}: no such directory; expected a Hugging Face model directory"),
        (["qat", "--config", "fp8_default.yaml", "--hf", tmp_path],
         f"--hf {tmp_path}: no config.json; expected a Hugging Face model directory"),
        (["qat", "--config", "fp8_default.yaml", "--hf", hf, "--load", hf],
         f"--load {hf} is a Hugging Face model (config.json, model.safetensors), not a distributed checkpoint saved "
         f"by modelopt-moe qat (--save) or save_sharded_checkpoint: start from it with --hf {hf}"),
        (["qat", "--config", "fp8_default.yaml", "--hf", hf, "--load", tmp_path / "no_ckpt"],
         f"--load {tmp_path / 'no_ckpt'}: no such directory"),
        (["qat", "--config", "fp8_default.yaml", "--hf", hf, "--save", out, "--save-interval", "-3"],
         "--save-interval -3 must be >= 1"),
        (["qat", "--config", "fp8_default.yaml", "--hf", hf, "--save", out, "--save-interval", "0"],
         "--save-interval 0 must be >= 1"),
        (["qat", "--config", "fp8_default.yaml", "--hf", hf, "--save-interval", "10"],
         "--save-interval needs --save"),
        (["export", "--checkpoint", hf, "--format", "modelopt", "--out", out],
         f"--checkpoint {hf} is a Hugging Face model (config.json, model.safetensors), not a distributed checkpoint"
         f" saved by modelopt-moe qat (--save) or save_sharded_checkpoint: quantize and export it with modelopt-moe "
         f"qat --hf {hf}"),
        (["export", "--checkpoint", tmp_path / "ckpt", "--hf-config", hf, "--format", "modelopt", "--out", out,
          "--world-size", "3", "--tp", "3", "--cpu"],
         "the model's num_attention_heads 4 must be a multiple of --tp 3"),
        (["export", "--checkpoint", tmp_path / "ckpt", "--hf-config", hf, "--format", "modelopt", "--out", out,
          "--world-size", "3", "--ep", "3", "--cpu"],
         "--ep 3 must divide the model's 8 experts"),
    ]
    for argv, expected in cases:
        done, took = _run(*argv)
        assert done.returncode == 2, (argv, done.stdout[-2000:], done.stderr[-2000:])
        assert expected in " ".join(done.stderr.split()), (argv, done.stderr)
        assert "Traceback" not in done.stderr, argv
        assert "process" not in done.stdout, (argv, done.stdout)  # no layout line: no rank was started
        assert took < FAST_S, (argv, took)
    assert not out.exists()
