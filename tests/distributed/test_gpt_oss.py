"""gpt-oss (``GptOssForCausalLM``) end to end, as a user's script does it.

A tiny random checkpoint written by ``transformers`` 5.23 from the shipped ``configs/gpt_oss_tiny.json``: biases on
q/k/v/o, the router and the experts, a learnable attention sink per head, alternating sliding-window (4 tokens) and
full layers, the clamped SwiGLU (``swiglu_limit`` 7, biting: the fused ``gate_up_proj`` is scaled up), YaRN without
truncation, experts stored fused as 3-D tensors (``gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved).
One spawn of 4 gloo ranks builds the Megatron model and loads it at TP1 x EP1 and TP2 x EP2 (expert-TP 1):

* the fp32 Megatron model's logits equal transformers' within 2e-5 of the largest logit at both layouts (and the
  clamp and the windows change transformers' logits far beyond that, so both are exercised);
* ``export_hf(format="hf")`` gives back every tensor of the source bit for bit, and its config;
* the model has the family's pieces (sinks, biases, the clamped GLU with its +1 offset, the sliding windows, YaRN);
* expert biases with expert-TP > 1 are refused naming the layout; quantized fused experts are refused at export in
  compressed-tensors (no file written; their one quantized layout is MXFP4's, ``test_gpt_oss_mxfp4.py``); with the
  experts' quantizers disabled, the FP8 compressed-tensors export (the attention's linears) loads in transformers and
  gives the Megatron weight-only fake-quant model's logits.
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


def _save(path: Path) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**tiny_config("gpt_oss_tiny.json")))
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                t.add_(torch.randn_like(t) * 0.1)
            if name.endswith("gate_up_proj"):  # pre-activations beyond swiglu_limit: the clamp bites
                t.copy_(torch.randn_like(t) * 0.5)
    model.to(torch.bfloat16)
    model.save_pretrained(path)


def _rank(rank, world_size, src, out):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import ExportError, build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()  # not enable_cpu_megatron(): the sliding-window mask must run on the CPU without its torch mode

    tokens, _, _, logits = rank_inputs(VOCAB)

    res = {"tokens": tokens}
    for tp, ep in LAYOUTS:
        # expert biases need expert-TP 1 (Megatron's default is the TP size)
        model = import_at_layout(src, out, tp, ep, logits, res, expert_tensor_parallel_size=1)
        if (tp, ep) == (1, 1):  # add_bias_linear alone biases linear_qkv too: the same model, read as such
            plain = build_megatron_model(src, params_dtype=torch.float32, add_qkv_bias=False)
            import_hf(plain, src)
            res["bias_linear_only"] = torch.equal(logits(plain.eval()), res["logits_tp1_ep1"])
        if (tp, ep) == (2, 2):
            c, layers = model.config, model.decoder.layers
            attn = [layer.self_attention for layer in layers]
            experts = layers[0].mlp.experts.local_experts
            res["pieces"] = {
                "sinks": [a.core_attention.softmax_offset is not None for a in attn],
                "softmax_type": c.softmax_type,
                "windows": [a.core_attention.scale_mask_softmax.window_size for a in attn],
                "qkv_bias": attn[0].linear_qkv.bias is not None, "o_bias": attn[0].linear_proj.bias is not None,
                "router_bias": layers[0].mlp.router.bias is not None,
                "expert_bias": (experts[0].linear_fc1.bias is not None, experts[0].linear_fc2.bias is not None),
                "glu": (c.gated_linear_unit, c.activation_func.__name__, c.glu_linear_offset,
                        c.activation_func_clamp_value),
                "rope": type(model.rotary_pos_emb).__name__,
            }
            mtq.quantize(model, mtq.load_config("fp8_default.yaml"), lambda m: logits(m))
            try:
                export_hf(model, Path(out) / "fp8_experts", format="compressed-tensors", progress=False)
            except ExportError as e:
                res["fp8_error"] = str(e)
            mtq.disable_quantizer(model, "*experts*")  # the attention's linears in FP8, the experts as they are
            export_hf(model, Path(out) / "fp8", format="compressed-tensors", dtype=torch.bfloat16, progress=False)
            mtq.disable_quantizer(model, "*input_quantizer")  # transformers runs weight-only
            res["logits_fp8"] = logits(model)
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    try:
        build_megatron_model(src, params_dtype=torch.float32)
    except ExportError as e:
        res["etp_error"] = str(e)
    parallel_state.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt_oss")
    _save(base / "src")
    results = spawn(_rank, WORLD, args=(str(base / "src"), str(base / "out")), timeout=seconds(900))
    return base, results[0]


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_megatron_logits_match_transformers(run, tp, ep):
    base, r = run
    ref = hf_logits(base / "src", r["tokens"])
    diff = (r[f"logits_tp{tp}_ep{ep}"] - ref).abs().max().item()
    print(f"TP{tp} x EP{ep}: logits max |Megatron - transformers| = {diff:.3g} (largest {ref.abs().max():.3g})")
    assert diff <= 2e-5 * ref.abs().max().item()


def test_the_clamp_and_the_windows_change_the_logits(run):
    """Without the clamp or the windows transformers' logits move far beyond the tolerance: the match tests both."""
    base, r = run
    ref = hf_logits(base / "src", r["tokens"])
    for change in ({"swiglu_limit": 1e9}, {"layer_types": ["full_attention"] * 3}):
        other = hf_logits(base / "src", r["tokens"], **change)
        assert (other - ref).abs().max().item() > 100 * 2e-5 * ref.abs().max().item(), change


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_hf_export_is_the_source_bit_for_bit(run, tp, ep):
    base, _ = run
    source, exported = tensors(base / "src"), tensors(base / "out" / f"hf_tp{tp}_ep{ep}")
    assert sorted(exported) == sorted(source)
    assert source["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    for name, t in source.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name
    cfg = json.loads((base / "out" / f"hf_tp{tp}_ep{ep}" / "config.json").read_text())
    src_cfg = json.loads((base / "src" / "config.json").read_text())
    for key in ("attention_bias", "swiglu_limit", "swiglu_alpha", "sliding_window", "layer_types",
                "num_local_experts", "intermediate_size", "rope_parameters"):
        assert cfg[key] == src_cfg[key], key


def test_the_megatron_model_has_the_family_pieces(run):
    p = run[1]["pieces"]
    assert p["sinks"] == [True, True, True]
    assert p["softmax_type"] == "learnable"
    assert p["windows"] == [(3, 0), None, (3, 0)]  # sliding_window 4: the query and the 3 keys before it
    assert (p["qkv_bias"], p["o_bias"], p["router_bias"]) == (True, True, True)
    assert p["expert_bias"] == (True, True)
    assert p["glu"] == (True, "quick_gelu", 1.0, 7.0)
    assert p["rope"] == "YarnRotaryEmbedding"


def test_a_model_built_with_add_bias_linear_alone_imports(run):
    assert run[1]["bias_linear_only"]


def test_expert_biases_with_expert_tp_are_refused(run):
    assert "expert tensor parallel size 2 with expert biases" in run[1]["etp_error"]
    assert "(layout TP 1 x EP 2 x expert-TP 2)" in run[1]["etp_error"]
    assert "expert_tensor_parallel_size=1" in run[1]["etp_error"]


def test_quantized_fused_experts_are_refused_at_export(run):
    base, r = run
    assert ("decoder.layers.0.mlp.experts.linear_fc1: quantized experts stored fused as 3-D tensors (gpt_oss) "
            "export only as MXFP4 weights in the published layout (format='hf-mxfp4', got "
            "format='compressed-tensors'") in r["fp8_error"]
    assert not (base / "out" / "fp8_experts").exists()  # refused before anything is written


def test_fp8_attention_export_loads_in_transformers(run):
    """Experts unquantized, the attention's linears FP8: transformers reads it and gives our weight-only logits."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    base, r = run
    path = base / "out" / "fp8"
    t = tensors(path)
    assert t["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.1.self_attn.q_proj.bias"].dtype == torch.bfloat16
    assert t["model.layers.1.self_attn.sinks"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    ref = hf_logits(path, r["tokens"], quantization_config=CompressedTensorsConfig(dequantize=True))
    diff = (r["logits_fp8"] - ref).abs().max().item()
    print(f"FP8 compressed-tensors in transformers: logits max |Megatron fake quant - transformers| = {diff:.3g}")
    assert diff <= 2e-5 * ref.abs().max().item()
