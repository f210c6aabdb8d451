"""``mtq.quantize`` of a model given as a list of chunks (as Megatron's virtual pipeline stages hold it): one
``forward_loop`` over the list calibrates every chunk, as the whole model is calibrated; all or nothing."""

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.quant_module import named_quantizers


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _amaxes(modules) -> list[torch.Tensor]:
    return [q.amax.clone() for m in modules for _, q, _ in named_quantizers(m) if q.amax is not None]


def test_chunks_calibrate_in_one_forward_loop_as_the_whole_model():
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    whole = _model()
    mtq.quantize(whole, mtq.INT8_DEFAULT_CFG, lambda m: [m(x) for x in batches])
    split = _model()
    chunks = [split[:2], split[2:]]
    calls = []

    def forward_loop(model):
        calls.append(model)
        for x in batches:
            model[1](model[0](x))

    assert mtq.quantize(chunks, mtq.INT8_DEFAULT_CFG, forward_loop) is chunks
    assert len(calls) == 1
    assert calls[0] is chunks  # the user's own list
    whole_amax, chunk_amax = _amaxes([whole]), _amaxes(chunks)
    assert len(whole_amax) == len(chunk_amax) == 6  # input and weight amax of each linear
    for a, b in zip(whole_amax, chunk_amax, strict=True):
        assert torch.equal(a, b)
    x = batches[0]
    assert torch.equal(whole(x), chunks[1](chunks[0](x)))


def test_a_failing_forward_loop_leaves_every_chunk_unconverted():
    split = _model()
    chunks = [split[:2], split[2:]]
    before = [type(m) for m in split]

    def forward_loop(model):
        model[0](torch.randn(2, 16))
        raise RuntimeError("data loader broke")

    with pytest.raises(RuntimeError, match="data loader broke"):
        mtq.quantize(chunks, mtq.INT8_DEFAULT_CFG, forward_loop)
    assert [type(m) for m in split] == before


def test_a_list_holding_something_else_is_refused_naming_it():
    with pytest.raises(TypeError, match="model chunk 1 is a str, expected a torch.nn.Module"):
        mtq.quantize([nn.Linear(4, 4), "layer"], mtq.INT8_DEFAULT_CFG)
    with pytest.raises(TypeError, match="empty list"):
        mtq.quantize([], mtq.INT8_DEFAULT_CFG)
