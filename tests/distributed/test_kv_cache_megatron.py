"""KV-cache QAT in Megatron's attention, as a training script uses it (gloo ranks; Model Optimizer's preset merge).

One spawn of 2 ranks at TP=2 (sequence parallel): a model preset merged with ``mtq.FP8_KV_CFG`` (or ``NVFP4_KV_CFG``)
puts ``k_bmm_quantizer`` / ``v_bmm_quantizer`` on every layer's core attention; the key they see is the key after
RoPE (recomputed by hand from the layer's input: the QKV projection, Megatron's split and ``apply_rotary_pos_emb``);
the core attention computes on exactly the reference fake quant of K and V with the calibrated amax; that amax is one
per layer, the max over the TP ranks' heads, the same on both ranks; one step of Megatron's schedule (bf16,
distributed optimizer) trains through it (the QKV weights move); the checkpoint is saved. A second spawn of 1 rank
at TP=1 loads it into a fresh model: every KV amax bit-exact.

The export half builds a Qwen3-MoE from a transformers checkpoint at TP=2, quantizes it with FP8 layers + FP8 KV and
with NVIDIA's recipe as one preset (``NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG``), records the fake-quant logits and exports
both formats: the engine-order forward from the files alone (K and V stored in FP8 with the exported scales) matches
those logits, transformers + compressed-tensors load the recipe's checkpoint, an NVFP4 KV cache is refused by the
engine-order forward.
"""

import json

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

SEED, BATCH, SEQ = 1234, 2, 32


def _config(mtq, kv_preset: str, model_preset: str = "FP8_DEFAULT_CFG"):
    cfg = dict(getattr(mtq, model_preset))
    cfg["quant_cfg"] = cfg["quant_cfg"] + getattr(mtq, kv_preset)["quant_cfg"]  # as Model Optimizer users merge
    return cfg


def _kv_amax(model):
    return {f"{i}.{k}": getattr(layer.self_attention.core_attention, k).amax.detach().clone()
            for i, layer in enumerate(model.decoder.layers) for k in ("k_bmm_quantizer", "v_bmm_quantizer")}


