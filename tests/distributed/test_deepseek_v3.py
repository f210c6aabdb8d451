"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, also Kimi-K2's architecture) end to end, as a user's script does it.

A tiny random checkpoint written by ``transformers`` 5.23 from the shipped ``configs/deepseek_v3_tiny.json``, with every
feature of the family on: multi-latent attention
(query and key/value LoRA ranks, decoupled RoPE, interleaved), a dense first layer (``first_k_dense_replace``), a
shared expert, the sigmoid router with ``e_score_correction_bias`` (perturbed, so it changes the choice), group-limited
top-k (``n_group`` / ``topk_group``) and ``routed_scaling_factor``. One spawn of 4 gloo ranks builds the Megatron
model with ``build_megatron_model`` and loads it with ``import_hf`` at TP1 x EP1, TP2 x EP2 and TP4 x EP1:

* the fp32 Megatron model's logits equal transformers' within 2e-5 of the largest logit at every layout;
* ``export_hf(format="hf")`` gives back every tensor of the source, bit for bit, at every layout;
* the model has the family's pieces (multi-latent attention, a dense MLP first, shared experts, the expert bias, the
  sigmoid group-limited router), so that a plainer model cannot pass;
* every shipped preset quantizes it (the default ones also MLA's, the dense and the shared MLPs' linears) and leaves
  the routers and their expert bias alone;
* quantized to FP8 (routers and their bias left alone) and exported in compressed-tensors format at TP2 x EP2, the
  checkpoint loads in transformers and gives the Megatron weight-only fake-quant model's logits;
* quantized to NVFP4 and exported in compressed-tensors format, the checkpoint loads in transformers (with
  ``transformers_compat.fix_nvfp4_experts()``) and gives the Megatron weight-only fake-quant model's logits;
* the quantized model saved with ``save_sharded_checkpoint`` at TP2 x EP2 loads at TP4 x EP1 with the same logits;
* a checkpoint without query compression (``q_lora_rank`` None) is refused by name: Megatron-Core's MLA would add a
  norm before its query projection;
