"""``moe_calib_experts_ratio`` on a Megatron MoE GPT (4 gloo ranks, TP=2 x EP=2, one spawn): with a router biased
away from two experts, the model's routing leaves them without calibration tokens (they take the shared input amax,
with a warning); with the ratio every expert calibrates on its own tokens, for SequentialMLP and grouped experts,
while the outputs the forward loop sees (the next layers' activations) are the model's own, bit for bit."""

import warnings

import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

EXPERTS, UNSEEN = 4, (1, 3)


def _calibrate(model, mm, mtq, batches, ratio):
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.input_amax = "per_expert"
    algorithm = {"method": "max"} if ratio is None else {"method": "max", "moe_calib_experts_ratio": ratio}
    config = {**cfg.model_dump(), "algorithm": algorithm}
    outputs = []

    def forward_loop(m):
        outputs.extend(mm.gather_logits(m, b) for b in batches)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mtq.quantize(model, config, forward_loop)
    return outputs, [str(w.message) for w in caught if "saw no calibration tokens" in str(w.message)]


def _worker(rank, world_size, hf_dir, out_dir):
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

    mm.init_model_parallel(2, 2, seed=1)
    batches = mm.text_batches(2, 32, 2)
    out = {"ep_rank": mm.parallel_layout()["ep_rank"]}
    for kind in ("sequential", "grouped"):
        for ratio in (None, 0.75, 1.0):
            model = mm.build_moe_gpt(num_experts=EXPERTS, seed=3, experts=kind, moe_router_enable_expert_bias=True,
                                     moe_router_score_function="sigmoid").eval()
            for layer in model.decoder.layers:
                for e in UNSEEN:
                    layer.mlp.router.expert_bias[e] = -1e4
            outputs, warned = _calibrate(model, mm, mtq, batches, ratio)
            rows = {}
            for i, layer in enumerate(model.decoder.layers):
                for gemm in ("linear_fc1", "linear_fc2"):
                    q = getattr(layer.mlp.experts, gemm).input_quantizer
                    rows[(i, gemm)] = (q.calibrated_rows.clone(), q.amax.clone())
            out[(kind, ratio)] = {"outputs": outputs, "warned": warned, "rows": rows,
                                  "topk": model.decoder.layers[0].mlp.router.topk,
                                  "config_topk": model.config.moe_router_topk,
                                  "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                                               for m in model.modules())}
            if (kind, ratio) == ("sequential", 0.75):
                from modelopt_moe.plugins.megatron import save_sharded_checkpoint
                from modelopt_moe.quantization.calib.tokens import expert_token_counts

                out["saved_tokens"] = expert_token_counts(model)  # a collective: every rank
                save_sharded_checkpoint([model], f"{out_dir}-ckpt")
    out["export_warnings"] = _export_few_tokens(mtq, hf_dir, out_dir)
    mm.destroy_model_parallel()
    out["restored_tokens"], out["restored_summary"] = _restore_at_tp1_ep4(mm, mtq, f"{out_dir}-ckpt")
    return out


def _restore_at_tp1_ep4(mm, mtq, ckpt_dir):
    """The checkpoint saved at TP=2 x EP=2 restored into a fresh model at TP=1 x EP=4: its token counts and summary."""
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint
    from modelopt_moe.quantization.calib.tokens import expert_token_counts

    mm.init_model_parallel(1, 4, seed=1)
    model = mm.build_moe_gpt(num_experts=EXPERTS, seed=3, moe_router_enable_expert_bias=True,
                             moe_router_score_function="sigmoid").eval()
    load_sharded_checkpoint([model], ckpt_dir)
    result = expert_token_counts(model), mtq.print_quant_summary(model, file=False)
    mm.destroy_model_parallel()
    return result


def _export_few_tokens(mtq, hf_dir, out_dir):
    """A Qwen3-MoE calibrated on 6 tokens (every expert below the threshold), one expert input amax set to NaN and
    one to 0, exported: the warnings on this rank."""
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    model = build_megatron_model(hf_dir)
    import_hf(model, hf_dir)
    tokens = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6).expand(1, 6)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)[None, None]
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.input_amax = "per_expert"
    mtq.quantize(model, cfg, lambda m: m(tokens, positions, causal))
    q = model.decoder.layers[0].mlp.experts.linear_fc1.input_quantizer
    q[0].amax, q[1].amax = float("nan"), 0.0  # what engines would turn into NaN, were it written as is
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_hf(model, out_dir, format="compressed-tensors", progress=False)
    return [str(w.message) for w in caught if "fewer than" in str(w.message)]


