"""A quantized MoE model with a router aux loss trains through ``get_forward_backward_func`` after a backward the
user ran outside the schedule (a sanity check of the gradients, a first step of their own): Megatron keeps the aux
loss's scale in a process-global that such a backward creates as a 0-dim tensor, into which the schedule then fails
to copy its ``[1]`` scale (``RuntimeError: output with shape [] doesn't match the broadcast shape [1]``)."""

import json

import torch

from modelopt_moe.launch import spawn
from modelopt_moe.quantization.config import preset_path

B, S = 2, 16


def _run(rank, world_size, config):
    from modelopt_moe.plugins.megatron_cpu import enable_cpu_megatron

    enable_cpu_megatron()
    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model
    from modelopt_moe.plugins.megatron import get_forward_backward_func, init_model_parallel, lm_forward_step

    init_model_parallel(tp=1, ep=1)
    model = build_megatron_model(config)
    assert model.config.moe_aux_loss_coeff > 0
    ids = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
             "position_ids": torch.arange(S).expand(B, S).contiguous(),
             "attention_mask": torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]}
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(batch["tokens"], batch["position_ids"], None))
    model.train()
    model(batch["tokens"], batch["position_ids"], None).float().square().mean().backward()  # the user's own
    model.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=lm_forward_step, data_iterator=iter([batch, batch]), model=[model],
                              num_microbatches=2, seq_length=S, micro_batch_size=B, forward_only=False)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return [float(x["lm loss"]) for x in losses], all(g is not None for g in grads)


def test_schedule_trains_after_a_backward_outside_it():
    config = {**json.loads(preset_path("qwen3_moe_tiny.json").read_text()), "router_aux_loss_coef": 0.01}
    ((losses, every_grad),) = spawn(_run, 1, args=(config,), timeout=300)
    assert len(losses) == 2
    assert all(3.0 < x < 8.0 for x in losses), losses  # about ln(256) for an untrained model
    assert every_grad
