"""DeepSeek-V3 and GLM-4.5 MoE with Transformer Engine layers (``build_megatron_model(spec="te")``: MLA with TE's
duplicated down projections and fused latent norms, dense first layers with TE's fused norm + fc1, ``TEGroupedMLP``
experts) on one GPU: the checkpoints transformers writes from the shipped tiny configs import, give transformers'
logits (fp32) and export back bit for bit (``format="hf"``).

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

from modelopt_moe.quantization.config import preset_path  # noqa: E402

CONFIGS = {"deepseek_v3": "deepseek_v3_tiny.json", "glm4_moe": "glm4_moe_tiny.json"}


def _save(path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(preset_path(CONFIGS[family]).read_text())
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(".bias"):
                t.add_(torch.randn_like(t) * 0.1)
            elif "e_score_correction_bias" in name:
                t.copy_(torch.randn_like(t) * 0.05)
    model.to(torch.bfloat16).save_pretrained(path)


def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_te_spec_imports_matches_transformers_and_exports_bit_exact(megatron_one_gpu, family, tmp_path):
    from transformers import AutoModelForCausalLM

    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    _save(tmp_path / "src", family)
    model = build_megatron_model(tmp_path / "src", spec="te", params_dtype=torch.float32)
    import_hf(model, tmp_path / "src")
    model.eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    with torch.no_grad():
        ours = model(tokens.cuda(), torch.arange(16).expand(2, 16).cuda(), None).float().cpu()
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
        ref = hf(tokens).logits.float()
    diff = (ours - ref).abs().max().item()
    print(f"{family}, TE spec: logits max |Megatron - transformers| = {diff:.3g} (largest {ref.abs().max():.3g})")
    assert diff <= 1e-3 * ref.abs().max().item()  # TE's kernels and cuBLAS against torch on the CPU
    export_hf(model, tmp_path / "out", format="hf", dtype=torch.bfloat16, progress=False)
    source, exported = _tensors(tmp_path / "src"), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(source)
    for name, t in source.items():
        assert torch.equal(exported[name].to(t.dtype), t), name
