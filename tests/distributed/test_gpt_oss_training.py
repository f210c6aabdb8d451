"""gpt-oss trains in Megatron's own loop with the local spec (``SequentialMLP`` experts with biases) at every
expert-parallel size, as a user's script does it: public API only (``modelopt_moe.launch.spawn``,
``init_model_parallel``, ``build_megatron_model`` from the shipped ``gpt_oss_tiny.json``, ``mtq.quantize``, Megatron's
``Float16Module`` + DDP + ``get_megatron_optimizer`` with the distributed optimizer, ``get_forward_backward_func``).

Megatron-Core 0.19.2's expert MLP adds the ``linear_fc2`` bias in place to what the row-parallel linear returns, which
at expert-parallel and expert-tensor-parallel size 1 autograd refuses in training; ``build_megatron_model`` builds a
model that trains there. The preset is weight-only so that Megatron's own bias add runs (with the down projection's
input quantizer on, the quantized linear adds the bias itself).

One spawn of 2 gloo ranks, TP 1: at EP 1 (2 data-parallel ranks) the model's logits are bit-identical to those of
the same model taking Megatron's default reduction path, and one training step gives a finite loss and moves every
parameter; at EP 2 the same step, on a model the fix leaves exactly as Megatron builds it.
"""

import json
import math
from importlib import resources

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, SEQ, BATCH, VOCAB = 2, 16, 2, 256
PRESET = "fp8_block_weight_only.yaml"


def _rank(rank, world_size, hf_config):
    from modelopt_moe.plugins.megatron_cpu import enable_cpu_megatron

    enable_cpu_megatron()  # without CUDA only: Megatron's training machinery on the CPU

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.module import Float16Module

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model
    from modelopt_moe.plugins.megatron import get_forward_backward_func, init_model_parallel, lm_forward_step

    g = torch.Generator().manual_seed(100 + rank)  # each data-parallel rank its own tokens
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}

    def expert_fc2s(model):
        return [m for m in model.modules() if isinstance(m, RowParallelLinear) and m.is_expert]

    res = {}
    for ep in (1, 2):
        init_model_parallel(tp=1, ep=ep)
        model = build_megatron_model(hf_config, spec="local")
        res[f"ep{ep}_expert_biases"] = all(m.bias is not None for m in expert_fc2s(model)) and bool(expert_fc2s(model))
        mtq.quantize(model, mtq.load_config(PRESET), lambda m: m(batch["tokens"], batch["position_ids"], None))
        if ep == 1:  # Megatron's default path at this size (the tensor-parallel reduction over one rank) computes
            # the same forward: only the backward through its in-place bias add fails there
            model.eval()
            with torch.no_grad():
                ours = model(batch["tokens"], batch["position_ids"], None)
                flags = [m.explicit_expert_comm for m in expert_fc2s(model)]
                for m in expert_fc2s(model):
                    m.explicit_expert_comm = False
                megatrons = model(batch["tokens"], batch["position_ids"], None)
                for m, flag in zip(expert_fc2s(model), flags, strict=True):
                    m.explicit_expert_comm = flag
            res["ep1_forward_bit_identical"] = torch.equal(ours, megatrons)
        else:  # Megatron itself takes the explicit expert-communication path at EP > 1: nothing changed
            res["ep2_as_megatron_builds_it"] = all(m.explicit_expert_comm for m in expert_fc2s(model))
        model.train()
        config = model.config
        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                        Float16Module(config, model))
        optimizer = get_megatron_optimizer(  # a step bf16 resolves: norm weights of 1 move too
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True), [model])
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(forward_step_func=lm_forward_step, data_iterator=iter([batch]),
                                             model=[model], num_microbatches=1, seq_length=SEQ,
                                             micro_batch_size=BATCH, forward_only=False)
        optimizer.step()
        res[f"ep{ep}_loss"] = losses[0]["lm loss"].item()
        res[f"ep{ep}_unmoved"] = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
        res[f"ep{ep}_params"] = len(before)
    return res


@pytest.fixture(scope="module")
def run():
    hf_config = json.loads(resources.files("modelopt_moe.configs").joinpath("gpt_oss_tiny.json").read_text())
    return spawn(_rank, WORLD, args=(hf_config,), timeout=seconds(600))


@pytest.mark.parametrize("ep", [1, 2])
def test_gpt_oss_local_spec_trains_in_megatrons_loop_at_tp1(run, ep):
    for rank, r in enumerate(run):
        assert r[f"ep{ep}_expert_biases"], f"rank {rank}: the experts' linear_fc2 have no biases"
        assert math.isfinite(r[f"ep{ep}_loss"]), (rank, r[f"ep{ep}_loss"])
        assert r[f"ep{ep}_params"] > 0, rank
        assert not r[f"ep{ep}_unmoved"], (rank, r[f"ep{ep}_unmoved"])


def test_the_ep1_model_computes_megatrons_forward_bit_for_bit(run):
    assert all(r["ep1_forward_bit_identical"] for r in run)


def test_the_ep2_model_is_left_as_megatron_builds_it(run):
    assert all(r["ep2_as_megatron_builds_it"] for r in run)
