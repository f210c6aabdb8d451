"""Hugging Face import/export with Transformer Engine layers (``build_megatron_model(spec="te")``: fused
layernorm + QKV linear, ``TEGroupedMLP`` experts with TE's grouped linears) on 2 GPUs (NCCL, EP=2).

* bf16 round trip HF -> Megatron (TE spec) -> HF is bit-exact;
* after NVFP4 quantization the TE model and the local-spec model (same weights) export the same weight tensors
  (codes, block scales, second-level scales) byte for byte; the input scales come from activations, whose rounding
  differs between TE and torch norms, so they are only required to be close.

Needs 2 GPUs, Transformer Engine, transformers and safetensors; skips otherwise.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_harness.hf_families import tensors  # noqa: E402

from modelopt_moe.launch import spawn  # noqa: E402


def _worker(rank, world_size, hf_dir, out):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    torch.cuda.set_device(rank)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2,
                                             expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=g).cuda()
    positions = torch.arange(32).expand(2, 32).cuda()

    def calibrate(m):
        with torch.no_grad():
            m(tokens, positions, None)

    for spec in ("te", "local"):
        model = build_megatron_model(hf_dir, spec=spec)
        import_hf(model, hf_dir)
        export_hf(model, f"{out}/{spec}_bf16", format="hf", progress=False)
        model.eval()
        mtq.quantize(model, mtq.load_config("nvfp4_default.yaml"), calibrate)
        export_hf(model, f"{out}/{spec}_nvfp4", format="modelopt", progress=False)
    parallel_state.destroy_model_parallel()


@pytest.mark.timeout(600)
def test_te_spec_round_trip_and_nvfp4_export(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=64)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    spawn(_worker, 2, args=(str(tmp_path / "hf"), str(tmp_path)), timeout=500, backend="nccl")
    src = tensors(tmp_path / "hf")
    for spec in ("te", "local"):
        got = tensors(tmp_path / f"{spec}_bf16")
        assert sorted(got) == sorted(src)
        for name, t in src.items():
            assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), (spec, name)
    te, local = tensors(tmp_path / "te_nvfp4"), tensors(tmp_path / "local_nvfp4")
    assert sorted(te) == sorted(local)
    for name, t in local.items():
        if name.endswith("input_scale"):
            assert torch.allclose(te[name], t, rtol=1e-2), name
        else:
            assert torch.equal(te[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
