"""GLM-4.5 MoE (``Glm4MoeForCausalLM``) end to end, as a user's script does it.

A tiny random checkpoint written by ``transformers`` 5.23 from the shipped ``configs/glm4_moe_tiny.json``: q/k/v biases,
per-head q/k norm, RoPE on half of each head (``partial_rotary_factor``), a dense first layer, a shared expert, the
sigmoid router with ``e_score_correction_bias`` (perturbed; transformers keeps it in fp32) and
``routed_scaling_factor``. One spawn of 4 gloo ranks builds the Megatron model and loads it at TP1 x EP1 and TP2 x EP2:

* the fp32 Megatron model's logits equal transformers' within 2e-5 of the largest logit at both layouts;
* ``export_hf(format="hf")`` gives back every tensor of the source bit for bit (the router bias in fp32);
* the model has the family's pieces (q/k/v bias, q/k norm, partial RoPE, a dense MLP first, shared experts, the
  expert bias, the sigmoid router);
* quantized to FP8 and exported in compressed-tensors format at TP2 x EP2, the checkpoint loads in transformers and
  gives the Megatron weight-only fake-quant model's logits;
* MTP layers are refused naming the field.
"""

import json
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn
from modelopt_moe.quantization.config import preset_path

WORLD = 4
LAYOUTS = ((1, 1), (2, 2))  # (TP, EP)
VOCAB = 256


def _config() -> dict:
    """The shipped tiny config, without the keys only a checkpoint carries."""
    cfg = json.loads(preset_path("glm4_moe_tiny.json").read_text())
    return {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}


def _save(path: Path) -> None:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**_config()))
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(".bias"):
                t.add_(torch.randn_like(t) * 0.1)
            elif "e_score_correction_bias" in name:
                t.copy_(torch.randn_like(t) * 0.05)
    model.to(torch.bfloat16)
    for layer in model.model.layers[1:]:  # as published GLM checkpoints store it (transformers loads it in fp32)
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    model.save_pretrained(path)


def _rank(rank, world_size, src, out):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]

    def logits(m):
        with torch.no_grad():
            return m(tokens, positions, causal, runtime_gather_output=True).float()

    res = {"tokens": tokens}
    for tp, ep in LAYOUTS:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
        model = build_megatron_model(src, params_dtype=torch.float32)
        import_hf(model, src)
        model.eval()
        res[f"logits_tp{tp}_ep{ep}"] = logits(model)
        export_hf(model, Path(out) / f"hf_tp{tp}_ep{ep}", format="hf", dtype=torch.bfloat16, progress=False,
                  hf_config=src if tp == 1 else None)  # the source's config as template: it must agree
        if (tp, ep) == (2, 2):
            layers = model.decoder.layers
            res["pieces"] = {
                "qkv_bias": layers[0].self_attention.linear_qkv.bias is not None,
                "qk_norm": type(layers[0].self_attention.q_layernorm).__name__,
                "rotary_dim": model.rotary_pos_emb.inv_freq.numel() * 2,
                "mlp": [type(layer.mlp).__name__ for layer in layers],
                "shared_experts": [getattr(layer.mlp, "shared_experts", None) is not None for layer in layers],
                "expert_bias": [getattr(getattr(layer.mlp, "router", None), "expert_bias", None) is not None
                                for layer in layers],
                "router": (model.config.moe_router_score_function, model.config.moe_router_topk_scaling_factor),
            }

            def calibrate(m):
                with torch.no_grad():
                    for b in range(2):
                        m(tokens.roll(b + 1, dims=1), positions, causal)

            mtq.quantize(model, mtq.load_config("fp8_default.yaml"), calibrate)
            export_hf(model, Path(out) / "fp8", format="compressed-tensors", dtype=torch.bfloat16, progress=False)
            mtq.disable_quantizer(model, "*input_quantizer")  # transformers runs weight-only
            res["logits_fp8"] = logits(model)
        parallel_state.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("glm4_moe")
    _save(base / "src")
    results = spawn(_rank, WORLD, args=(str(base / "src"), str(base / "out")), timeout=seconds(900))
    return base, results[0]


def _hf_logits(path, tokens, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_megatron_logits_match_transformers(run, tp, ep):
    base, r = run
    ref = _hf_logits(base / "src", r["tokens"])
    diff = (r[f"logits_tp{tp}_ep{ep}"] - ref).abs().max().item()
    print(f"TP{tp} x EP{ep}: logits max |Megatron - transformers| = {diff:.3g} (largest {ref.abs().max():.3g})")
    assert diff <= 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_hf_export_is_the_source_bit_for_bit(run, tp, ep):
    base, _ = run
    source, exported = _tensors(base / "src"), _tensors(base / "out" / f"hf_tp{tp}_ep{ep}")
    assert sorted(exported) == sorted(source)
    assert source["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    for name, t in source.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name
    cfg = json.loads((base / "out" / f"hf_tp{tp}_ep{ep}" / "config.json").read_text())
    src_cfg = json.loads((base / "src" / "config.json").read_text())
    for key in ("attention_bias", "use_qk_norm", "n_group", "topk_group", "routed_scaling_factor",
                "first_k_dense_replace", "n_shared_experts", "n_routed_experts", "intermediate_size",
                "moe_intermediate_size", "num_nextn_predict_layers"):
        assert cfg[key] == src_cfg[key], key
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5


def test_the_megatron_model_has_the_family_pieces(run):
    p = run[1]["pieces"]
    assert p["qkv_bias"]
    assert p["qk_norm"] == "RMSNorm"
    assert p["rotary_dim"] == 8  # half of head_dim 16
    assert p["mlp"] == ["MLP", "MoELayer", "MoELayer"]
    assert p["shared_experts"] == [False, True, True]
    assert p["expert_bias"] == [False, True, True]
    assert p["router"] == ("sigmoid", 2.5)


def test_fp8_export_loads_in_transformers(run):
    from transformers.utils.quantization_config import CompressedTensorsConfig

    base, r = run
    path = base / "out" / "fp8"
    t = _tensors(path)
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.1.self_attn.q_proj.bias"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == torch.float8_e4m3fn
    ref = _hf_logits(path, r["tokens"], quantization_config=CompressedTensorsConfig(dequantize=True))
    diff = (r["logits_fp8"] - ref).abs().max().item()
    print(f"FP8 compressed-tensors in transformers: logits max |Megatron fake quant - transformers| = {diff:.3g}")
    assert diff <= 2e-5 * ref.abs().max().item()


def test_mtp_layers_are_refused_naming_the_field():
    from transformers import Glm4MoeConfig

    from modelopt_moe.export import ExportError, get_family

    cfg = Glm4MoeConfig(**_config()).to_dict()
    cfg["num_nextn_predict_layers"] = 1
    with pytest.raises(ExportError, match="num_nextn_predict_layers=1"):
        get_family("glm4_moe").arch_from_hf(cfg)
