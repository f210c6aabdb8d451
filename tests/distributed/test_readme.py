"""Every code snippet of README.md runs as written.

Python snippets that are complete programs run as they are (the usage example in this process, the ``spawn``
example as a script); the Megatron snippets define functions (``qat``, ``resume``, ``save_with_own_calls``,
``load_with_own_calls``, and ``wrap_and_build_optimizer`` / ``train_step`` beside ``qat``), which are written to a
module, exactly as printed (its first lines set Megatron up for this CPU machine: ``enable_cpu_megatron()``), and
called here on 2 gloo ranks (TP=1 x EP=2) with a small real Megatron MoE GPT: train 2 steps, save with the optimizer,
restore into a freshly built model through each documented call and compare every weight and amax; ``resume``
restores the optimizer too, and the next ``train_step`` must equal the uninterrupted run's bit for bit. The YAML
snippet is loaded with ``mtq.load_config``. A new snippet must be added here: the first test counts them.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

README = Path(__file__).resolve().parents[2] / "README.md"
MEGATRON_SNIPPETS = ("def qat(", "def resume(", "def save_with_own_calls(")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _python(marker: str) -> str:
    (block,) = [b for b in _blocks("python") if marker in b]
    return block


def test_every_snippet_is_run_here():
    python = _blocks("python")
    assert len(python) == 8, "a README python snippet was added or removed: run it in this file"
    assert sum(any(m in b for m in MEGATRON_SNIPPETS) for b in python) == 3
    assert len(_blocks("yaml")) == 1


def test_usage_snippet():
    namespace = {}
    exec(compile(_python("mtq.FP8_DEFAULT_CFG, forward_loop"), "README.md", "exec"), namespace)
    y, experts = namespace["y"], namespace["experts"]
    assert y.shape == (40, 32)
    assert torch.isfinite(y).all()
    assert experts.weight_quantizer.amax.shape == (4,)


def test_model_optimizer_snippet():
    exec(compile(_python("import modelopt_moe.checkpoint as mto"), "README.md", "exec"), {})


def test_yaml_snippet(tmp_path):
    import modelopt_moe.quantization as mtq

    path = tmp_path / "my_config.yaml"
    path.write_text(_blocks("yaml")[0])
    cfg = mtq.load_config(path)
    assert cfg.experts.weight_amax == "per_expert"
    assert cfg.backward.mode == "dequantized"
    assert cfg.quant_cfg[0].cfg.format == "nvfp4"  # the imported preset's rules come first
    assert cfg.resolve("decoder.layers.0.self_attention.linear_qkv.weight_quantizer", "ColumnParallelLinear") \
        .enable is False


def test_spawn_snippet(tmp_path):
    script = tmp_path / "readme_spawn.py"
    script.write_text(_python("def work(rank, world_size, scale)"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=seconds(600))
    assert done.returncode == 0, done.stderr[-2000:]


def test_distillation_snippet(tmp_path):
    script = tmp_path / "readme_qad.py"
    script.write_text(_python("DistillationModel(student, teacher)"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=seconds(600),
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "switched" in done.stdout
    assert any((tmp_path / "autoswitch_logs").iterdir())


def test_export_snippet(tmp_path):
    from modelopt_moe.plugins.known_warnings import KNOWN_LOGS, KNOWN_WARNINGS

    script = tmp_path / "readme_export.py"
    script.write_text(_python("def qat_and_export("))
    # as a user runs it: ranks start as fresh interpreters (not forked from this suite's preloaded fork server)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELOPT_MOE_FORKSERVER")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=seconds(600),
                          cwd=tmp_path, env={**env, "MODELOPT_MOE_START_METHOD": "spawn"})
    assert done.returncode == 0, done.stderr[-3000:]
    # quiet_known_warnings() at its top: no known third-party warning from any process
    shown = [k.pattern for k in (*KNOWN_WARNINGS, *KNOWN_LOGS) if re.search(k.pattern, done.stderr)]
    assert not shown, (shown, done.stderr[-3000:])
    assert "warnings.warn(" not in done.stderr, done.stderr[-3000:]
    written = sorted(p.name for p in (tmp_path / "tiny-qwen3-moe-nvfp4").iterdir())
    assert "config.json" in written, written
    assert any(n.endswith(".safetensors") for n in written), written
    # NVIDIA's whole recipe: a scheme per layer and the FP8 KV cache's scales
    import json

    from modelopt_moe.export.engine_forward import engine_order_model

    qc = json.loads((tmp_path / "tiny-qwen3-moe-nvfp4" / "config.json").read_text())["quantization_config"]
    assert (qc["quant_algo"], qc["kv_cache_quant_algo"]) == ("MIXED_PRECISION", "FP8"), qc
    attn = engine_order_model(tmp_path / "tiny-qwen3-moe-nvfp4").model.layers[1].self_attn
    assert attn.k_scale > 0
    assert attn.v_scale > 0


def _megatron_worker(rank, world_size, root):
    sys.path.insert(0, root)
    assert "megatron.core" not in sys.modules  # the README's first lines run before Megatron is imported
    import megatron_harness.models as mm
    import readme_megatron as rm
    import torch.distributed as dist
    from test_checkpoint_reshard import global_amax, global_params

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import get_forward_backward_func
    from modelopt_moe.plugins.megatron import training as mt

    mm.init_model_parallel(1, 2, seed=3)
    batches = mm.text_batches(2, 32, 4, offset=50)
    next_batches = mm.text_batches(2, 32, 4, offset=90)

    def build(seed):
        return mm.build_moe_gpt(num_experts=4, seed=seed, experts="grouped", params_dtype=torch.bfloat16)

    def forward_loop(model):
        for b in mm.text_batches(2, 32, 2):
            mm.lm_loss(model, b)

    ckpt = os.path.join(root, "ckpt")
    model, optimizer = rm.qat(build(3), batches, forward_loop, steps=2, num_microbatches=2, ckpt_dir=ckpt)
    trained = mt.unwrap(model)
    want = {"amax": global_amax(trained, mm), "params": global_params(trained, mm)}
    assert isinstance(trained.decoder.layers[0].mlp.experts.linear_fc1.weight_quantizer, mtq.ExpertQuantizer)
    own = os.path.join(root, "own")
    if rank == 0:
        os.makedirs(own)
    dist.barrier()
    rm.save_with_own_calls(trained, own)
    dist.barrier()
    # The uninterrupted run's next step (with its third step's data), then the same step after each resume.
    rm.train_step(model, optimizer, get_forward_backward_func(), next_batches, 2)
    want["next_amax"], want["next_params"] = global_amax(trained, mm), global_params(trained, mm)

    out = {}
    resumed, optimizer, out["iteration"] = rm.resume(build(11), rm.wrap_and_build_optimizer, ckpt)
    out["resume_amax"] = global_amax(mt.unwrap(resumed), mm)
    out["resume_params"] = global_params(mt.unwrap(resumed), mm)
    rm.train_step(resumed, optimizer, get_forward_backward_func(), next_batches, 2)
    out["next_amax"], out["next_params"] = global_amax(mt.unwrap(resumed), mm), global_params(mt.unwrap(resumed), mm)
    fresh = build(12)
    rm.load_with_own_calls(fresh, own)
    out["own_amax"] = global_amax(fresh, mm)
    out["own_params"] = global_params(fresh, mm)
    return {"want": want, **out}


def test_megatron_snippets_train_save_and_restore(tmp_path):
    module = tmp_path / "readme_megatron.py"
    module.write_text("\n\n".join(_python(m) for m in MEGATRON_SNIPPETS))
    sys.path.insert(0, str(Path(__file__).parent))
    # A fresh interpreter per rank, as a user's script starts: the README's first lines run before Megatron is imported.
    results = spawn(_megatron_worker, 2, args=(str(tmp_path),), timeout=seconds(900), start_method="spawn")
    for r in results:
        assert r["iteration"] == 2
        for k, v in r["want"]["amax"].items():
            assert torch.equal(r["resume_amax"][k], v), k
        for k, v in r["want"]["params"].items():
            assert torch.equal(r["resume_params"][k], v), k
        # The optimizer resumed too: the next step equals the uninterrupted run's, bit for bit.
        for k, v in r["want"]["next_amax"].items():
            assert torch.equal(r["next_amax"][k], v), k
        for k, v in r["want"]["next_params"].items():
            assert torch.equal(r["next_params"][k], v), k
        assert any(not torch.equal(r["want"]["next_params"][k], v) for k, v in r["want"]["params"].items())
        for k, v in r["want"]["amax"].items():
            assert torch.equal(r["own_amax"][k], v), k
        for k, v in r["want"]["params"].items():
            assert torch.equal(r["own_params"][k], v), k
