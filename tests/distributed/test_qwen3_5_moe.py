"""Qwen3.5 MoE (``Qwen3_5MoeForCausalLM``) end to end, as a user's script does it.

A tiny random checkpoint written by ``transformers`` 5.23 from the shipped ``configs/qwen3_5_moe_tiny.json``: three
Gated DeltaNet layers then a gated attention layer (``layer_types``), per-head q/k norm, RoPE on a quarter of each head
(interleaved MRoPE, plain RoPE for text), RMSNorms that scale by ``1 + weight`` and the Gated DeltaNet's gated output
norm that scales by ``weight`` (all perturbed), a shared expert with its sigmoid gate, value heads grouped on key heads
(4 on 2). One spawn of 4 gloo ranks builds the
Megatron model (Megatron-Core's ``GatedDeltaNet`` on its torch path, the local spec) and loads it at TP1 x EP1 and
TP2 x EP2:

* the fp32 Megatron model's logits equal transformers' within 2e-5 of the largest logit at both layouts, on 16 tokens
  and on 80 (past the delta rule's 64-token chunk);
* ``export_hf(format="hf")`` gives back every tensor of the source bit for bit, and its config;
* the model has the family's pieces (Gated DeltaNet and gated attention layers, zero-centred norms, the plain gated
  output norm, the shared expert's gate, partial RoPE);
* quantized to FP8 (every linear but the router and the shared expert's gate) and exported in compressed-tensors format
  at TP2 x EP2, the checkpoint loads in transformers and gives the Megatron weight-only fake-quant model's logits;
  saved with ``save_sharded_checkpoint`` at TP2 x EP2, it loads at TP1 x EP4 with the same logits;
* every shipped preset quantizes it (the Gated DeltaNet's projections too) and leaves the router and the shared
  expert's gate alone;
* Transformer Engine's spec and the published vision-language checkpoints are refused naming why.
"""

import json
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402
from megatron_harness.hf_families import hf_logits, import_at_layout, rank_inputs, tensors, tiny_config

from modelopt_moe.launch import spawn

WORLD = 4
LAYOUTS = ((1, 1), (2, 2))  # (TP, EP)
VOCAB = 256
PRESETS = ("fp8_default.yaml", "fp8_experts.yaml", "fp8_per_expert.yaml", "int4_blockwise_weight_only.yaml",
           "int8_default.yaml", "nvfp4_default.yaml", "nvfp4_experts.yaml")


def _save(path: Path) -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**tiny_config("qwen3_5_moe_tiny.json")))
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name or "dt_bias" in name:  # zero-centred norms start at 0, the gated norm at 1
                t.add_(torch.randn_like(t) * 0.1)
    model.to(torch.bfloat16).save_pretrained(path)


