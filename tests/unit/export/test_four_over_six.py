"""Export of NVFP4 with 4-over-6 block scales (modelopt_moe/export/four_over_six.py and the NVFP4 codec): a Qwen3-MoE
checkpoint whose experts have 4-over-6 weights and inputs and whose attention has 4-over-6 weights with plain NVFP4
inputs, written in both file formats, read back by transformers + compressed-tensors (compressed-tensors) and by
Model Optimizer's formula (modelopt) to exactly the trained 4-over-6 fake quant; the configs carry the engine setting
where the readers accept it, the card and a warning say it, the checker passes it, and a failure writes nothing."""

import json
import re

import pytest
import torch

from modelopt_moe.export import ExportError, codecs, get_family
from modelopt_moe.export.families import MoEArch, canonical_names, canonical_shapes
from modelopt_moe.export.four_over_six import ENGINE_SETTINGS, MARKER_KEY
from modelopt_moe.export.hf_checkpoint import LinearRecord, TensorRecord, write_hf_checkpoint
from modelopt_moe.export.schemes import LinearQuant, QuantSpec
from modelopt_moe.numerics.nvfp4 import NVFP4, NVFP4_FOUR_OVER_SIX

ARCH = MoEArch(family="qwen3_moe", vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=2,
               num_kv_heads=1, head_dim=16, moe_ffn_hidden_size=16, num_experts=2, top_k=1, norm_eps=1e-6,
               rope_theta=1e4, max_position_embeddings=32, qk_norm=True)
FOS, PLAIN = QuantSpec("nvfp4_four_over_six"), QuantSpec("nvfp4")
EXPERTS = LinearQuant(FOS, FOS)  # NVFP4_4O6
ATTENTION = LinearQuant(FOS, PLAIN)  # NVFP4_4O6_WEIGHTS: fully standard


def _shared(name: str) -> str:
    """The linears that share their amaxes, as the adapter exports them (the engines fuse gate and up, and q, k, v)."""
    return name.replace(".up", ".gate") if ".experts." in name else re.sub(r"[kv]_proj$", "q_proj", name)


def _records(nan_at: str | None = None):
    g = torch.Generator().manual_seed(0)
    shapes, records = canonical_shapes(ARCH), []
    tensors = {name: torch.randn(shapes[name], generator=g) * (0.01 * (i + 1))  # a distinct scale per tensor
               for i, name in enumerate(canonical_names(ARCH))}
    amax: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        amax[_shared(name)] = torch.maximum(amax.get(_shared(name), torch.tensor(0.0)), t.abs().amax())
    for name, t in tensors.items():
        if name == nan_at:
            t[0, 0] = float("nan")
        quant = EXPERTS if ".experts." in name else ATTENTION if name.endswith(("q_proj", "k_proj", "v_proj",
                                                                                "o_proj")) else None
        if quant is not None:
            records.append(LinearRecord(name, t, quant, amax[_shared(name)], torch.tensor(2.0 + len(_shared(name)))))
        elif t.dim() == 2 and name != "embed_tokens":
            records.append(LinearRecord(name, t))
        else:
            records.append(TensorRecord(name, t))
    return records


def _export(out, fmt, records):
    quants = {r.canonical: r.quant for r in records if isinstance(r, LinearRecord)}
    return write_hf_checkpoint(out, arch=ARCH, family=get_family("qwen3_moe"), fmt=fmt, linear_quants=quants,
                               groups=[("all", records)], num_groups=1, dtype=torch.float32, progress=False)