def test_every_expert_calibrates_on_its_own_tokens_while_the_outputs_stay_the_models(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    ranks = spawn(_worker, 4, args=(str(tmp_path / "hf"), str(tmp_path / "out")), timeout=seconds(900))
    _check_export(ranks, tmp_path / "out")
    saved = ranks[0]["saved_tokens"]
    assert sorted(saved) == [f"decoder.layers.{i}.mlp.experts.{g}.input_quantizer" for i in (0, 1)
                             for g in ("linear_fc1", "linear_fc2")]
    assert all(sorted(cells) == list(range(EXPERTS)) and all(c > 0 for c in cells.values())  # noqa: PT018
               for cells in saved.values()), saved
    for r, result in enumerate(ranks):  # the checkpoint carries them: the same by global expert at TP=1 x EP=4
        assert result["saved_tokens"] == saved, r
        assert result["restored_tokens"] == saved, r
    line = next(x for x in ranks[1]["restored_summary"].splitlines()
                if x.startswith("decoder.layers.0.mlp.experts.linear_fc1.input_quantizer"))
    assert f"tokens {saved['decoder.layers.0.mlp.experts.linear_fc1.input_quantizer'][1]}" in line, line
    for rank, result in enumerate(ranks):
        for kind in ("sequential", "grouped"):
            plain, wide, wider = result[(kind, None)], result[(kind, 0.75)], result[(kind, 1.0)]
            if kind == "sequential" and rank == 0:  # warned on rank 0, once per process (the same text for grouped)
                assert plain["warned"], kind  # the model's own routing leaves experts 1 and 3 cold
            assert not wide["warned"], kind
            assert not wider["warned"], kind
            for a, b, c in zip(plain["outputs"], wide["outputs"], wider["outputs"], strict=True):
                assert torch.equal(a, b) and torch.equal(a, c), kind  # noqa: PT018  the next layers see the same
            for key, (rows, amax) in wider["rows"].items():
                assert (rows > 0).all(), (kind, key, rows)
                assert (rows == rows[0]).all(), (kind, key, rows)  # ratio 1: every token reaches every expert
                assert (amax > 0).all(), (kind, key, amax)
            for key, (rows, _) in wide["rows"].items():
                assert (rows > 0).all(), (kind, key, rows)
                assert (rows <= wider["rows"][key][0]).all(), (kind, key)  # 3 of 4 experts per token, not 4
            local = [g - 2 * result["ep_rank"] for g in UNSEEN if 0 <= g - 2 * result["ep_rank"] < 2]
            for key, (rows, amax) in plain["rows"].items():
                for i in local:  # cold under the model's routing (the shared amax); with the ratio, their own
                    assert int(rows[i]) == 0, (kind, key, rows)
                    if key[1] == "linear_fc2":  # an input of its own (fc1's is every token's hidden state)
                        assert wider["rows"][key][1][i] != amax[i], (kind, key)
            # Routing and hooks are as before after calibration.
            for r in (plain, wide, wider):
                assert (r["topk"], r["config_topk"], r["hooks"]) == (2, 2, plain["hooks"]), kind


def _check_export(ranks, out_dir):
    """export_hf named every cold expert on rank 0 only, and wrote no zero, non-finite or subnormal scale."""
    from safetensors.torch import load_file

    warned = ranks[0]["export_warnings"]
    assert len(warned) == 1, warned
    for layer in (0, 1):
        for gemm in ("linear_fc1", "linear_fc2"):
            assert f"decoder.layers.{layer}.mlp.experts.{gemm}.input_quantizer: experts {{0: " in warned[0], warned
    assert all(not r["export_warnings"] for r in ranks[1:])
    scales = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        scales.update({k: v for k, v in load_file(f).items() if k.endswith("scale")})
    assert any(".mlp.experts.0.gate_proj.input_scale" in k for k in scales), sorted(scales)[:5]
    for name, t in scales.items():
        t = t.float()
        assert torch.isfinite(t).all(), name
        assert (t >= torch.finfo(torch.float32).tiny).all(), name
