"""QAD and precision autoswitch on a Megatron MoE GPT with Transformer Engine grouped experts (``TEGroupedMLP``) on one
GPU, in Megatron's training machinery (``Float16Module`` + DDP + ``get_megatron_optimizer`` +
``get_forward_backward_func``).

* QAD: ``distillation_model(student, teacher)``: DDP holds the student's parameters only and the teacher gets no
  gradient (a short recovery run, QAD against plain QAT, is in tests/tools/test_qat_recovery_gpu.py).
* ``weight_amax_update: dynamic`` on TE grouped experts: the trained forward equals a fresh model's given the trained
  weights alone.
* autoswitch: a planted outlier expert switches its fc1 fprop to high precision while the others stay quantized,
  measured by the one-launch Triton kernels with statistics.
"""

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")

import megatron_harness.models as mm  # noqa: E402
from megatron_harness.configs import expert_quant_config  # noqa: E402

import modelopt_moe.quantization as mtq  # noqa: E402
from modelopt_moe.plugins.megatron import distillation_model  # noqa: E402
from modelopt_moe.plugins.megatron import training as mt  # noqa: E402

EXPERTS, OUTLIER = 8, 3


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _build(seed=1):
    return mm.build_moe_gpt(num_experts=EXPERTS, hidden=128, ffn_hidden=256, seed=seed, experts="te",
                            params_dtype=torch.bfloat16)


def _quantize(model, cfg, calib):
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: [mm.lm_loss(m, b) for b in calib])
    return model.train()


def test_qad_trains_the_student_only_on_te_grouped_experts():
    calib = mm.text_batches(2, 32, 2)
    teacher = _build().eval()
    student = _quantize(_build(), expert_quant_config("nvfp4", "dynamic"), calib)
    assert type(student.decoder.layers[0].mlp.experts.linear_fc1).__name__ == "QuantTEColumnParallelGroupedLinear"
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    trainer = mt.setup_training(distillation_model(student, teacher), reuse_quantized_weights=True)
    assert sum(p.numel() for p in trainer.model.parameters()) == sum(p.numel() for p in student.parameters())
    losses = mt.train(trainer, mm.text_batches(2, 32, 8, offset=100), steps=4, num_microbatches=2)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in teacher.named_parameters())


def test_dynamic_amax_on_te_grouped_experts_follows_the_trained_weights():
    from megatron.core.transformer.module import Float16Module

    calib = mm.text_batches(2, 32, 2)
    eval_batch = mm.text_batches(2, 32, 1, offset=1000)[0]
    cfg = expert_quant_config("fp8", "dynamic")
    trainer = mt.setup_training(_quantize(_build(), cfg, calib), lr=1e-2, reuse_quantized_weights=True)
    mt.train(trainer, mm.text_batches(2, 32, 6, offset=100), steps=3, num_microbatches=2)
    with torch.no_grad():
        logits = mm.gather_logits(trainer.model.eval(), eval_batch)
    trained = mt.unwrap(trainer.model)
    fresh = Float16Module(trained.config, _quantize(_build(), cfg, calib))
    with torch.no_grad():
        for p, q in zip(fresh.module.parameters(), trained.parameters(), strict=True):
            p.copy_(q)
        assert torch.equal(mm.gather_logits(fresh.eval(), eval_batch), logits)


def test_autoswitch_outlier_expert_on_te_grouped_experts(tmp_path):
    calib = mm.text_batches(2, 32, 2)
    model = _build()
    with torch.no_grad():
        for layer in model.decoder.layers:
            w = getattr(layer.mlp.experts.linear_fc1, f"weight{OUTLIER}")
            w.mul_(1e-6)
            w[0, 0] = 0.1
    cfg = expert_quant_config("fp8", "static")
    cfg["kernel"] = "triton"
    cfg["autoswitch"] = {"every": 2, "underflow_pct": 50.0, "gemms": ["fprop"], "log_dir": str(tmp_path)}
    trainer = mt.setup_training(_quantize(model, cfg, calib), lr=1e-9, autoswitch=True)
    mt.train(trainer, mm.text_batches(2, 32, 6, offset=100), steps=3, num_microbatches=2)
    rows = [r for r in mtq.autoswitch_summary(tmp_path) if r["layer"].endswith("experts.linear_fc1")]
    assert {r["expert"] for r in rows} == set(range(EXPERTS))
    for r in rows:
        assert r["switched"] == (r["samples"] if r["expert"] == OUTLIER else 0), r
    print("autoswitch (TEGroupedMLP fc1, fprop):",
          {r["expert"]: f"{r['switched']}/{r['samples']}" for r in rows if "layers.0." in r["layer"]})
