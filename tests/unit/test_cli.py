"""The ``modelopt-moe`` command line: ``demo`` (also the bare flags) and ``export`` (argument and input checks that
fail before any process starts; the end-to-end export is in tests/distributed/test_hf_export.py)."""

import pytest

from modelopt_moe.plugins.cli import main


@pytest.mark.parametrize("prefix", [[], ["demo"]])
def test_demo_flags_work_bare_and_as_a_subcommand(prefix, capsys):
    with pytest.raises(SystemExit) as info:
        main([*prefix, "--tp", "3"])
    assert info.value.code == 2
    assert "--tp 3 must be >= 1 and divide --world-size 4" in capsys.readouterr().err


def test_export_help_and_required_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--checkpoint", "--format", "--out", "--hf-config", "--tp", "--ep", "--world-size"):
        assert flag in out
    with pytest.raises(SystemExit) as info:
        main(["export", "--checkpoint", "c", "--format", "gguf", "--out", "o"])
    assert info.value.code == 2 and "invalid choice: 'gguf'" in capsys.readouterr().err


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
    assert "1. one" in md and "2. two" in md and "| bf16 teacher (held out) | 2.5000 |" in md
    assert (tmp_path / "loss_curve.png").is_file()


def test_qat_needs_a_model_and_checks_its_imports_before_starting(capsys):
    with pytest.raises(SystemExit) as info:
        main(["qat", "--config", "nvfp4_experts.yaml"])
    assert info.value.code == 2 and "give --model-provider or --hf" in capsys.readouterr().err
    assert main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "no_such_pkg.models:build"]) == 2
    assert "--model-provider 'no_such_pkg.models:build': cannot import 'no_such_pkg.models'" in capsys.readouterr().err
    assert main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json:no_such_fn"]) == 2
    assert "json has no function 'no_such_fn'" in capsys.readouterr().err
    assert main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json"]) == 2
    assert "expected 'package.module:function'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["qat", "--config", "nvfp4_experts.yaml", "--model-provider", "json:loads", "--distill", "--load", "y"])
    assert info.value.code == 2 and "--distill with --load needs --hf" in capsys.readouterr().err