def _placement(model, batch):
    """Per layer: the core attention's key vs the key recomputed after RoPE, and its output vs Megatron's own
    ``DotProductAttention.forward`` on reference fake-quantized K and V."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from modelopt_moe.numerics import fake_quant

    seen = {}

    def attn_hook(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, {})["attn"] = (args, kwargs)
        return hook

    def core_hook(i):
        def hook(module, args, kwargs, output):
            seen[i]["core"] = (args, kwargs, output)
        return hook

    handles = []
    for i, layer in enumerate(model.decoder.layers):
        handles.append(layer.self_attention.register_forward_pre_hook(attn_hook(i), with_kwargs=True))
        handles.append(layer.self_attention.core_attention.register_forward_hook(core_hook(i), with_kwargs=True))
    model.eval()
    with torch.no_grad():
        from modelopt_moe.plugins.cli.evaluate import lm_loss

        lm_loss(model, batch)
        out = {}
        for i, layer in enumerate(model.decoder.layers):
            attn, core = layer.self_attention, layer.self_attention.core_attention
            (a_args, a_kwargs), (c_args, c_kwargs, c_out) = seen[i]["attn"], seen[i]["core"]
            hidden = a_args[0] if a_args else a_kwargs["hidden_states"]
            _, key, value = attn.get_query_key_value_tensors(hidden)
            rope = a_kwargs["rotary_pos_emb"]
            rope = rope if isinstance(rope, tuple) else (rope, rope)
            key_rope = apply_rotary_pos_emb(key, rope[1], config=attn.config)
            query, got_key, got_value = c_args[:3]
            fq_k = fake_quant(got_key, "e4m3", core.k_bmm_quantizer.amax)
            fq_v = fake_quant(got_value, "e4m3", core.v_bmm_quantizer.amax)
            ref = DotProductAttention.forward(core, query, fq_k, fq_v, *c_args[3:], **c_kwargs)
            out[i] = {"key_after_rope": torch.equal(got_key, key_rope),
                      "rope_moved_key": not torch.equal(key, key_rope),
                      "value": torch.equal(got_value, value), "quantized_attention": torch.equal(c_out, ref),
                      "unquantized_differs": not torch.equal(
                          c_out, DotProductAttention.forward(core, query, got_key, got_value, *c_args[3:],
                                                             **c_kwargs)),
                      "local_k_max": got_key.abs().amax().float()}
    for h in handles:
        h.remove()
    return out


def _tp2_worker(rank, world_size, root):
    import megatron_harness.models as mm
    import torch.distributed as dist
    from megatron.core import parallel_state

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import save_sharded_checkpoint
    from modelopt_moe.plugins.megatron.training import setup_training, train_step

    mm.init_model_parallel(2, 1, seed=SEED)
    calib = mm.text_batches(BATCH, SEQ, 2)
    out = {}
    for preset in ("FP8_KV_CFG", "NVFP4_KV_CFG"):
        model = mm.build_moe_gpt(seed=SEED)
        model.eval()
        mtq.quantize(model, _config(mtq, preset), lambda m: [mm.lm_loss(m, b) for b in calib])
        core = model.decoder.layers[0].self_attention.core_attention
        res = {"enabled": {k: getattr(core, k).is_enabled for k in ("q_bmm_quantizer", "k_bmm_quantizer",
                                                                   "v_bmm_quantizer")},
               "amax": _kv_amax(model)}
        if preset == "FP8_KV_CFG":
            res["placement"] = _placement(model, calib[0])
            # the calibrated amax is the max over TP ranks of what each rank's heads saw
            k_max = torch.stack([res["placement"][i]["local_k_max"] for i in sorted(res["placement"])])
            dist.all_reduce(k_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
            res["k_max_over_tp"] = k_max
            qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
            before = qkv.detach().clone()
            trainer = setup_training(model)
            res["loss"] = train_step(trainer, mm.text_batches(BATCH, SEQ, 2, offset=100))
            res["qkv_moved"] = not torch.equal(before, qkv.detach().float())
            res["amax_after_step"] = _kv_amax(model)
            save_sharded_checkpoint([trainer.model], root / "ckpt")
        out[preset] = res
    out["export"] = _export(root, calib)
    per_channel = _config(mtq, "FP8_KV_CFG")
    per_channel["quant_cfg"] = per_channel["quant_cfg"] + [
        {"quantizer_name": "*k_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": -1}}]
    model = mm.build_moe_gpt(seed=SEED)
    model.eval()
    try:
        mtq.quantize(model, per_channel, lambda m: [mm.lm_loss(m, b) for b in calib])
        out["per_channel"] = None
    except mtq.ConfigError as e:
        out["per_channel"] = str(e)
    mm.destroy_model_parallel()
    return out


def _export(root, calib):
    """A Qwen3-MoE (2 KV heads: one per TP rank) with FP8 layers and an FP8 KV cache, exported in both formats at
    TP=2; the refusals of what no checkpoint expresses."""
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import ExportError, build_megatron_model, export_hf, import_hf

    def calibrated(kv_preset, model_preset="FP8_DEFAULT_CFG"):
        m = build_megatron_model(root / "hf", perform_initialization=False, params_dtype=torch.float32)
        import_hf(m, root / "hf")
        m.eval()
        small = [{k: v % 128 if k in ("tokens", "labels") else v for k, v in b.items()} for b in calib]
        cfg = getattr(mtq, model_preset) if kv_preset is None else _config(mtq, kv_preset, model_preset)
        mtq.quantize(m, cfg, lambda model: [mm.gather_logits(model, b) for b in small])
        return m

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    m = calibrated("FP8_KV_CFG")
    res = {"amax": _kv_amax(m), "errors": {}, "tokens": tokens, "logits": {"one_scheme": _logits(m, tokens)}}
    for fmt in ("compressed-tensors", "modelopt"):
        export_hf(m, root / f"kv_{fmt}", format=fmt, progress=False)
    mixed = calibrated(None, "NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG")  # NVIDIA's recipe, one preset: a scheme per layer
    res["amax_mixed"] = _kv_amax(mixed)
    res["logits"]["scheme_per_layer"] = _logits(mixed, tokens)
    for fmt in ("compressed-tensors", "modelopt"):
        export_hf(mixed, root / f"kv_mixed_{fmt}", format=fmt, progress=False)
    nvfp4_kv = calibrated("NVFP4_KV_CFG")
    export_hf(nvfp4_kv, root / "kv_nvfp4_modelopt", format="modelopt", progress=False)
    mtq.enable_quantizer(m, "*q_bmm_quantizer")
    for key, model, fmt in (("query", m, "modelopt"), ("nvfp4_ct", nvfp4_kv, "compressed-tensors")):
        try:
            export_hf(model, root / f"refused_{key}", format=fmt, progress=False)
            res["errors"][key] = None
        except ExportError as e:
            res["errors"][key] = (str(e), (root / f"refused_{key}").exists())
    return res


def _logits(m, tokens):
    """The Megatron fake-quant model's full-vocabulary logits (causal mask, positions 0..seq-1), on every rank."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return m(tokens, positions, mask, runtime_gather_output=True).float()


