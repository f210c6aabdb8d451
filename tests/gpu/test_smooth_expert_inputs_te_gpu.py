"""``smooth_expert_inputs`` on Transformer Engine grouped experts (Megatron ``TEGroupedMLP`` with TE's grouped
linears) on one GPU: ``mtq.quantize`` with the key rescales every expert's fc2 input channels by powers of two (fc1's
up rows divided, fc2's columns multiplied by the same ``s_j``), the bf16 model's logits stay bit-identical with the
quantizers off, and a clamped GLU is refused by module path with nothing changed.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")

import megatron_harness.models as mm  # noqa: E402

import modelopt_moe.quantization as mtq  # noqa: E402

CONFIG = {**mtq.load_config("nvfp4_experts.yaml").model_dump(), "smooth_expert_inputs": {"alpha": 0.5}}


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _build(**overrides):
    return mm.build_moe_gpt(num_experts=8, hidden=128, ffn_hidden=256, seed=1, experts="te",
                            params_dtype=torch.bfloat16, gated_linear_unit=True, activation_func=F.silu,
                            **overrides).eval()


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([mm.gather_logits(model, b) for b in batches])


def test_te_grouped_experts_are_rescaled_by_powers_of_two_and_the_logits_stay_bit_identical():
    calib = mm.text_batches(2, 32, 2)
    model = _build()
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    assert type(fc1).__module__.startswith("megatron.core.extensions.transformer_engine"), type(fc1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = _logits(model, calib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, CONFIG, lambda m: _logits(m, calib))
    assert type(model.decoder.layers[0].mlp.experts.linear_fc1).__name__ == "QuantTEColumnParallelGroupedLinear"
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert moved
    assert all(".mlp.experts.linear_fc" in n for n in moved), moved
    for name in [n for n in moved if "linear_fc2.weight" in n]:
        fc2, fc2_before = model.get_parameter(name).detach().double(), before[name].double()
        s = (fc2 / fc2_before)[0]
        assert torch.equal(torch.exp2(torch.round(torch.log2(s))), s), name
        assert torch.equal(fc2, fc2_before * s[None, :]), name
        up_name = name.replace("linear_fc2", "linear_fc1")
        f = fc2.shape[1]
        up = model.get_parameter(up_name).detach().double()[f:]
        assert torch.equal(up * s[:, None], before[up_name].double()[f:]), up_name
    enabled = [q for _, q, _ in mtq.named_quantizers(model) if q.is_enabled]
    mtq.disable_quantizer(model, "*")
    assert torch.equal(_logits(model, calib), ref)
    for q in enabled:
        q.enable()


def test_a_clamped_glu_on_te_grouped_experts_is_refused_by_module_path():
    model = _build(activation_func_clamp_value=7.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"decoder.layers.0.mlp.experts: activation_func_clamp_value=7.0"):
        mtq.quantize(model, CONFIG, lambda m: _logits(m, mm.text_batches(2, 32, 1)))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())