def _trained(records) -> dict[str, torch.Tensor]:
    """Hugging Face module -> the trained 4-over-6 fake-quantized weight."""
    fam = get_family("qwen3_moe")
    return {fam.hf_module(r.canonical): NVFP4_FOUR_OVER_SIX.fake_quant(r.weight, r.weight_amax)
            for r in records if isinstance(r, LinearRecord) and r.quant.weight is not None}


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_four_over_six_checkpoint_decodes_to_the_trained_weights_and_says_the_engine_setting(tmp_path, fmt):
    from safetensors.torch import load_file

    from modelopt_moe.export.check import check_checkpoint

    records = _records()
    with pytest.warns(UserWarning, match=re.escape("FLASHINFER_NVFP4_4OVER6=1")) as caught:
        out = _export(tmp_path / "ckpt", fmt, records)
    warning = next(str(w.message) for w in caught if "4-over-6" in str(w.message))
    assert "12 linears (e.g. model.layers.0.mlp.experts.0.gate_proj)" in warning  # 2 layers x 2 experts x 3
    assert "nvfp4_4over6" in warning
    tensors = load_file(out / "model-00001-of-00001.safetensors")
    trained, worst = _trained(records), 0
    for module, want in trained.items():
        if fmt == "modelopt":  # Model Optimizer's formula is training's: bit for bit
            got = codecs.decode_nvfp4_modelopt(tensors[module + ".weight"], tensors[module + ".weight_scale"],
                                               tensors[module + ".weight_scale_2"], torch.float32)
            assert torch.equal(got, want), module
        else:
            got = codecs.decode_nvfp4_ct(tensors[module + ".weight_packed"], tensors[module + ".weight_scale"],
                                         tensors[module + ".weight_global_scale"], torch.float32)
            worst = max(worst, int((got.view(torch.int32).long() - want.view(torch.int32).long()).abs().max()))
    assert worst <= 2  # compressed-tensors' reciprocal global scale: within 2 fp32 ulps (docs/export.md)
    # input scales: 4-over-6 experts' normalized to 256, the attention's plain NVFP4
    scale = "input_scale" if fmt == "modelopt" else "input_global_scale"
    expert_in = tensors[f"model.layers.0.mlp.experts.0.gate_proj.{scale}"].reshape(())
    attn_in = tensors[f"model.layers.0.self_attn.q_proj.{scale}"].reshape(())
    rec = {r.canonical: r for r in records}
    want_expert = rec["layers.0.experts.0.gate"].input_amax / NVFP4_FOUR_OVER_SIX.bound
    want_attn = rec["layers.0.q_proj"].input_amax / NVFP4.bound
    if fmt == "modelopt":
        assert torch.equal(expert_in, want_expert)
        assert torch.equal(attn_in, want_attn)
    else:
        assert torch.equal(expert_in, codecs.reciprocal(want_expert))
        assert torch.equal(attn_in, codecs.reciprocal(want_attn))
    # the marker: where the readers accept an unknown key, naming the 4-over-6 inputs and the engine setting
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    marker = config[MARKER_KEY]
    assert marker["input_activations"] == [r"re:^model\.layers\.\d+\.mlp\.experts($|\.)"]
    assert "model.layers.0.self_attn.q_proj" in marker["weights"]
    assert marker["engine_settings"] == ENGINE_SETTINGS
    assert marker["block_scale_max"] == 256
    card = (out / "README.md").read_text()
    assert "## Serving setting: 4-over-6 activations" in card
    assert "FLASHINFER_NVFP4_4OVER6=1" in card
    if fmt == "modelopt":
        hf_quant = json.loads((out / "hf_quant_config.json").read_text())
        assert hf_quant[MARKER_KEY] == marker
        layers = hf_quant["quantization"]["quantized_layers"]
        assert {e["quant_algo"] for e in layers.values()} == {"NVFP4"}  # plain NVFP4 to every reader
        assert "`input_scale` fp32 = input amax / 1536" in card
    else:
        from compressed_tensors.quantization import QuantizationConfig

        QuantizationConfig.model_validate(config)  # compressed-tensors' own schema takes the config as written
        assert {g["format"] for g in config["config_groups"].values()} == {"nvfp4-pack-quantized"}
        _check_transformers_reads(out, trained)
    report = check_checkpoint(out, "vllm")
    assert report.errors == [], report.errors