def _tp1_worker(rank, world_size, root):
    import megatron_harness.models as mm

    from modelopt_moe.plugins.megatron import load_sharded_checkpoint

    mm.init_model_parallel(1, 1, seed=SEED)
    model = mm.build_moe_gpt(seed=SEED + 1)
    load_sharded_checkpoint([model], root / "ckpt")
    out = _kv_amax(model)
    mm.destroy_model_parallel()
    return out


def _make_hf(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
                         num_experts_per_tok=2, max_position_embeddings=64, norm_topk_prob=False)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # norms not all ones: no bf16 ratios that put an input exactly on an FP8 rounding midpoint
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    _make_hf(root / "hf")
    tp2 = spawn(_tp2_worker, 2, args=(root,), timeout=seconds(600))
    tp1 = spawn(_tp1_worker, 1, args=(root,), timeout=seconds(600))
    return tp2, tp1[0], root


@pytest.mark.parametrize("preset", ["FP8_KV_CFG", "NVFP4_KV_CFG"])
def test_kv_preset_merged_with_a_model_preset_quantizes_k_and_v_with_one_amax_per_layer_over_tp(runs, preset):
    tp2 = runs[0]
    for rank in tp2:
        assert rank[preset]["enabled"] == {"q_bmm_quantizer": False, "k_bmm_quantizer": True, "v_bmm_quantizer": True}
    amax0, amax1 = tp2[0][preset]["amax"], tp2[1][preset]["amax"]
    assert set(amax0) == {"0.k_bmm_quantizer", "0.v_bmm_quantizer", "1.k_bmm_quantizer", "1.v_bmm_quantizer"}
    for k in amax0:
        assert amax0[k].numel() == 1
        assert amax0[k] > 0
        assert torch.equal(amax0[k], amax1[k]), f"{k}: TP ranks disagree"


def test_k_is_quantized_after_rope_and_attention_runs_on_the_reference_fake_quant(runs):
    tp2 = runs[0]
    for rank in tp2:
        res = rank["FP8_KV_CFG"]
        for i, p in res["placement"].items():
            checks = {k: v for k, v in p.items() if k != "local_k_max"}
            assert all(checks.values()), f"layer {i}: {checks}"
            # the calibration batch included this one: the amax is at least what this rank saw, and it is what the
            # TP ranks saw together (max-reduced over TP)
            assert res["amax"][f"{i}.k_bmm_quantizer"] >= res["k_max_over_tp"][i]


def test_trains_through_megatrons_schedule_and_reshards_tp2_to_tp1_bit_exact(runs):
    tp2, tp1, _ = runs
    res = tp2[0]["FP8_KV_CFG"]
    assert res["qkv_moved"]
    assert res["loss"] == res["loss"]  # finite
    assert res["amax_after_step"].keys() == tp1.keys()
    for k, v in res["amax_after_step"].items():
        assert torch.equal(v, tp1[k]), f"{k}: {v} saved at TP2, {tp1[k]} loaded at TP1"
    assert all(torch.equal(res["amax"][k], v) for k, v in res["amax_after_step"].items())  # static KV amaxes


