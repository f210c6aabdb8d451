"""The fix for transformers' compressed-tensors NVFP4 MoE experts loader (modelopt_moe/export/transformers_compat.py):
which releases it applies to, that it makes transformers load every expert as compressed-tensors decodes it, and
that removing it restores transformers' own loader.

The end-to-end proof (a Megatron model exported at TP2 x EP2, read by transformers with the fix, logits compared) is
tests/distributed/test_hf_io_user_script.py; the strict xfail that turns red once transformers fixes its loader is
tests/distributed/test_hf_export.py::test_upstream_transformers_still_mis_scales_nvfp4_experts.
"""

import subprocess
import sys

import pytest
import torch

from modelopt_moe.export import codecs, get_family, transformers_compat
from modelopt_moe.export.families import MoEArch, canonical_names, canonical_shapes
from modelopt_moe.export.hf_checkpoint import LinearRecord, TensorRecord, write_hf_checkpoint
from modelopt_moe.export.schemes import LinearQuant, QuantSpec

ARCH = MoEArch(family="qwen3_moe", vocab_size=32, hidden_size=32, num_layers=1, num_attention_heads=2,
               num_kv_heads=1, head_dim=16, moe_ffn_hidden_size=16, num_experts=3, top_k=1, norm_eps=1e-6,
               rope_theta=1e4, max_position_embeddings=32, qk_norm=True)
NVFP4 = LinearQuant(QuantSpec("nvfp4"))


def test_affected_releases():
    affected = transformers_compat.nvfp4_experts_affected
    assert not affected("4.57.6")
    assert not affected("5.12.1")
    assert affected("5.13.0")
    assert affected("5.22.2")
    assert affected("5.23.0")
    assert affected()  # the installed release (the export extra pins 5.23.0)
    assert "5.13" in transformers_compat.AFFECTED_VERSIONS
    assert "5.23" in transformers_compat.AFFECTED_VERSIONS


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
def test_importing_the_module_imports_torch_alone():
    code = ("import sys; import modelopt_moe.export.transformers_compat; "
            "print(sorted(m for m in ('transformers', 'compressed_tensors', 'megatron') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    """A compressed-tensors checkpoint whose experts (only they) are NVFP4, each with its own global scale."""
    out = tmp_path_factory.mktemp("ct") / "nvfp4"
    g = torch.Generator().manual_seed(0)
    shapes, records = canonical_shapes(ARCH), []
    for i, name in enumerate(canonical_names(ARCH)):
        t = torch.randn(shapes[name], generator=g) * (0.01 * (i + 1))  # a distinct scale per tensor
        if ".experts." in name:
            records.append(LinearRecord(name, t, NVFP4, t.abs().amax()))
        elif t.dim() == 2 and name != "embed_tokens":
            records.append(LinearRecord(name, t))
        else:
            records.append(TensorRecord(name, t))
    quants = {r.canonical: r.quant for r in records if isinstance(r, LinearRecord)}
    write_hf_checkpoint(out, arch=ARCH, family=get_family("qwen3_moe"), fmt="compressed-tensors",
                        linear_quants=quants, groups=[("all", records)], num_groups=1, dtype=torch.float32,
                        progress=False)
    return out


def _load(path):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(dequantize=True))


def _expert_error_ulps(model, path) -> int:
    """The largest bf16-ulp distance of any loaded expert matrix from the format's formula decoded in fp32."""
    from safetensors.torch import load_file

    t = load_file(path / "model-00001-of-00001.safetensors")
    experts, worst = model.model.layers[0].mlp.experts, 0
    for e in range(ARCH.num_experts):
        loaded = {"gate_proj": experts.gate_up_proj[e, :16], "up_proj": experts.gate_up_proj[e, 16:],
                  "down_proj": experts.down_proj[e]}
        for mod, got in loaded.items():
            n = f"model.layers.0.mlp.experts.{e}.{mod}."
            want = codecs.decode_nvfp4_ct(t[n + "weight_packed"], t[n + "weight_scale"], t[n + "weight_global_scale"],
                                          torch.float32)
            ulps = (got.detach().bfloat16().view(torch.int16).int() - want.bfloat16().view(torch.int16).int()).abs()
            worst = max(worst, int(ulps.max()))
    return worst


def test_the_fix_loads_every_expert_right_and_removing_it_restores_transformers(nvfp4_checkpoint):
    from transformers.integrations.compressed_tensors import CompressedTensorsDequantize

    original = CompressedTensorsDequantize.convert
    with transformers_compat.fix_nvfp4_experts() as fix:
        assert fix.applied
        assert "5.23" in fix.note
        assert CompressedTensorsDequantize.convert is not original
        again = transformers_compat.fix_nvfp4_experts()  # a second call (another user of it) nests
        fixed = _load(nvfp4_checkpoint)
    assert CompressedTensorsDequantize.convert is not original  # `again` still holds it
    again.remove()
    again.remove()  # idempotent
    assert CompressedTensorsDequantize.convert is original
    # compressed-tensors decodes NVFP4 to bf16: within 1 bf16 ulp of the format's formula in fp32
    assert _expert_error_ulps(fixed, nvfp4_checkpoint) <= 1
    unfixed = _load(nvfp4_checkpoint)
    assert _expert_error_ulps(unfixed, nvfp4_checkpoint) > 1000  # transformers alone drops the global scale
