"""``modelopt-moe export --format hf-mxfp4``: gpt-oss's published MXFP4 layout from the command line, as a shell runs
it (a subprocess), on a distributed checkpoint a user's script saved.

One process (``modelopt_moe.launch.spawn``) builds the shipped tiny gpt-oss (``configs/gpt_oss_tiny.json``), quantizes
it with ``configs/mxfp4_experts_only.yaml`` and saves two checkpoints with ``save_sharded_checkpoint`` +
``save_hf_config``: one with the experts' input quantizers on (not what the layout stores) and one weight-only, which
it also exports itself with ``export_hf(format="hf-mxfp4")``. Then the command line:

* exports the weight-only checkpoint with exactly the tensors and ``config.json`` of ``export_hf``, and says that the
  engine check (which reads compressed-tensors and Model Optimizer checkpoints) did not run;
* refuses, with ``export_hf``'s own messages and nothing written, the checkpoint with MXFP4 expert inputs (naming the
  module), a config whose family stores its experts one by one and an unknown ``--family`` (both before any process
  starts); ``--family`` takes every family ``export_hf`` knows (``gpt_oss`` here);
* offers every format ``export_hf`` writes from a quantized model.
"""

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn


def _config(name: str) -> dict:
    return json.loads(resources.files("modelopt_moe.configs").joinpath(name).read_text())


def _save(rank, world_size, base):
    from modelopt_moe.plugins.megatron_cpu import enable_cpu_megatron

    enable_cpu_megatron()  # without CUDA only

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, save_hf_config
    from modelopt_moe.plugins.megatron import init_model_parallel, save_sharded_checkpoint

    base = Path(base)
    hf_config = _config("gpt_oss_tiny.json")
    init_model_parallel(tp=1, ep=1)
    model = build_megatron_model(hf_config)
    tokens = torch.randint(0, hf_config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    model.eval()
    mtq.quantize(model, mtq.load_config("mxfp4_experts_only.yaml"), lambda m: m(tokens, positions, None))
    for name in ("ckpt_inputs", "ckpt"):
        if name == "ckpt":  # the published layout is weight-only
            mtq.disable_quantizer(model, "*experts*input_quantizer")
        save_sharded_checkpoint([model], base / name)
        save_hf_config(hf_config, base / name)
    export_hf(model, base / "direct", format="hf-mxfp4", hf_config=hf_config, dtype=torch.bfloat16, progress=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli_hf_mxfp4")
    spawn(_save, 1, args=(str(base),), timeout=seconds(300))
    return base


def _export(*args, cwd):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "modelopt_moe.plugins.cli", "export", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=seconds(300), cwd=cwd)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_cli_writes_export_hfs_hf_mxfp4_checkpoint(base, tmp_path):
    out = tmp_path / "mx"
    done = _export("--checkpoint", base / "ckpt", "--format", "hf-mxfp4", "--family", "gpt_oss", "--out", out,
                   cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "check: not run (the engine check reads compressed-tensors and modelopt checkpoints" in done.stdout
    ours, direct = _tensors(out), _tensors(base / "direct")
    assert sorted(ours) == sorted(direct)
    assert any(name.endswith("gate_up_proj_blocks") for name in ours), sorted(ours)
    for name, t in direct.items():
        assert ours[name].dtype == t.dtype, name
        assert torch.equal(ours[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == json.loads((base / "direct" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"


def test_cli_refuses_what_export_hf_refuses_before_writing(base, tmp_path, capfd):
    from modelopt_moe.plugins.cli import main

    out = tmp_path / "inputs"  # the command's own function (its ranks start the same way), to spare an interpreter
    assert main(["export", "--checkpoint", str(base / "ckpt_inputs"), "--format", "hf-mxfp4", "--out", str(out),
                 "--timeout", "300"]) == 1
    err = capfd.readouterr().err
    assert "format='hf-mxfp4' is weight-only" in err, err[-3000:]
    assert "mlp.experts" in err, err[-3000:]  # names the module
    assert not out.exists()

    qwen3 = tmp_path / "qwen3_moe.json"
    qwen3.write_text(json.dumps(_config("qwen3_moe_tiny.json")))
    out = tmp_path / "qwen3"
    done = _export("--checkpoint", base / "ckpt", "--hf-config", qwen3, "--format", "hf-mxfp4", "--out", out,
                   cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert ("modelopt-moe export: format='hf-mxfp4' stores fused 3-D experts (gpt-oss's layout); Qwen3MoeForCausalLM "
            "stores its experts one by one: use format='compressed-tensors'") in done.stderr, done.stderr
    assert "export: 0%" not in done.stderr  # refused before any process started
    assert not out.exists()

    assert main(["export", "--checkpoint", str(base / "ckpt"), "--format", "hf-mxfp4", "--family", "gpt-oss",
                 "--out", str(out)]) == 2  # every family export_hf knows is named as export_hf names it
    err = capfd.readouterr().err
    assert "modelopt-moe export: family='gpt-oss' is not supported; expected one of ['deepseek_v3', " in err, err
    assert not out.exists()


def test_cli_offers_every_format_export_hf_writes_from_a_quantized_model(tmp_path):
    from modelopt_moe.export import FORMATS
    from modelopt_moe.export.fused_mxfp4 import FILE_FORMAT

    done = _export("--checkpoint", tmp_path, "--format", "?", "--out", tmp_path / "o", cwd=tmp_path)
    assert done.returncode == 2
    offered = done.stderr.split("(choose from ", 1)[1].split(")", 1)[0].replace("'", "").split(", ")
    # "hf" writes unquantized models only, and this command exports quantized checkpoints
    assert sorted(offered) == sorted({*FORMATS, FILE_FORMAT} - {"hf"}), done.stderr
