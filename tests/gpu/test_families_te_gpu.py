"""DeepSeek-V3, GLM-4.5 MoE and gpt-oss with Transformer Engine layers (``build_megatron_model(spec="te")``: MLA with
TE's duplicated down projections and fused latent norms, dense first layers with TE's fused norm + fc1; gpt-oss's
biased linears and TE's core attention with a learnable softmax offset (the sinks) and per-layer sliding windows;
``TEGroupedMLP`` experts, with biases and the clamped SwiGLU for gpt-oss) on one GPU: the checkpoints transformers
writes from the shipped tiny configs import, give transformers' logits (fp32) and export back bit for bit
(``format="hf"``).

Transformer Engine runs fp32 GEMMs in TF32 (it asks cuBLAS for ``CUBLAS_COMPUTE_32F_FAST_TF32``) unless
``NVIDIA_TF32_OVERRIDE=0`` is set for the process; the gpt-oss test checks which, and holds the logits to 2e-5 of the
largest in full fp32 (5e-3 in TF32: its input rounding, emulated on the CPU, moves transformers' own logits by
1.1e-3 of the largest on this checkpoint, where the clamp bites).

Needs a GPU, Transformer Engine, transformers and safetensors; skips otherwise.
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

from megatron_harness.hf_families import tensors  # noqa: E402

from modelopt_moe.quantization.config import preset_path  # noqa: E402

CONFIGS = {"deepseek_v3": "deepseek_v3_tiny.json", "glm4_moe": "glm4_moe_tiny.json"}


def _save(path, family, filename=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(preset_path(filename or CONFIGS[family]).read_text())
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(".bias"):
                t.add_(torch.randn_like(t) * 0.1)
            elif "e_score_correction_bias" in name:
                t.copy_(torch.randn_like(t) * 0.05)
            elif name.endswith(("_bias", "sinks")):  # gpt-oss's expert biases and attention sinks
                t.add_(torch.randn_like(t) * 0.1)
            if family == "gpt_oss" and name.endswith("gate_up_proj"):  # pre-activations beyond swiglu_limit
                t.copy_(torch.randn_like(t) * 0.5)
    model.to(torch.bfloat16).save_pretrained(path)


def _logits(model, path, tokens):
    """(ours, transformers') fp32 logits on ``tokens``."""
    from transformers import AutoModelForCausalLM

    n = tokens.shape[1]
    with torch.no_grad():
        ours = model(tokens.cuda(), torch.arange(n).expand(*tokens.shape).cuda(), None).float().cpu()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return ours, hf(tokens).logits.float()


def _te_fp32_gemm_is_exact() -> bool:
    """Whether Transformer Engine's fp32 GEMMs keep every mantissa bit here (not TF32's 10): ``1 + 2**-20`` times an
    identity weight."""
    import transformer_engine.pytorch as te

    linear = te.Linear(16, 16, bias=False, params_dtype=torch.float32, device="cuda")
    with torch.no_grad():
        linear.weight.copy_(torch.eye(16))
        x = torch.full((16, 16), 1 + 2**-20, device="cuda")
        return torch.equal(linear(x), x)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_te_spec_imports_matches_transformers_and_exports_bit_exact(megatron_one_gpu, family, tmp_path):
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    _save(tmp_path / "src", family)
    model = build_megatron_model(tmp_path / "src", spec="te", params_dtype=torch.float32)
    import_hf(model, tmp_path / "src")
    model.eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    ours, ref = _logits(model, tmp_path / "src", tokens)
    diff = (ours - ref).abs().max().item()
    print(f"{family}, TE spec: logits max |Megatron - transformers| = {diff:.3g} (largest {ref.abs().max():.3g})")
    assert diff <= 1e-3 * ref.abs().max().item()  # TE's kernels and cuBLAS against torch on the CPU
    export_hf(model, tmp_path / "out", format="hf", dtype=torch.bfloat16, progress=False)
    source, exported = tensors(tmp_path / "src"), tensors(tmp_path / "out")
    assert sorted(exported) == sorted(source)
    for name, t in source.items():
        assert torch.equal(exported[name].to(t.dtype), t), name


def test_gpt_oss_te_spec_has_sinks_and_windows_matches_transformers_and_exports_bit_exact(megatron_one_gpu, tmp_path):
    """gpt-oss (``configs/gpt_oss_tiny.json``: sinks, q/k/v/o, router and expert biases, 4-token windows on layers 0
    and 2, the clamped SwiGLU, biting, YaRN) with the TE spec: TE's core attention holds the sinks (Megatron passes
    ``softmax_type="learnable"`` to TE >= 2.8) and the windows, the experts are ``TEGroupedMLP`` with biases; the fp32
    logits equal transformers' within 2e-5 of the largest (TE's GEMMs in full fp32; 5e-3 in TF32), the hf export is
    the source bit for bit."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    _save(tmp_path / "src", "gpt_oss", "gpt_oss_tiny.json")
    model = build_megatron_model(tmp_path / "src", spec="te", params_dtype=torch.float32)
    layers = model.decoder.layers
    core = [layer.self_attention.core_attention for layer in layers]
    assert all(type(c) is TEDotProductAttention for c in core), [type(c).__name__ for c in core]
    assert all(c.softmax_type == "learnable" and tuple(c.softmax_offset.shape) == (4,) for c in core)
    windows = [None if c.window_size is None or c.window_size[0] < 0 else tuple(c.window_size) for c in core]
    assert windows == [(3, 0), None, (3, 0)]  # sliding_window 4: the query and the 3 keys before it
    experts = [layer.mlp.experts for layer in layers]
    assert all(type(e) is TEGroupedMLP and e.linear_fc1.use_bias and e.linear_fc2.use_bias for e in experts)
    assert all(layer.self_attention.linear_qkv.use_bias and layer.mlp.router.bias is not None for layer in layers)

    import_hf(model, tmp_path / "src")
    model.eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, ref = _logits(model, tmp_path / "src", tokens)
    exact = _te_fp32_gemm_is_exact()
    diff, largest = (ours - ref).abs().max().item(), ref.abs().max().item()
    print(f"gpt_oss, TE spec ({'fp32' if exact else 'TF32'} GEMMs): logits max |Megatron - transformers| = "
          f"{diff:.3g} (largest {largest:.3g})")
    assert diff <= (2e-5 if exact else 5e-3) * largest

    export_hf(model, tmp_path / "out", format="hf", dtype=torch.bfloat16, progress=False)
    source, exported = tensors(tmp_path / "src"), tensors(tmp_path / "out")
    assert sorted(exported) == sorted(source)
    for name, t in source.items():
        assert torch.equal(exported[name].to(t.dtype), t), name
