"""QAT of a Megatron MoE GPT with Transformer Engine grouped experts (``TEGroupedMLP``) in Megatron's training
machinery on one GPU: ``Float16Module`` + DDP + ``get_megatron_optimizer`` (bf16, distributed optimizer with TE's
fused Adam) + ``get_forward_backward_func`` with 2 micro-batches, reusing fake-quantized weights within each step.

After training the quantized forward equals a fresh model given the trained weights and amaxes, bit for bit; a run
saved after 2 of 4 steps (weights, amax, quantization state, optimizer, LR scheduler, iteration) resumes in a freshly
built model and continues bit-identically. (This is the distributed optimizer with TE's fused Adam, one step per
parameter group; with torch's Adam, a step per parameter, tests/distributed/test_readme.py resumes it on CPU.)
"""

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")


import megatron_harness.models as mm  # noqa: E402

import modelopt_moe.quantization as mtq  # noqa: E402
from modelopt_moe.checkpoint import restore_sharded_modelopt_state  # noqa: E402
from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint  # noqa: E402
from modelopt_moe.plugins.megatron import training as mt  # noqa: E402

EXPERTS, STEPS, MICRO = 8, 4, 2


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _build(seed):
    return mm.build_moe_gpt(num_experts=EXPERTS, hidden=128, ffn_hidden=256, seed=seed, experts="te",
                            params_dtype=torch.bfloat16)


def _quantize(model, calib):
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.weight_amax, cfg.experts.input_amax = "vectorized", "per_expert"
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: [mm.lm_loss(m, b) for b in calib])
    return model.train()


def test_te_grouped_qat_in_megatron_loop_is_exact_and_resumes_bit_identically(tmp_path):
    from megatron.core.transformer.module import Float16Module

    calib = mm.text_batches(2, 32, 2)
    batches = mm.text_batches(2, 32, STEPS * MICRO, offset=100)
    eval_batch = mm.text_batches(2, 32, 1, offset=1000)[0]
    model = _quantize(_build(1), calib)
    assert type(model.decoder.layers[0].mlp.experts.linear_fc1).__name__ == "QuantTEColumnParallelGroupedLinear"
    trainer = mt.setup_training(model, lr_decay_steps=STEPS, reuse_quantized_weights=True)
    losses = mt.train(trainer, batches, steps=STEPS // 2, num_microbatches=MICRO)
    ckpt = str(tmp_path / "ckpt")
    save_sharded_checkpoint([trainer.model], ckpt, optimizer=trainer.optimizer, opt_param_scheduler=trainer.scheduler,
                            iteration=STEPS // 2)
    losses += mt.train(trainer, batches, steps=STEPS // 2, num_microbatches=MICRO, start_step=STEPS // 2)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    trained = mt.unwrap(trainer.model)
    with torch.no_grad():
        logits = mm.gather_logits(trainer.model.eval(), eval_batch)

    fresh = Float16Module(trained.config, _quantize(_build(1), calib))
    with torch.no_grad():
        for (n, p), (m, q) in zip(fresh.named_parameters(), trainer.model.module.named_parameters(), strict=True):
            assert n == m
            p.copy_(q)
        for (n, a), (m, b) in zip(fresh.named_buffers(), trainer.model.module.named_buffers(), strict=True):
            if n.endswith("_amax"):
                assert n == m
                a.copy_(b)
        assert torch.equal(mm.gather_logits(fresh.eval(), eval_batch), logits)

    resumed = _build(7)
    restore_sharded_modelopt_state([resumed], ckpt)
    trainer2 = mt.setup_training(resumed, lr_decay_steps=STEPS, reuse_quantized_weights=True)
    info = load_sharded_checkpoint([trainer2.model], ckpt, optimizer=trainer2.optimizer,
                                   opt_param_scheduler=trainer2.scheduler)
    assert info["iteration"] == STEPS // 2
    again = mt.train(trainer2, batches, steps=STEPS // 2, num_microbatches=MICRO, start_step=STEPS // 2)
    assert again == losses[STEPS // 2:]
    for (n, p), (m, q) in zip(mt.unwrap(trainer2.model).named_parameters(), trained.named_parameters(), strict=True):
        assert n == m, n
        assert torch.equal(p, q), n
