"""``modelopt-moe check`` on NVFP4 exports with 4-over-6 block scales (modelopt_moe/export/check.py, check_rules.py,
checkpoint_layout.py): the second-level scales of the weights and inputs that the checkpoint's ``nvfp4_four_over_six``
marker names stand for ``amax / 1536``, the others for NVFP4's ``amax / 2688``, and the checker converts each with
its own bound."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from modelopt_moe.export import get_family
from modelopt_moe.export.checkpoint_layout import checkpoint_layout
from modelopt_moe.export.families import MoEArch, canonical_names, canonical_shapes
from modelopt_moe.export.hf_checkpoint import LinearRecord, TensorRecord, write_hf_checkpoint
from modelopt_moe.export.schemes import LinearQuant, QuantSpec

ARCH = MoEArch(family="qwen3_moe", vocab_size=32, hidden_size=32, num_layers=1, num_attention_heads=2,
               num_kv_heads=1, head_dim=16, moe_ffn_hidden_size=16, num_experts=2, top_k=1, norm_eps=1e-6,
               rope_theta=1e4, max_position_embeddings=32, qk_norm=True)
FOS, PLAIN = QuantSpec("nvfp4_four_over_six"), QuantSpec("nvfp4")
EXPERTS = LinearQuant(FOS, FOS)  # NVFP4_4O6: weights and inputs 4-over-6
ATTENTION = LinearQuant(FOS, PLAIN)  # NVFP4_4O6_WEIGHTS: 4-over-6 weights, plain NVFP4 inputs
# amaxes exactly representable and distinct per linear; gate and up of expert 0 differ, so that the engines' fused
# gate/up global scale is reported with both amaxes
WEIGHT_AMAX = {"layers.0.experts.0.gate": 3.0, "layers.0.experts.0.up": 5.0}
INPUT_AMAX = {"layers.0.experts.0.gate": 12.0, "layers.0.q_proj": 20.0}


def _amax(table: dict, name: str, default: float) -> torch.Tensor:
    return torch.tensor(table.get(name, table.get(re.sub(r"\.(up|k_proj|v_proj)$", lambda m: ".gate" if m[1] == "up"
                                                            else ".q_proj", name), default)))


def _export(out: Path, fmt: str, experts: LinearQuant = EXPERTS) -> Path:
    g = torch.Generator().manual_seed(0)
    shapes, records = canonical_shapes(ARCH), []
    for name in canonical_names(ARCH):
        t = torch.randn(shapes[name], generator=g) * 0.1
        quant = experts if ".experts." in name else ATTENTION if name.endswith(("q_proj", "k_proj", "v_proj",
                                                                                "o_proj")) else None
        if quant is not None:
            records.append(LinearRecord(name, t, quant, _amax(WEIGHT_AMAX, name, 1.0), _amax(INPUT_AMAX, name, 8.0)))
        elif t.dim() == 2 and name != "embed_tokens":
            records.append(LinearRecord(name, t))
        else:
            records.append(TensorRecord(name, t))
    quants = {r.canonical: r.quant for r in records if isinstance(r, LinearRecord)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 4-over-6 serving setting (tested in test_four_over_six.py)
        return write_hf_checkpoint(out, arch=ARCH, family=get_family("qwen3_moe"), fmt=fmt, linear_quants=quants,
                                   groups=[("all", records)], num_groups=1, dtype=torch.float32, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_check_reports_four_over_six_weight_amaxes_with_the_1536_bound(tmp_path, fmt):
    out = _export(tmp_path / "ckpt", fmt)
    cli = Path(sys.executable).with_name("modelopt-moe")
    done = subprocess.run([str(cli), "check", str(out), "--engine", "vllm", "--details"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr  # gate and up global scales differ: vLLM keeps the gate's
    gate_up = [line for line in done.stdout.splitlines() if line.strip().startswith("error: [gate_up]")]
    assert len(gate_up) == 1, done.stdout
    # the trained amaxes (3 and 5), not 1.75x them (5.25 and 8.75: 4-over-6 scales read with NVFP4's 2688)
    assert "model.layers.0.mlp.experts.0.gate_proj / model.layers.0.mlp.experts.0.up_proj: weight_scale amax 3 != 5:" \
        in gate_up[0], gate_up[0]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_checkpoint_layout_converts_each_scale_with_the_bound_the_marker_says(tmp_path, fmt):
    from safetensors.torch import load_file

    out = _export(tmp_path / "ckpt", fmt)
    findings = []
    layout = checkpoint_layout(out, findings)
    assert findings == []
    tensors = load_file(out / "model-00001-of-00001.safetensors")
    trained = {  # module -> (weight amax, input amax) the export was given
        "model.layers.0.mlp.experts.0.gate_proj": (3.0, 12.0), "model.layers.0.mlp.experts.0.up_proj": (5.0, 12.0),
        "model.layers.0.mlp.experts.1.down_proj": (1.0, 8.0),  # 4-over-6 weights and inputs
        "model.layers.0.self_attn.k_proj": (1.0, 20.0),  # 4-over-6 weights, plain NVFP4 inputs
    }
    for module, amaxes in trained.items():
        rule = layout.format_rule(module)
        for role, want in zip(("weight_scale", "input_scale"), amaxes, strict=True):
            t = rule.role(role)
            got = t.amax(tensors[f"{module}.{t.suffix}"].item())
            assert got == pytest.approx(want, rel=1e-6), (module, role, got)
    assert layout.four_over_six_inputs == {f"model.layers.0.mlp.experts.{e}.{p}_proj" for e in range(2)
                                           for p in ("gate", "up", "down")}
    assert "model.layers.0.self_attn.o_proj" in layout.four_over_six_weights


def test_a_malformed_four_over_six_marker_is_a_finding_naming_the_key(tmp_path):
    import json

    from modelopt_moe.export.check import check_checkpoint

    out = _export(tmp_path / "ckpt", "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["nvfp4_four_over_six"]["weights"] = "re:.*"
    (out / "config.json").write_text(json.dumps(config))
    report = check_checkpoint(out, "vllm")
    bad = [f for f in report.errors if f.where == "quantization_config.nvfp4_four_over_six"]
    assert len(bad) == 1, report.errors
    assert "'weights': 're:.*'" in bad[0].message, bad[0].message


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_a_weights_only_four_over_six_export_is_marked_and_checked_with_the_1536_bound(tmp_path, fmt):
    import json

    from modelopt_moe.export.check import check_checkpoint

    out = _export(tmp_path / "ckpt", fmt, experts=ATTENTION)  # 4-over-6 weights, plain NVFP4 inputs everywhere
    marker = json.loads((out / "config.json").read_text())["quantization_config"]["nvfp4_four_over_six"]
    assert marker["input_activations"] == [], marker
    assert marker["engine_settings"] == {}, marker
    report = check_checkpoint(out, "vllm")
    gate_up = [f.message for f in report.errors if "weight_scale amax" in f.message]
    assert len(gate_up) == 1, report.errors
    assert "weight_scale amax 3 != 5:" in gate_up[0], gate_up
