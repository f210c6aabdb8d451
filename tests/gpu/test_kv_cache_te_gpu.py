"""The KV cache's quantizers on Transformer Engine's core attention (``build_megatron_model(spec="te")``:
``TEDotProductAttention``), one GPU.

* a model preset merged with ``mtq.FP8_KV_CFG`` gives ``TEDotProductAttention`` the same ``k_bmm_quantizer`` /
  ``v_bmm_quantizer`` as the local spec's ``DotProductAttention``; calibration gives each one amax per layer, close to
  the local spec's on the same weights (the norms round differently);
* TE's attention then computes on exactly the reference fake quant of its K and V (TE's own forward on the
  fake-quantized tensors), and the gradient flows through to the QKV weights;
* the Model Optimizer export carries ``k_proj.k_scale`` / ``v_proj.v_scale`` = ``1 / (448 / amax)``.

Needs one GPU, Transformer Engine, transformers and safetensors; skips otherwise.
"""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _config(mtq):
    cfg = dict(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"] = cfg["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"]
    return cfg


@pytest.mark.usefixtures("megatron_one_gpu")
@pytest.mark.timeout(600)
def test_te_core_attention_quantizes_k_and_v_like_the_local_one(tmp_path):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf
    from modelopt_moe.numerics import fake_quant
    from modelopt_moe.plugins.megatron.attention import QuantCoreAttentionMixin

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=64)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=g).cuda()
    positions = torch.arange(32).expand(2, 32).cuda()

    def calibrate(m):
        with torch.no_grad():
            m(tokens, positions, None)

    models = {}
    for spec in ("te", "local"):
        model = build_megatron_model(tmp_path / "hf", spec=spec)
        import_hf(model, tmp_path / "hf")
        model.eval()
        mtq.quantize(model, _config(mtq), calibrate)
        models[spec] = model
    te, local = models["te"], models["local"]
    for L in range(2):
        core = te.decoder.layers[L].self_attention.core_attention
        assert isinstance(core, TEDotProductAttention)
        assert isinstance(core, QuantCoreAttentionMixin)
        assert not core.q_bmm_quantizer.is_enabled
        for kind in ("k_bmm_quantizer", "v_bmm_quantizer"):
            a_te = getattr(core, kind).amax
            a_local = getattr(local.decoder.layers[L].self_attention.core_attention, kind).amax
            assert a_te.numel() == 1
            torch.testing.assert_close(a_te.float(), a_local.float(), rtol=2e-2, atol=0)

    # TE's attention on the reference fake quant of the K and V it was given
    seen = {}
    core = te.decoder.layers[0].self_attention.core_attention
    handle = core.register_forward_hook(lambda m, args, kwargs, out: seen.update(args=args, kwargs=kwargs, out=out),
                                        with_kwargs=True)
    with torch.no_grad():
        te(tokens, positions, None)
    handle.remove()
    q, k, v = seen["args"][:3]
    with torch.no_grad():
        ref = TEDotProductAttention.forward(core, q, fake_quant(k, "e4m3", core.k_bmm_quantizer.amax),
                                            fake_quant(v, "e4m3", core.v_bmm_quantizer.amax), *seen["args"][3:],
                                            **seen["kwargs"])
    assert torch.equal(seen["out"], ref)

    # straight-through: the loss's gradient reaches the QKV weights through the quantized K and V
    te.train()
    te(tokens, positions, None).float().pow(2).mean().backward()
    grad = te.decoder.layers[0].self_attention.linear_qkv.weight.grad
    assert grad is not None
    assert torch.isfinite(grad).all()
    assert grad.abs().sum() > 0

    export_hf(te, tmp_path / "te_modelopt", format="modelopt", progress=False)
    qc = json.loads((tmp_path / "te_modelopt" / "hf_quant_config.json").read_text())["quantization"]
    assert qc["kv_cache_quant_algo"] == "FP8"
    t = {}
    for f in sorted((tmp_path / "te_modelopt").glob("*.safetensors")):
        t.update(load_file(str(f)))
    for L in range(2):
        core = te.decoder.layers[L].self_attention.core_attention
        for proj, kind in (("k_proj.k_scale", "k_bmm_quantizer"), ("v_proj.v_scale", "v_bmm_quantizer")):
            a = getattr(core, kind).amax.float().cpu()
            assert torch.equal(t[f"model.layers.{L}.self_attn.{proj}"], 1 / (torch.tensor(448.0) / a))
