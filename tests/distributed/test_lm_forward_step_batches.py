"""``lm_forward_step`` in Megatron's schedule, as the README's ``qat(...)`` calls it: a batch that breaks the batch
contract raises ``BatchError`` naming the key, what it holds and what is expected, before the model runs; a batch
that keeps it (labels outside the vocabulary only where ``loss_mask`` drops them) trains."""

import json

import pytest
import torch

from modelopt_moe.launch import spawn
from modelopt_moe.quantization.config import preset_path

B, S = 2, 16


def _batch(**changes):
    ids = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
             "position_ids": torch.arange(S).expand(B, S).contiguous(),
             "attention_mask": torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]}
    for key, value in changes.items():
        if value is None:
            del batch[key]
        else:
            batch[key] = value(batch[key]) if callable(value) else value
    return batch


def _bad_batches():
    loss_mask = torch.ones(B, S)
    loss_mask[:, -1] = 0  # the last position does not count: its label may be anything (e.g. -100)
    return {
        "no position_ids": _batch(position_ids=None),
        "token beyond the vocabulary": _batch(tokens=lambda t: t.index_put((torch.tensor([1]), torch.tensor([3])),
                                                                           torch.tensor(256))),
        "negative label": _batch(labels=lambda t: t.index_put((torch.tensor([0]), torch.tensor([0])),
                                                              torch.tensor(-100))),
        "int32 tokens": _batch(tokens=lambda t: t.int()),
        "float attention_mask": _batch(attention_mask=lambda m: m.float()),
        "loss_mask of another shape": _batch(loss_mask=torch.ones(B * S)),
        "masked labels outside the vocabulary": _batch(labels=lambda t: t.index_put(
            (torch.arange(B), torch.full((B,), S - 1)), torch.tensor(-100)), loss_mask=loss_mask),
    }


def _run(rank, world_size, config):
    from modelopt_moe.plugins.megatron_cpu import enable_cpu_megatron

    enable_cpu_megatron()
    from megatron.core.transformer.module import Float16Module

    from modelopt_moe.export import build_megatron_model
    from modelopt_moe.plugins.megatron import (
        BatchError,
        get_forward_backward_func,
        init_model_parallel,
        lm_forward_step,
    )

    init_model_parallel(tp=1, ep=1)
    model = build_megatron_model(config, params_dtype=torch.bfloat16, bf16=True)
    model = Float16Module(model.config, model)  # the vocabulary is found inside the wrapper
    forward_backward = get_forward_backward_func()
    out = {}
    for name, batch in _bad_batches().items():
        try:
            losses = forward_backward(forward_step_func=lm_forward_step, data_iterator=iter([batch]), model=[model],
                                      num_microbatches=1, seq_length=S, micro_batch_size=B, forward_only=True)
            out[name] = ("ran", float(losses[0]["lm loss"]))
        except BatchError as e:
            out[name] = ("BatchError", str(e))
    return out


@pytest.mark.slow
def test_lm_forward_step_refuses_batches_that_break_the_contract_naming_key_value_and_expectation():
    config = json.loads(preset_path("qwen3_moe_tiny.json").read_text())
    (out,) = spawn(_run, 1, args=(config,), timeout=300)
    expected = {
        "no position_ids": "lm_forward_step: the batch: no position_ids (its keys: ['attention_mask', 'labels', "
                           "'tokens'])",
        "token beyond the vocabulary": "to 256 (1 of 32 outside the model's vocabulary of 256: ids 0..255); an id "
                                       "beyond it would train on a zero embedding",
        "negative label": "labels hold ids from -100 to",
        "int32 tokens": "tokens is a torch.int32 tensor of shape [2, 16], expected an int64 tensor [batch, seq]",
        "float attention_mask": "attention_mask is a torch.float32 tensor of shape [1, 1, 16, 16], expected a bool "
                                "tensor broadcastable to [2, 1, 16, 16]",
        "loss_mask of another shape": "loss_mask is a torch.float32 tensor of shape [32], expected a tensor of the "
                                      "tokens' shape [2, 16]",
    }
    for name, text in expected.items():
        kind, message = out[name]
        assert kind == "BatchError", (name, message)
        assert text in message, (name, message)
        assert "; expected a dict of tokens, labels, position_ids (int64 [batch, seq]" in message, message
    kind, loss = out["masked labels outside the vocabulary"]
    assert kind == "ran", loss
    assert 3.0 < loss < 8.0, loss  # about ln(256) for an untrained model
