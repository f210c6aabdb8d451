"""The ``modelopt-moe`` command line: ``demo`` (also the bare flags) and ``export`` (argument and input checks that
fail before any process starts; the end-to-end export is in tests/distributed/test_hf_export.py); help and usage
errors answered before torch is imported."""

import json
import os
import subprocess
import sys

import pytest

from modelopt_moe.plugins.cli import main


@pytest.mark.parametrize("prefix", [[], ["demo"]])
def test_demo_flags_work_bare_and_as_a_subcommand(prefix, capsys):
    with pytest.raises(SystemExit) as info:
        main([*prefix, "--cpu", "--tp", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--tp 3 must divide the world size 4" in err
    assert "This would run: --world-size 4 --tp 2 --ep 2" in err


def test_an_unknown_command_names_the_commands(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err
    assert "demo, export, report, qat" in err
    assert "modelopt-moe demo" not in err  # not taken for a demo argument


# Every parse path: help and usage errors of each command. Run in a fresh interpreter that must never import torch
# (importing it takes seconds; these answer at once).
_PARSE_ONLY = [
    ["--help"], ["frobnicate"], ["--steps", "x"], ["demo", "--help"], ["demo", "--cpu", "--tp", "3"],
    ["demo", "--world-size", "2", "--tp", "2", "--seq-len", "33"], ["demo", "--format", "int3"],
    ["qat", "--help"], ["qat", "--config", "nvfp4_experts.yaml"],
    ["qat", "--config", "c.yaml", "--hf", "m", "--ep", "0"],
    ["qat", "--config", "c.yaml", "--hf", "m", "--distill", "--train", "nothing"],
    ["qat", "--config", "c.yaml", "--hf", "m", "--temperature", "2"],
    ["export", "--help"], ["export", "--checkpoint", "c"], ["report", "--help"], ["report"],
]


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
def test_help_and_usage_errors_never_import_torch():
    code = f"""
import json, sys
from modelopt_moe.plugins.cli import main
codes = []
for argv in {_PARSE_ONLY!r}:
    try:
        codes.append(main(argv))
    except SystemExit as e:
        codes.append(e.code)
    heavy = sorted(m for m in ("torch", "megatron", "transformers", "numpy") if m in sys.modules)
    assert not heavy, (argv, heavy)
print(json.dumps(codes))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [0 if "--help" in a else 2 for a in _PARSE_ONLY], codes


def test_qat_and_export_help_show_every_default(capsys):
    for command in ("qat", "export"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        for flag in ("--temperature", "--timeout", "--export-format") if command == "qat" else ("--timeout",):
            help_text = " ".join(out.split(f"\n  {flag} ", 1)[1].split("\n  -", 1)[0].split())
            assert "(default: " in help_text, (command, flag, help_text)


def test_export_help_and_required_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--checkpoint", "--format", "--out", "--hf-config", "--tp", "--ep", "--world-size"):
        assert flag in out
    with pytest.raises(SystemExit) as info:
        main(["export", "--checkpoint", "c", "--format", "gguf", "--out", "o"])
    assert info.value.code == 2
    assert "invalid choice: 'gguf'" in capsys.readouterr().err


def _fake_checkpoint(path):
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(path))  # a readable .metadata and its data file
    for name in ("metadata.json", "modelopt_moe_state.pt"):
        (path / name).write_text("x")
    return path


def test_export_fails_fast_on_bad_inputs(tmp_path, capsys):
    args = ["export", "--format", "modelopt", "--out", str(tmp_path / "out")]
    assert main([*args, "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    assert main([*args, "--checkpoint", str(ckpt)]) == 2
    assert "hf_config.json not found: the checkpoint does not record its model" in capsys.readouterr().err
    (ckpt / "hf_config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    assert main([*args, "--checkpoint", str(ckpt)]) == 2
    assert "LlamaForCausalLM" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    (ckpt / "hf_config.json").write_text(
        '{"architectures": ["MixtralForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, '
        '"num_attention_heads": 1, "num_experts_per_tok": 1, "max_position_embeddings": 8, "num_local_experts": 2, '
        '"intermediate_size": 8, "rope_theta": 10000.0}')
    assert main(["export", "--format", "modelopt", "--out", str(taken), "--checkpoint", str(ckpt)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_report_refuses_what_is_not_a_run_record(tmp_path, capsys):
    assert main(["report", "--run", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"losses": {}}')
    assert main(["report", "--run", str(bad)]) == 2
    assert "not a run record" in capsys.readouterr().err


def test_report_renders_a_run_record_without_processes(tmp_path):
    import json

    run = {"title": "t", "setup": ["a"], "stages": ["one", "two"], "losses": {"bf16 teacher (held out)": 2.5},
           "curves": {"bf16": [[0, 3.0], [1, 2.5]]}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert main(["report", "--run", str(tmp_path / "run.json")]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "1. one" in md
    assert "2. two" in md
    assert "| bf16 teacher (held out) | 2.5 |" in md
    assert (tmp_path / "loss_curve.png").is_file()


def test_qat_needs_a_model_and_checks_its_imports_before_starting(capsys):
    with pytest.raises(SystemExit) as info:
        main(["qat", "--config", "nvfp4_experts.yaml"])
    assert info.value.code == 2
    assert "give --model-provider or --hf" in capsys.readouterr().err
    assert main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "no_such_pkg.models:build"]) == 2
    assert "--model-provider 'no_such_pkg.models:build': cannot import 'no_such_pkg.models'" in capsys.readouterr().err
    assert main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json:no_such_fn"]) == 2
    assert "json has no function 'no_such_fn'" in capsys.readouterr().err
    assert main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json"]) == 2
    assert "expected 'package.module:function'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json:loads", "--distill", "--load", "y"])
    assert info.value.code == 2
    assert "--distill with --load needs --hf" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json:loads", "--teacher-fp8", "per_tensor"])
    assert info.value.code == 2
    assert "--teacher-fp8 needs --distill" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json:loads", "--distill",
              "--teacher-fp8", "fp8"])
    assert info.value.code == 2
    assert "--teacher-fp8: invalid choice: 'fp8'" in capsys.readouterr().err
