"""KV-cache QAT in Megatron's attention, as a training script uses it (gloo ranks; Model Optimizer's preset merge).

One spawn of 2 ranks at TP=2 (sequence parallel): a model preset merged with ``mtq.FP8_KV_CFG`` (or ``NVFP4_KV_CFG``)
puts ``k_bmm_quantizer`` / ``v_bmm_quantizer`` on every layer's core attention; the key they see is the key after
RoPE (recomputed by hand from the layer's input: the QKV projection, Megatron's split and ``apply_rotary_pos_emb``);
the core attention computes on exactly the reference fake quant of K and V with the calibrated amax; that amax is one
per layer, the max over the TP ranks' heads, the same on both ranks; one step of Megatron's schedule (bf16,
distributed optimizer) trains through it (the QKV weights move); the checkpoint is saved. A second spawn of 1 rank
at TP=1 loads it into a fresh model: every KV amax bit-exact.
"""

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

SEED, BATCH, SEQ = 1234, 2, 32


def _config(mtq, kv_preset: str):
    cfg = dict(mtq.FP8_DEFAULT_CFG)
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
    mm.destroy_model_parallel()
    return out


def _tp1_worker(rank, world_size, root):
    import megatron_harness.models as mm

    from modelopt_moe.plugins.megatron import load_sharded_checkpoint

    mm.init_model_parallel(1, 1, seed=SEED)
    model = mm.build_moe_gpt(seed=SEED + 1)
    load_sharded_checkpoint([model], root / "ckpt")
    out = _kv_amax(model)
    mm.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    tp2 = spawn(_tp2_worker, 2, args=(root,), timeout=seconds(600))
    tp1 = spawn(_tp1_worker, 1, args=(root,), timeout=seconds(600))
    return tp2, tp1[0]


@pytest.mark.parametrize("preset", ["FP8_KV_CFG", "NVFP4_KV_CFG"])
def test_kv_preset_merged_with_a_model_preset_quantizes_k_and_v_with_one_amax_per_layer_over_tp(runs, preset):
    tp2, _ = runs
    for rank in tp2:
        assert rank[preset]["enabled"] == {"q_bmm_quantizer": False, "k_bmm_quantizer": True, "v_bmm_quantizer": True}
    amax0, amax1 = tp2[0][preset]["amax"], tp2[1][preset]["amax"]
    assert set(amax0) == {"0.k_bmm_quantizer", "0.v_bmm_quantizer", "1.k_bmm_quantizer", "1.v_bmm_quantizer"}
    for k in amax0:
        assert amax0[k].numel() == 1
        assert amax0[k] > 0
        assert torch.equal(amax0[k], amax1[k]), f"{k}: TP ranks disagree"


def test_k_is_quantized_after_rope_and_attention_runs_on_the_reference_fake_quant(runs):
    tp2, _ = runs
    for rank in tp2:
        res = rank["FP8_KV_CFG"]
        for i, p in res["placement"].items():
            checks = {k: v for k, v in p.items() if k != "local_k_max"}
            assert all(checks.values()), f"layer {i}: {checks}"
            # the calibration batch included this one: the amax is at least what this rank saw, and it is what the
            # TP ranks saw together (max-reduced over TP)
            assert res["amax"][f"{i}.k_bmm_quantizer"] >= res["k_max_over_tp"][i]


def test_trains_through_megatrons_schedule_and_reshards_tp2_to_tp1_bit_exact(runs):
    tp2, tp1 = runs
    res = tp2[0]["FP8_KV_CFG"]
    assert res["qkv_moved"]
    assert res["loss"] == res["loss"]  # finite
    assert res["amax_after_step"].keys() == tp1.keys()
    for k, v in res["amax_after_step"].items():
        assert torch.equal(v, tp1[k]), f"{k}: {v} saved at TP2, {tp1[k]} loaded at TP1"
    assert all(torch.equal(res["amax"][k], v) for k, v in res["amax_after_step"].items())  # static KV amaxes