* a checkpoint with YaRN rope scaling (DeepSeek-V3's form, ``mscale`` and ``mscale_all_dim``) gives transformers'
  logits at TP2 x EP2 and exports back bit for bit;
* configs the family cannot map (MTP layers, other rope scalings, a group score other than the top 2) are refused
  naming the field.
"""

import json
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn
from modelopt_moe.quantization.config import preset_path

WORLD = 4
LAYOUTS = ((1, 1), (2, 2), (4, 1))  # (TP, EP)
VOCAB = 256
PRESETS = ("fp8_default.yaml", "fp8_experts.yaml", "fp8_per_expert.yaml", "int4_blockwise_weight_only.yaml",
           "int8_default.yaml", "nvfp4_default.yaml", "nvfp4_experts.yaml")


def _config() -> dict:
    """The shipped tiny config (configs/deepseek_v3_tiny.json), without the keys only a checkpoint carries."""
    cfg = json.loads(preset_path("deepseek_v3_tiny.json").read_text())
    return {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's form


def _save(path: Path, **changes) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**_config(), **changes}))
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                t.add_(torch.randn_like(t) * 0.1)
            elif "e_score_correction_bias" in name:
                t.copy_(torch.randn_like(t) * 0.05)
    model.to(torch.bfloat16).save_pretrained(path)


def _rank(rank, world_size, src, out):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint
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
                "attention": [type(layer.self_attention).__name__ for layer in layers],
                "core_attention": type(layers[0].self_attention.core_attention).__name__,
                "mlp": [type(layer.mlp).__name__ for layer in layers],
                "shared_experts": [getattr(layer.mlp, "shared_experts", None) is not None for layer in layers],
                "expert_bias": [getattr(getattr(layer.mlp, "router", None), "expert_bias", None) is not None
                                for layer in layers],
                "router": (model.config.moe_router_score_function, model.config.moe_router_num_groups,
                           model.config.moe_router_group_topk, model.config.moe_router_topk_scaling_factor),
            }

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
        if (tp, ep) == (2, 2):  # every shipped preset: routers and their bias untouched, the rest as configured
            from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

            res["presets"] = {}
            for preset in PRESETS:
                m = build_megatron_model(src, params_dtype=torch.float32)
                import_hf(m, src)
                bias = m.decoder.layers[1].mlp.router.expert_bias.clone()
                mtq.quantize(m.eval(), mtq.load_config(preset), calibrate)
                quantizing = sorted({name.rsplit(".", 1)[0] for name, q in m.named_modules()
                                     if isinstance(q, TensorQuantizer) and q.is_quantizing})
                res["presets"][preset] = dict(
                    finite=bool(logits(m).isfinite().all()), quantizing=quantizing,
                    bias_kept=torch.equal(m.decoder.layers[1].mlp.router.expert_bias, bias))
        if (tp, ep) == (2, 2):  # NVFP4 (experts, shared expert, dense MLP and attention alike)
            nvfp4 = build_megatron_model(src, params_dtype=torch.float32)
            import_hf(nvfp4, src)
            mtq.quantize(nvfp4.eval(), mtq.load_config("nvfp4_default.yaml"), calibrate)
            export_hf(nvfp4, Path(out) / "nvfp4", format="compressed-tensors", dtype=torch.bfloat16, progress=False)
            mtq.disable_quantizer(nvfp4, "*input_quantizer")
            res["logits_nvfp4"] = logits(nvfp4)
        if (tp, ep) == (2, 2):  # no query compression (q_lora_rank None: one q_proj, as DeepSeek-V2-Lite)
            try:
                build_megatron_model(src + "_no_q_lora", params_dtype=torch.float32)
                res["no_q_lora"] = None
            except Exception as e:  # noqa: BLE001  (the test reports any other error)
                res["no_q_lora"] = f"{type(e).__name__}: {e}"
        if (tp, ep) == (2, 2):  # YaRN rope scaling
            yarn = build_megatron_model(src + "_yarn", params_dtype=torch.float32)
            import_hf(yarn, src + "_yarn")
            res["logits_yarn"] = logits(yarn.eval())
            res["yarn_rope"] = type(yarn.decoder.layers[0].self_attention.rotary_pos_emb).__name__
            export_hf(yarn, Path(out) / "hf_yarn", format="hf", dtype=torch.bfloat16, progress=False)
        if (tp, ep) == (4, 1):  # the TP2 x EP2 checkpoint loads at another layout
            fresh = build_megatron_model(src, params_dtype=torch.float32)
            load_sharded_checkpoint(fresh, Path(out) / "ckpt")
            res["logits_fp8_resharded"] = logits(fresh.eval())
        parallel_state.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("deepseek_v3")
    _save(base / "src")
    _save(base / "src_yarn", rope_parameters=YARN, max_position_embeddings=128)
    _save(base / "src_no_q_lora", q_lora_rank=None)
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
def test_megatron_logits_match_transformers_at_every_layout(run, tp, ep):
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
    for name, t in source.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name
    cfg = json.loads((base / "out" / f"hf_tp{tp}_ep{ep}" / "config.json").read_text())
    src_cfg = json.loads((base / "src" / "config.json").read_text())
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group",
                "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts",
                "n_routed_experts", "intermediate_size", "moe_intermediate_size", "num_nextn_predict_layers"):
        assert cfg[key] == src_cfg[key], key


def test_yarn_rope_scaling_matches_transformers(run):
    base, r = run
    assert r["yarn_rope"] == "YarnRotaryEmbedding"
    ref = _hf_logits(base / "src_yarn", r["tokens"])
    plain = _hf_logits(base / "src", r["tokens"])
    assert (ref - plain).abs().max() > 1e-3  # YaRN changes the model
    diff = (r["logits_yarn"] - ref).abs().max().item()
    print(f"YaRN, TP2 x EP2: logits max |Megatron - transformers| = {diff:.3g}")
    assert diff <= 2e-5 * ref.abs().max().item()
    source, exported = _tensors(base / "src_yarn"), _tensors(base / "out" / "hf_yarn")
    assert sorted(exported) == sorted(source)
    for name, t in source.items():
        assert torch.equal(exported[name], t), name
    cfg = json.loads((base / "out" / "hf_yarn" / "config.json").read_text())
    assert {k: cfg["rope_parameters"][k] for k in YARN} == YARN


def test_a_plain_query_projection_is_refused_by_name(run):
    """Megatron-Core 0.19's MLA with latent norms puts a norm into ``linear_q_proj`` when ``q_lora_rank`` is None
    (DeepSeek-V2-Lite's layout), which transformers' model does not have: refused before building."""
    assert run[1]["no_q_lora"].startswith("ExportError: build_megatron_model: q_lora_rank=None")


def test_the_megatron_model_has_the_family_pieces(run):
    p = run[1]["pieces"]
    assert p["attention"] == ["MLASelfAttention"] * 3
    assert p["core_attention"] == "LatentDotProductAttention"
    assert p["mlp"] == ["MLP", "MoELayer", "MoELayer"]
    assert p["shared_experts"] == [False, True, True]
    assert p["expert_bias"] == [False, True, True]
    assert p["router"] == ("sigmoid", 4, 2, 2.5)


def test_fp8_export_loads_in_transformers(run):
    from transformers.utils.quantization_config import CompressedTensorsConfig

    base, r = run
    path = base / "out" / "fp8"
    cfg = json.loads((path / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.gate" in ignore
    assert "lm_head" in ignore
    t = _tensors(path)
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    ref = _hf_logits(path, r["tokens"], quantization_config=CompressedTensorsConfig(dequantize=True))
    diff = (r["logits_fp8"] - ref).abs().max().item()
    print(f"FP8 compressed-tensors in transformers: logits max |Megatron fake quant - transformers| = {diff:.3g}")
    assert diff <= 2e-5 * ref.abs().max().item()


def _nvfp4_linears(t: dict, model):
    """(name, the transformers model's weight, the file's NVFP4 decoded in fp32 by the format's formula) per linear."""
    from modelopt_moe.export import codecs

    inter = model.config.moe_intermediate_size
    for name in [n.removesuffix(".weight_packed") for n in t if n.endswith(".weight_packed")]:
        w = codecs.decode_nvfp4_ct(t[name + ".weight_packed"], t[name + ".weight_scale"],
                                   t[name + ".weight_global_scale"], torch.float32)
        module, _, kind = name.rpartition(".")
        if ".experts." in name and ".shared_experts." not in name:  # fused [E, 2I, H] / [E, H, I] in memory
            experts, _, e = module.rpartition(".")
            fused = model.get_submodule(experts)
            rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}.get(kind, slice(None))
            yield name, (fused.down_proj if kind == "down_proj" else fused.gate_up_proj)[int(e)][rows], w
        else:
            yield name, model.get_submodule(name).weight, w


def test_nvfp4_export_loads_in_transformers(run):
    """With the public fix for its NVFP4 expert loader, transformers reads every linear as the format's value rounded
    once to bf16 (compressed-tensors decodes NVFP4 to bf16); the logits then differ from the fp32 fake-quant model's
    by that rounding, which the next test removes."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from modelopt_moe.export import transformers_compat

    base, r = run
    path = base / "out" / "nvfp4"
    t = _tensors(path)
    for module in ("mlp.experts.3.down_proj", "mlp.shared_experts.gate_proj", "self_attn.q_b_proj"):
        assert t[f"model.layers.1.{module}.weight_packed"].dtype == torch.uint8, module
    assert "model.layers.0.mlp.up_proj.weight_packed" in t
    with transformers_compat.fix_nvfp4_experts() as fix:  # transformers 5.23 mis-scales NVFP4 experts without it
        assert fix.applied, fix.note
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=
                                                     CompressedTensorsConfig(dequantize=True)).eval()
    for name, got, expected in _nvfp4_linears(t, model):
        assert torch.equal(got.detach().bfloat16(), expected.bfloat16()), name
    with torch.no_grad():
        ref = model(r["tokens"]).logits.float()
    diff = (r["logits_nvfp4"] - ref).abs()
    top1 = (r["logits_nvfp4"].argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"NVFP4 compressed-tensors in transformers (bf16 decode): logits max |diff| {diff.max():.3g}, mean "
          f"{diff.mean():.3g}, top-1 agreement {top1:.1%}")
    assert diff.mean() <= 5e-3 * ref.abs().max().item()  # measured 6e-4 of 0.6 (max 0.022: a near-tied expert flips)
    assert top1 >= 0.97


def test_nvfp4_file_decoded_in_fp32_gives_megatron_logits(run):
    """The file's every NVFP4 linear decoded with the format's formula in fp32, put into the transformers model."""
    from transformers import AutoModelForCausalLM

    base, r = run
    t = _tensors(base / "out" / "nvfp4")
    model = AutoModelForCausalLM.from_pretrained(base / "src", dtype=torch.float32).eval()
    with torch.no_grad():
        for _, weight, decoded in list(_nvfp4_linears(t, model)):
            weight.copy_(decoded)
        ref = model(r["tokens"]).logits.float()
    diff = (r["logits_nvfp4"] - ref).abs().max().item()
    print(f"NVFP4 file decoded in fp32 in transformers: logits max |Megatron fake quant - transformers| = {diff:.3g}")
    assert diff <= 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_quantizes_it_and_leaves_the_routers_alone(run, preset):
    p = run[1]["presets"][preset]
    assert p["finite"]
    assert p["bias_kept"]
    assert not [m for m in p["quantizing"] if ".router" in m]
    experts = "decoder.layers.1.mlp.experts.linear_fc1"
    assert experts in p["quantizing"]
    if "experts" not in preset:  # the default presets quantize every linear: MLA, dense and shared MLPs too
        for module in ("decoder.layers.0.self_attention.linear_kv_up_proj", "decoder.layers.0.mlp.linear_fc1",
                       "decoder.layers.1.mlp.shared_experts.linear_fc2"):
            assert module in p["quantizing"], module


def test_the_quantized_checkpoint_reshards(run):
    r = run[1]
    diff = (r["logits_fp8_resharded"] - r["logits_fp8_w8a8"]).abs().max().item()
    print(f"FP8 W8A8 saved at TP2 x EP2, loaded at TP4 x EP1: logits max |diff| = {diff:.3g}")
    assert diff <= 2e-5 * r["logits_fp8_w8a8"].abs().max().item()  # another layout sums in another order


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_nextn_predict_layers", 1, "num_nextn_predict_layers=1"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}, "plain RoPE or YaRN only"),
    ("rope_parameters", {**YARN, "attention_factor": 0.5}, r"rope_parameters.attention_factor=0.5"),
    ("topk_group", 1, "num_experts_per_tok=4 with topk_group=1"),
    ("rope_interleave", False, "rope_interleave=False"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
])
def test_unmapped_features_are_refused_naming_the_field(key, value, match):
    from transformers import DeepseekV3Config

    from modelopt_moe.export import ExportError, get_family

    cfg = DeepseekV3Config(**_config()).to_dict()
    cfg[key] = value
    with pytest.raises(ExportError, match=match):
        get_family("deepseek_v3").arch_from_hf(cfg)
