"""Transformer Engine dense linears (``build_megatron_model(spec="te")``: ``TELayerNormColumnParallelLinear`` for
QKV, ``TERowParallelLinear`` for the attention output) are quantized like Megatron's local linears, on one GPU.

The same Hugging Face weights go into (fp32) a TE-spec and a local-spec model, each quantized with the same calibration:

* every quantizer the local model enables, the TE model enables under the same name (attention included);
* weight amaxes are equal; input amaxes close (TE's fused norm and torch's round differently);
* the quantized logits of the two agree far better than either agrees with its unquantized logits, and disabling
  the TE model's attention quantizers changes its logits (they act in the forward);
* a training step reaches every quantized weight and the fused norm's weight;
* the NVFP4 export of both has the same tensors, the weights byte for byte.

Needs a GPU, Transformer Engine, transformers and safetensors; skips otherwise.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_harness.hf_families import tensors  # noqa: E402


def _amaxes(model):
    return {name: m.amax.detach().float().cpu() for name, m in model.named_modules()
            if name.endswith("_quantizer") and getattr(m, "is_enabled", False) and getattr(m, "amax", None) is not None}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("te_linears") / "hf"
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml", "int4_blockwise_weight_only.yaml"])
def test_te_dense_linears_quantized_like_local(megatron_one_gpu, hf_dir, tmp_path, preset):
    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=g).cuda()
    positions = torch.arange(32).expand(2, 32).cuda()

    def calibrate(m):
        with torch.no_grad():
            m(tokens, positions, None)

    results = {}
    for spec in ("te", "local"):
        torch.manual_seed(0)
        model = build_megatron_model(hf_dir, spec=spec, params_dtype=torch.float32)
        import_hf(model, hf_dir)
        model.eval()
        with torch.no_grad():
            plain = model(tokens, positions, None).float()
        mtq.quantize(model, mtq.load_config(preset), calibrate)
        with torch.no_grad():
            quantized = model(tokens, positions, None).float()
        model.train()
        model(tokens, positions, None).float().square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if preset == "nvfp4_default.yaml":
            export_hf(model, tmp_path / spec, format="modelopt", progress=False)
        results[spec] = (plain, quantized, _amaxes(model), grads)
        if spec == "te":  # the attention's quantizers act in the TE forward
            model.eval()
            with torch.no_grad():
                assert mtq.disable_quantizer(model, "*self_attention.linear_*") > 0
                assert not torch.equal(model(tokens, positions, None).float(), quantized)

    te_plain, te_q, te_amax, te_grads = results["te"]
    local_plain, local_q, local_amax, _ = results["local"]
    assert sorted(te_amax) == sorted(local_amax)
    assert any(".self_attention.linear_qkv.weight_quantizer" in n for n in te_amax)
    assert any(".self_attention.linear_proj.weight_quantizer" in n for n in te_amax)
    for name, a in local_amax.items():
        if "weight_quantizer" in name:
            assert torch.equal(te_amax[name], a), name
        else:
            assert torch.allclose(te_amax[name], a, rtol=2e-2), (name, te_amax[name], a)
    # TE's GEMMs and fused norm round differently from torch's, which flips a few quantized codes and routing
    # choices: the two quantized models must agree far better than either agrees with its unquantized self.
    gap, effect = (te_q - local_q).abs().mean(), (local_q - local_plain).abs().mean()
    plain_gap = (te_plain - local_plain).abs().mean()
    assert gap <= 0.2 * effect, (gap, effect, plain_gap)
    assert plain_gap <= 0.2 * effect, (gap, effect, plain_gap)
    for name, p in te_grads.items():
        if "linear_qkv" in name or "linear_proj" in name:
            assert p is not None, name
            assert torch.isfinite(p).all(), name
            assert p.abs().sum() > 0, name
    if preset == "nvfp4_default.yaml":
        te, local = tensors(tmp_path / "te"), tensors(tmp_path / "local")
        assert sorted(te) == sorted(local)
        assert any(k.endswith("self_attn.q_proj.input_scale") for k in te)
        for name, t in local.items():
            if name.endswith("input_scale"):
                assert torch.allclose(te[name], t, rtol=2e-2), name
            else:
                assert torch.equal(te[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