def _long_inputs():
    torch.manual_seed(2)
    tokens = torch.randint(0, VOCAB, (2, 80))
    causal = torch.triu(torch.ones(80, 80, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, torch.arange(80).expand(2, 80), causal


def _rank(rank, world_size, src, out):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import ExportError, build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims
    from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

    apply_cpu_shims()
    tokens, positions, causal, logits = rank_inputs(VOCAB)
    long_tokens, long_positions, long_causal = _long_inputs()

    res = {"tokens": tokens, "long_tokens": long_tokens}
    for tp, ep in LAYOUTS:
        model = import_at_layout(src, out, tp, ep, logits, res)
        with torch.no_grad():
            res[f"long_tp{tp}_ep{ep}"] = model(long_tokens, long_positions, long_causal,
                                               runtime_gather_output=True).float()
        if (tp, ep) == (2, 2):
            layers = model.decoder.layers
            res["pieces"] = {
                "attention": [type(layer.self_attention).__name__ for layer in layers],
                "output_gate": model.config.attention_output_gate,
                "linear_qkv_rows": layers[3].self_attention.linear_qkv.weight.shape[0],
                "norms": {type(n).__name__ for layer in layers for n in (layer.input_layernorm,
                                                                          layer.pre_mlp_layernorm)},
                "qk_norm": type(layers[3].self_attention.q_layernorm).__name__,
                "gated_norm": type(layers[0].self_attention.out_norm).__name__,
                "final_norm": type(model.decoder.final_layernorm).__name__,
                "shared_gate": [layer.mlp.shared_experts.gate_weight.shape for layer in layers],
                "rotary_dim": model.rotary_pos_emb.inv_freq.numel() * 2,
            }
            try:
                build_megatron_model(src, spec="te")
            except ExportError as e:
                res["te_error"] = str(e)

            def calibrate(m):
                with torch.no_grad():
                    for b in range(2):
                        m(tokens.roll(b + 1, dims=1), positions, causal)

            mtq.quantize(model, mtq.load_config("fp8_default.yaml"), calibrate)
            export_hf(model, Path(out) / "fp8", format="compressed-tensors", dtype=torch.bfloat16, progress=False)
            save_sharded_checkpoint(model, Path(out) / "ckpt")
            res["logits_fp8_w8a8"] = logits(model)
            mtq.disable_quantizer(model, "*input_quantizer")  # transformers runs weight-only
            res["logits_fp8"] = logits(model)

            res["presets"] = {}  # every shipped preset: the router and the shared expert's gate untouched
            for preset in PRESETS:
                m = build_megatron_model(src, params_dtype=torch.float32)
                import_hf(m, src)
                gate = m.decoder.layers[0].mlp.shared_experts.gate_weight.clone()
                mtq.quantize(m.eval(), mtq.load_config(preset), calibrate)
                quantizing = sorted({name.rsplit(".", 1)[0] for name, q in m.named_modules()
                                     if isinstance(q, TensorQuantizer) and q.is_quantizing})
                res["presets"][preset] = dict(
                    finite=bool(logits(m).isfinite().all()), quantizing=quantizing,
                    gate_kept=torch.equal(m.decoder.layers[0].mlp.shared_experts.gate_weight, gate))
        parallel_state.destroy_model_parallel()
    # the TP2 x EP2 checkpoint loads at TP1 x EP4
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=4)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    fresh = build_megatron_model(src, params_dtype=torch.float32)
    load_sharded_checkpoint(fresh, Path(out) / "ckpt")
    res["logits_fp8_resharded"] = logits(fresh.eval())
    parallel_state.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen3_5_moe")
    _save(base / "src")
    results = spawn(_rank, WORLD, args=(str(base / "src"), str(base / "out")), timeout=seconds(900))
    return base, results[0]


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_megatron_logits_match_transformers(run, tp, ep):
    base, r = run
    for tokens, key in ((r["tokens"], f"logits_tp{tp}_ep{ep}"), (r["long_tokens"], f"long_tp{tp}_ep{ep}")):
        ref = hf_logits(base / "src", tokens)
        diff = (r[key] - ref).abs().max().item()
        print(f"TP{tp} x EP{ep}, {tokens.shape[1]} tokens: logits max |Megatron - transformers| = {diff:.3g} "
              f"(largest {ref.abs().max():.3g})")
        assert diff <= 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_hf_export_is_the_source_bit_for_bit(run, tp, ep):
    base, _ = run
    source, exported = tensors(base / "src"), tensors(base / "out" / f"hf_tp{tp}_ep{ep}")
    assert sorted(exported) == sorted(source)
    for name, t in source.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name
    cfg = json.loads((base / "out" / f"hf_tp{tp}_ep{ep}" / "config.json").read_text())
    src_cfg = json.loads((base / "src" / "config.json").read_text())
    for key in ("architectures", "model_type", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "num_experts",
                "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim"):
        assert cfg[key] == src_cfg[key], key
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_the_megatron_model_has_the_family_pieces(run):
    p = run[1]["pieces"]
    assert p["attention"] == ["GatedDeltaNet"] * 3 + ["SelfAttention"]
    assert p["output_gate"]
    assert p["linear_qkv_rows"] == (2 * 4 + 2 * 2) * 16 // 2  # q, gate, k, v of TP 2's half of the groups
    assert p["norms"] == {"ZeroCenteredRMSNorm"}
    assert p["qk_norm"] == "ZeroCenteredRMSNorm"
    assert p["gated_norm"] == "GatedOutputNorm"
    assert p["final_norm"] == "ZeroCenteredRMSNorm"
    assert p["shared_gate"] == [torch.Size([1, 64])] * 4
    assert p["rotary_dim"] == 4  # a quarter of head_dim 16


def test_fp8_export_loads_in_transformers(run):
    """Every linear FP8 (the Gated DeltaNet's projections and the gated attention's included; the router and the
    shared expert's gate never), exported at TP2 x EP2: transformers reads it and gives our weight-only logits."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    base, r = run
    path = base / "out" / "fp8"
    t = tensors(path)
    for name in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_b", "linear_attn.out_proj"):
        assert t[f"model.layers.0.{name}.weight"].dtype == torch.float8_e4m3fn, name
    assert t["model.layers.3.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    for name in ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.conv1d"):
        assert t[f"model.layers.0.{name}.weight"].dtype == torch.bfloat16, name
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"} <= set(ignore)
    ref = hf_logits(path, r["tokens"], quantization_config=CompressedTensorsConfig(dequantize=True))
    diff = (r["logits_fp8"] - ref).abs().max().item()
    print(f"FP8 compressed-tensors in transformers: logits max |Megatron fake quant - transformers| = {diff:.3g}")
    assert diff <= 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_quantizes_it_and_leaves_the_gates_alone(run, preset):
    p = run[1]["presets"][preset]
    assert p["finite"]
    assert p["gate_kept"]
    assert not [m for m in p["quantizing"] if ".router" in m]
    assert "decoder.layers.0.mlp.experts.linear_fc1" in p["quantizing"]
    if "experts" not in preset:  # the default presets quantize every linear: the Gated DeltaNet's too
        for module in ("decoder.layers.0.self_attention.in_proj", "decoder.layers.0.self_attention.out_proj",
                       "decoder.layers.3.self_attention.linear_qkv", "decoder.layers.0.mlp.shared_experts.linear_fc1"):
            assert module in p["quantizing"], module


def test_the_quantized_checkpoint_reshards(run):
    r = run[1]
    diff = (r["logits_fp8_resharded"] - r["logits_fp8_w8a8"]).abs().max().item()
    print(f"FP8 W8A8 saved at TP2 x EP2, loaded at TP1 x EP4: logits max |diff| = {diff:.3g}")
    assert diff <= 2e-5 * r["logits_fp8_w8a8"].abs().max().item()  # another layout sums in another order


def test_transformer_engine_spec_is_refused_naming_why(run):
    assert "spec='te' for qwen3_5_moe (Gated DeltaNet layers) is not supported" in run[1]["te_error"]
    assert "expected spec='local'" in run[1]["te_error"]


def test_published_vision_language_checkpoints_are_refused_naming_why():
    from modelopt_moe.export import ExportError
    from modelopt_moe.export.families import family_for_architecture

    with pytest.raises(ExportError, match=r"architectures=\['Qwen3_5MoeForConditionalGeneration'\] "
                                          r"\(model_type='qwen3_5_moe'\) is not supported: the published Qwen3.5 MoE "
                                          r"checkpoints .* hold a vision tower"):
        family_for_architecture({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"})