def _tensors(path):
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["one_scheme", "scheme_per_layer"])
@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_export_writes_the_kv_cache_config_and_per_layer_scales_the_engines_read(runs, fmt, mixed):
    """FP8 layers, or NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG's scheme per layer (compressed-tensors mixed-precision groups,
    Model Optimizer MIXED_PRECISION): the same KV-cache entries and scales."""
    import json

    tp2, _, root = runs
    amax = tp2[0]["export"]["amax_mixed" if mixed else "amax"]
    path = root / (f"kv_mixed_{fmt}" if mixed else f"kv_{fmt}")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    if mixed:
        assert qc["format" if fmt == "compressed-tensors" else "quant_algo"] == (
            "mixed-precision" if fmt == "compressed-tensors" else "MIXED_PRECISION")
    t = _tensors(path)
    if fmt == "compressed-tensors":
        assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                         "symmetric": True}
        names, shape = ("model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale"), (1,)
    else:
        assert qc["kv_cache_quant_algo"] == "FP8"
        hf_quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
        assert hf_quant["kv_cache_quant_algo"] == "FP8"
        names, shape = ("model.layers.{}.self_attn.k_proj.k_scale", "model.layers.{}.self_attn.v_proj.v_scale"), ()
    assert sorted(k for k in t if k.endswith(("k_scale", "v_scale"))) == sorted(
        n.format(L) for L in range(2) for n in names)
    for L in range(2):
        for name, kind in zip(names, ("k_bmm_quantizer", "v_bmm_quantizer"), strict=True):
            a, scale = amax[f"{L}.{kind}"].float(), t[name.format(L)]
            assert scale.dtype == torch.float32
            assert tuple(scale.shape) == shape
            # the reciprocal of training's divisor 448 / amax: amax / 448 up to one rounding
            assert torch.equal(scale.reshape(()), 1 / (torch.tensor(448.0) / a))
            torch.testing.assert_close(scale.reshape(()), a / 448, rtol=2**-23, atol=0)


def test_transformers_with_compressed_tensors_loads_the_fp8_kv_cache_export(runs):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    _, _, root = runs
    model, info = AutoModelForCausalLM.from_pretrained(
        root / "kv_compressed-tensors", dtype=torch.float32, output_loading_info=True,
        quantization_config=CompressedTensorsConfig(dequantize=True))
    model.eval()
    # transformers 5.23 (dequantize=True) runs attention in high precision: it ignores the KV scales, as it ignores
    # every input_scale
    kv_names = {f"model.layers.{L}.self_attn.{k}_scale" for L in range(2) for k in "kv"}
    assert kv_names <= info["unexpected_keys"]
    assert not info["missing_keys"]
    assert not info["error_msgs"]
    with torch.no_grad():
        logits = model(torch.arange(16).reshape(1, 16)).logits
    assert torch.isfinite(logits).all()


def test_export_refuses_a_quantized_query_and_an_nvfp4_kv_cache_in_compressed_tensors(runs):
    errors = runs[0][0]["export"]["errors"]
    msg, written = errors["query"]
    assert "q_bmm_quantizer" in msg
    assert not written
    msg, written = errors["nvfp4_ct"]
    assert "KV cache in NVFP4" in msg
    assert "FP8 E4M3" in msg
    assert "format='modelopt' also takes NVFP4" in msg
    assert not written


def test_a_per_channel_kv_amax_is_refused_naming_the_quantizer(runs):
    msg = runs[0][0]["per_channel"]
    assert "k_bmm_quantizer" in msg
    assert "axis=-1" in msg
    assert "one amax per layer" in msg


