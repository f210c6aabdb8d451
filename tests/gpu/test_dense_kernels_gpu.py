"""Dense quantizers on CUDA take the experts' one-launch kernels (``kernel: auto``), bit for bit with the reference
(``kernel: torch``): ``nn.Linear`` in bf16, and the dense linears of a Megatron model built with Transformer Engine's
spec (``TELayerNormColumnParallelLinear`` QKV, ``TERowParallelLinear`` attention output) and with the local spec
(``ColumnParallelLinear`` / ``RowParallelLinear``). Outputs, input and weight gradients are equal; the autograd
graph of the ``auto`` model holds the grouped ops' nodes and none of the reference's.

Needs a GPU; the Megatron part also Transformer Engine and transformers (skips otherwise).
"""

import warnings

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from autograd_paths import assert_kernel_path, assert_reference_path, graph_nodes  # noqa: E402

import modelopt_moe.quantization as mtq  # noqa: E402


def _config(preset: str, kernel: str, ste: str = "clipped", learned: bool = False):
    cfg = mtq.load_config(preset)
    cfg.kernel, cfg.backward.ste = kernel, ste
    if learned:
        cfg.weight_amax_update, cfg.input_amax_update = "learned", "learned"
    return cfg


def _linear_run(preset: str, kernel: str, ste: str, learned: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 384), nn.GELU(), nn.Linear(384, 256)).cuda().to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight[7].mul_(20.0)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(3, 67, 512, device="cuda", generator=g).to(torch.bfloat16)  # 201 tokens: a ragged last tile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, _config(preset, kernel, ste, learned), lambda m: m(x))
    x = (x * 1.3).requires_grad_(True)
    y = model(x)
    y.backward(torch.randn(y.shape, device="cuda", generator=g).to(y.dtype))
    return y.detach(), x.grad, [p.grad for p in model.parameters()], graph_nodes(y)


@pytest.mark.parametrize(("preset", "ste", "learned"), [
    ("fp8_default.yaml", "clipped", False),
    ("fp8_default.yaml", "pass_through", True),
    ("nvfp4_default.yaml", "clipped", False),
    ("nvfp4_default.yaml", "pass_through", True),
    ("fp8_block_w8a8.yaml", "pass_through", False),
    ("mxfp8_default.yaml", "pass_through", False),
    ("int8_default.yaml", "clipped", False),
])
def test_nn_linear_takes_the_kernels_bit_for_bit_with_the_reference(preset, ste, learned):
    ref = _linear_run(preset, "torch", ste, learned)
    fast = _linear_run(preset, "auto", ste, learned)
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    for a, b in zip(fast[2], ref[2], strict=True):
        assert torch.equal(a, b)
    if not learned:  # learned amaxes: values computed without a graph, put in by the learned amax's own node
        assert_reference_path(ref[3])
        assert_kernel_path(fast[3])


FOUR_OVER_SIX_YAML = """\
quant_cfg:
  - quantizer_name: "*weight_quantizer"
    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3, four_over_six: true}}
  - quantizer_name: "*input_quantizer"
    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3, four_over_six: true}}
algorithm: max
"""


@pytest.mark.parametrize("ste", ["clipped", "pass_through"])
def test_nn_linear_with_four_over_six_from_the_data_takes_the_kernels_bit_for_bit(tmp_path, ste):
    preset = tmp_path / "nvfp4_four_over_six_dynamic.yaml"
    preset.write_text(FOUR_OVER_SIX_YAML)
    ref = _linear_run(str(preset), "torch", ste, False)
    fast = _linear_run(str(preset), "auto", ste, False)
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    for a, b in zip(fast[2], ref[2], strict=True):
        assert torch.equal(a, b)
    assert_reference_path(ref[3])
    assert_kernel_path(fast[3])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("dense_kernels") / "hf"
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


DENSE_LINEARS = ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj")


def _megatron_linears(hf_dir, spec: str, preset: str, kernel: str):
    from modelopt_moe.export import build_megatron_model, import_hf

    torch.manual_seed(0)
    model = build_megatron_model(hf_dir, spec=spec, params_dtype=torch.float32)
    import_hf(model, hf_dir)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(16).expand(2, 16).cuda()
    model.eval()

    def calibrate(m):
        with torch.no_grad():
            m(tokens, positions, None)

    mtq.quantize(model, _config(preset, kernel), calibrate)
    model.train()
    modules = dict(model.named_modules())
    results = {}
    for name in DENSE_LINEARS:
        linear = modules[name]
        g = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(16, 2, linear.weight.shape[1], device="cuda", generator=g).requires_grad_(True)
        out = linear(x)[0]  # (seq, batch, hidden) -> (output, bias)
        out.backward(torch.randn(out.shape, device="cuda", generator=g))
        results[name] = (type(linear).__name__, out.detach(), x.grad, linear.weight.grad, graph_nodes(out))
    return results


@pytest.mark.parametrize("spec", ["te", "local"])
@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml"])
def test_megatron_dense_linears_take_the_kernels_bit_for_bit(megatron_one_gpu, hf_dir, spec, preset):
    if spec == "te":
        pytest.importorskip("transformer_engine.pytorch")
    ref = _megatron_linears(hf_dir, spec, preset, "torch")
    fast = _megatron_linears(hf_dir, spec, preset, "auto")
    if spec == "te":
        assert {r[0] for r in fast.values()} == {"QuantTELayerNormColumnParallelLinear", "QuantTERowParallelLinear"}
    for name in DENSE_LINEARS:
        kind, out, grad_x, grad_w, nodes = fast[name]
        _, ref_out, ref_x, ref_w, ref_nodes = ref[name]
        assert torch.equal(out, ref_out), (kind, name)
        assert torch.equal(grad_x, ref_x), (kind, name)
        assert torch.equal(grad_w, ref_w), (kind, name)
        assert_reference_path(ref_nodes, kind, name)
        assert_kernel_path(nodes, kind, name)