def _check_transformers_reads(out, trained):
    """Loads the checkpoint with transformers 5.23 + compressed-tensors (experts with the documented fix): every
    4-over-6 weight within 1 bf16 ulp of the trained fake quant (compressed-tensors decodes NVFP4 to bf16)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from modelopt_moe.export import transformers_compat

    with transformers_compat.fix_nvfp4_experts():
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))

    def ulps(got, want):
        return int((got.detach().bfloat16().view(torch.int16).int() - want.bfloat16().view(torch.int16).int())
                   .abs().max())

    worst = 0
    for L, layer in enumerate(model.model.layers):
        worst = max(worst, ulps(layer.self_attn.q_proj.weight, trained[f"model.layers.{L}.self_attn.q_proj"]))
        for e in range(ARCH.num_experts):
            n = f"model.layers.{L}.mlp.experts.{e}."
            experts = layer.mlp.experts
            worst = max(worst, ulps(experts.gate_up_proj[e, :16], trained[n + "gate_proj"]),
                        ulps(experts.gate_up_proj[e, 16:], trained[n + "up_proj"]),
                        ulps(experts.down_proj[e], trained[n + "down_proj"]))
    assert worst <= 1


def test_plain_nvfp4_inputs_need_no_engine_setting(tmp_path):
    records = [r if not isinstance(r, LinearRecord) or r.quant != EXPERTS else
               LinearRecord(r.canonical, r.weight, ATTENTION, r.weight_amax, r.input_amax) for r in _records()]
    out = _export(tmp_path / "ckpt", "compressed-tensors", records)
    marker = json.loads((out / "config.json").read_text())["quantization_config"][MARKER_KEY]
    assert marker["input_activations"] == [], marker  # the weights, for readers of amaxes
    assert marker["engine_settings"] == {}, marker
    assert marker["weights"]
    assert "4-over-6 activations" not in (out / "README.md").read_text()


def test_a_nan_weight_aborts_the_export_leaving_nothing(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(ExportError, match=r"model\.layers\.1\.mlp\.experts\.1\.down_proj\.weight"):
        _export(out, "modelopt", _records(nan_at="layers.1.experts.1.down"))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_the_engine_side_four_over_six_input_rounds_as_training_under_the_same_scale():
    from modelopt_moe.export.engine_forward import nvfp4_four_over_six_static_input, nvfp4_static_input

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-2, 2, 64).unsqueeze(1)
    x[3, :16] = 0.0
    # gs = 1536 / amax = 1: the engine's gs * blockmax / d and training's blockmax / d / sg are the same number
    got = nvfp4_four_over_six_static_input(x, torch.tensor(1.0))
    assert torch.equal(got, NVFP4_FOUR_OVER_SIX.fake_quant(x, torch.tensor(NVFP4_FOUR_OVER_SIX.bound)))
    assert not torch.equal(got, nvfp4_static_input(x, torch.tensor(1.0)))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_the_engine_order_forward_runs_the_marked_inputs_with_four_over_six(tmp_path, fmt):
    from safetensors.torch import load_file

    from modelopt_moe.export.engine_forward import (
        engine_order_model,
        nvfp4_four_over_six_static_input,
        nvfp4_static_input,
    )

    out = _export(tmp_path / "ckpt", fmt, _records())
    tensors = load_file(out / "model-00001-of-00001.safetensors")
    model = engine_order_model(out)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    for module, quant in (("model.layers.1.mlp.experts.1.gate_proj", nvfp4_four_over_six_static_input),
                          ("model.layers.1.self_attn.q_proj", nvfp4_static_input)):
        linear = model.get_submodule(module)
        stored = tensors[module + (".input_global_scale" if fmt == "compressed-tensors" else ".input_scale")]
        gs = stored if fmt == "compressed-tensors" else 1.0 / stored
        with torch.no_grad():
            assert torch.equal(linear(x), torch.nn.functional.linear(quant(x, gs), linear.weight)), module