# The engine-order forward and the Megatron KV-QAT forward compute the same quantized model; what differs is fp32
# rounding (GEMMs and attention in another order, the engine dividing by the stored reciprocal scales instead of
# multiplying by 448 / amax). Measured: relative max difference 2.4e-7 and KL 5e-16 for both recipes and formats;
# K and V left in high precision on the engine side: 7e-2 to 9e-2. A value exactly on an FP8 rounding midpoint (bf16
# ratios make them: with all-ones norms one input of this model scaled to exactly 100.0) rounds to even in training
# and, divided by the stored reciprocal, one step away in the engine: that moved the logits by 1.4e-2 (KL 1e-6). The
# tolerances leave room for such a flip per recipe (the NVFP4 one as tests/distributed/test_engine_order_export.py).
ENGINE_TOLERANCE = {"one_scheme": 1e-3, "scheme_per_layer": 1e-2}
KL_TOLERANCE = 1e-6


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("recipe", ["one_scheme", "scheme_per_layer"])
def test_engine_order_forward_with_the_fp8_kv_cache_matches_the_kv_qat_forward(runs, recipe, fmt):
    """FP8 W8A8 + FP8 KV, and NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG (NVFP4 experts, FP8 attention, FP8 KV): the
    engine-order forward from the exported files alone, K and V stored as ``fp8(k / k_scale)`` after RoPE, gives the
    Megatron fake-quant model's logits; without the KV cache's quantization it does not."""
    from torch import nn

    from modelopt_moe.export.engine_forward import engine_order_kl, engine_order_model

    tp2, _, root = runs
    res = tp2[0]["export"]
    path = root / (f"kv_mixed_{fmt}" if recipe == "scheme_per_layer" else f"kv_{fmt}")
    tokens, ref = res["tokens"], res["logits"][recipe]
    amax = res["amax_mixed" if recipe == "scheme_per_layer" else "amax"]
    engine = engine_order_model(path)
    for L, layer in enumerate(engine.model.layers):  # the scales the files hold, on the attention as engines keep them
        for kind in "kv":
            got = getattr(layer.self_attn, f"{kind}_scale")
            assert torch.equal(got, 1 / (torch.tensor(448.0) / amax[f"{L}.{kind}_bmm_quantizer"].float())), (L, kind)
    assert sum(isinstance(m, nn.Linear) and bool(m._forward_pre_hooks) for m in engine.modules()) == 2 * (4 + 3 * 4)
    with torch.no_grad():
        diff = _relative_max_diff(engine(tokens).logits.float(), ref)
        without = _relative_max_diff(engine_order_model(path, kv_cache=False)(tokens).logits.float(), ref)
    kl = engine_order_kl(path, [(tokens, ref)])[0]
    print(f"{recipe} {fmt}: engine order with the FP8 KV cache vs Megatron KV-QAT: relative max difference "
          f"{diff:.3g}, KL {kl:.3g}; with K and V in high precision: {without:.3g}")
    assert diff <= ENGINE_TOLERANCE[recipe], diff
    assert 0 <= kl <= KL_TOLERANCE, kl
    assert without > 10 * diff, (without, diff)  # the KV cache's quantization is what the engine side adds


def test_engine_order_forward_refuses_an_nvfp4_kv_cache_naming_it(runs):
    from modelopt_moe.export import ExportError
    from modelopt_moe.export.engine_forward import engine_order_model

    root = runs[2]
    assert json.loads((root / "kv_nvfp4_modelopt" / "config.json").read_text())["quantization_config"][
        "kv_cache_quant_algo"] == "NVFP4"
    with pytest.raises(ExportError, match="KV cache in NVFP4") as info:
        engine_order_model(root / "kv_nvfp4_modelopt")
    assert "FP8 KV cache only" in str(info.value)
    assert engine_order_model(root / "kv_nvfp4_modelopt", kv_cache=False) is not None  # K and V left unquantized


def _relative_max_diff(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_transformers_and_compressed_tensors_load_nvidias_recipe_with_its_fp8_kv_cache(runs):
    """NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG's compressed-tensors export: compressed-tensors parses its config (a group
    per scheme and the FP8 ``kv_cache_scheme``), transformers loads it (with the NVFP4 experts fix), the KV scales
    present and left to the engines, every weight loaded."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from modelopt_moe.export import transformers_compat

    root = runs[2]
    path = root / "kv_mixed_compressed-tensors"
    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    assert qc.kv_cache_scheme.num_bits == 8
    assert qc.kv_cache_scheme.type == "float"
    assert qc.kv_cache_scheme.strategy == "tensor"
    assert sorted(g.format for g in qc.config_groups.values()) == ["float-quantized", "nvfp4-pack-quantized"]
    with transformers_compat.fix_nvfp4_experts():
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True,
            quantization_config=CompressedTensorsConfig(dequantize=True))
    kv_names = {f"model.layers.{L}.self_attn.{k}_scale" for L in range(2) for k in "kv"}
    assert kv_names <= set(_tensors(path))
    assert kv_names <= info["unexpected_keys"]
    assert not info["missing_keys"]
    assert not info["error_msgs"]
    with torch.no_grad():
        assert torch.isfinite(model.eval()(torch.arange(16).reshape(1, 16)).logits).all()
