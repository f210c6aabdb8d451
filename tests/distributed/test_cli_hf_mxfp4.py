"""gpt-oss's published MXFP4 layout (``hf-mxfp4``) from the command line, as a shell runs it (a subprocess):
``modelopt-moe export --format hf-mxfp4`` on a distributed checkpoint a user's script saved, and ``modelopt-moe qat
--export-format hf-mxfp4`` on a Hugging Face checkpoint.

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

``modelopt-moe qat`` trains the tiny gpt-oss written by transformers (one process: expert-parallel size 1) with MXFP4
weight-only experts and exports it in that layout, which transformers (``Mxfp4Config``) loads and runs; a Hugging Face
model whose experts are stored one by one is refused with ``export_hf``'s message before any process starts.
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


MXFP4_WEIGHT_ONLY_EXPERTS = """\
quant_cfg:
  - quantizer_name: "*experts*weight_quantizer"
    cfg: {num_bits: [2, 1], block_sizes: {-1: 32, type: dynamic, scale_bits: [8, 0]}}
algorithm: max
"""


def _qat(project: Path, hf: Path, *args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "modelopt_moe.plugins.cli", "qat", "--hf", str(hf), "--config",
           str(project / "mxfp4_weight_only_experts.yaml"), "--world-size", "1", "--tp", "1", "--ep", "1", "--cpu",
           "--batch-size", "2", "--seq-len", "16", "--calib-batches", "1", "--micro-batches", "1",
           "--export-format", "hf-mxfp4", *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds(600), cwd=project)


def test_qat_trains_gpt_oss_and_exports_the_published_mxfp4_layout(tmp_path):
    from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM
    from transformers.utils.quantization_config import Mxfp4Config

    torch.manual_seed(0)
    GptOssForCausalLM(GptOssConfig(**_config("gpt_oss_tiny.json"))).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    (tmp_path / "mxfp4_weight_only_experts.yaml").write_text(MXFP4_WEIGHT_ONLY_EXPERTS)
    out = tmp_path / "gpt-oss-qat"
    done = _qat(tmp_path, tmp_path / "hf", "--steps", "1", "--lr", "1e-3", "--export", out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"exported {out} (hf-mxfp4)" in done.stdout, done.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4", cfg
    names = _tensors(out)
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names, sorted(names)
    assert names["model.layers.0.mlp.experts.down_proj_scales"].dtype == torch.uint8
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        logits = model(torch.arange(16)[None]).logits
    assert torch.isfinite(logits).all()


def test_qat_refuses_hf_mxfp4_for_experts_stored_one_by_one_before_starting(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    Qwen3MoeForCausalLM(Qwen3MoeConfig(**_config("qwen3_moe_tiny.json"))).save_pretrained(tmp_path / "hf")
    (tmp_path / "mxfp4_weight_only_experts.yaml").write_text(MXFP4_WEIGHT_ONLY_EXPERTS)
    done = _qat(tmp_path, tmp_path / "hf", "--steps", "1", "--export", tmp_path / "out")
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert (f"modelopt-moe qat: --hf {tmp_path / 'hf'}: format='hf-mxfp4' stores fused 3-D experts (gpt-oss's "
            "layout); Qwen3MoeForCausalLM stores its experts one by one: use format='compressed-tensors'") in \
        done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
