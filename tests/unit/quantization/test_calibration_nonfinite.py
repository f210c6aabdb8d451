"""Calibration data with Inf or NaN, through ``mtq.quantize`` / ``mtq.calibrate`` as a user's script calls them: an
Inf (an infinite amax, i.e. no calibration) is refused naming the quantizers and the counts, with the model left as
it was; NaN is counted and reported once; finite data calibrates exactly as before."""

import re
import warnings

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.launch import spawn
from modelopt_moe.quantization.nn import GroupedLinear


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def test_inf_in_the_calibration_data_is_refused_naming_the_quantizers_and_the_model_is_unchanged():
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 16)
    x[3, 5] = float("inf")
    with pytest.raises(mtq.CalibrationError) as err:
        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(x))
    message = str(err.value)
    assert "0.input_quantizer: 0 NaN, 1 Inf seen; amax inf" in message, message
    assert "scale of 1" in message, message
    assert "0.weight_quantizer" not in message, message  # the weights were finite
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]  # all or nothing
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_nan_in_the_calibration_data_warns_once_with_counts_and_the_amax_is_that_of_the_finite_values():
    x = torch.randn(8, 16)
    clean = x.clone()
    x[0, :3] = float("nan")
    clean[0, :3] = 0.0  # where the NaN were: what a NaN-ignoring max sees
    with pytest.warns(UserWarning, match=r"held 19 NaN values") as record:
        noisy = mtq.quantize(_mlp(), mtq.FP8_DEFAULT_CFG, lambda m: m(x))
    message = "\n".join(str(w.message) for w in record if "NaN" in str(w.message))
    assert "0.input_quantizer: 3 NaN, 0 Inf seen" in message, message
    assert "2.input_quantizer: 16 NaN, 0 Inf seen" in message, message  # the first layer made NaN of them
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # finite data: no warning
        reference = mtq.quantize(_mlp(), mtq.FP8_DEFAULT_CFG, lambda m: m(clean))
    assert torch.equal(noisy[0].input_quantizer.amax, reference[0].input_quantizer.amax)
    assert torch.equal(noisy[0].weight_quantizer.amax, reference[0].weight_quantizer.amax)


def test_inf_in_one_experts_tokens_names_the_expert_quantizer():
    torch.manual_seed(0)
    experts = GroupedLinear(num_gemms=4, in_features=64, out_features=32)
    tokens, splits = torch.randn(40, 64), [10, 5, 0, 25]
    tokens[12, 0] = -float("inf")  # expert 1 (rows 10..14); the shared input amax of every expert is then infinite
    expected = r"\n  input_quantizer: 0 NaN, 1 Inf seen; amax 4 of 4 entries non-finite\n"
    with pytest.raises(mtq.CalibrationError, match=expected):
        mtq.quantize(experts, mtq.FP8_DEFAULT_CFG, lambda m: m(tokens, splits))


def _calibrate_with_inf_on_rank_1(rank, world_size):
    import torch.distributed as dist

    import modelopt_moe.quantization as mtq

    model = mtq.quantize(_mlp(), mtq.FP8_DEFAULT_CFG, lambda m: m(torch.ones(2, 16)))
    before = model[0].input_quantizer.amax.clone()
    x = torch.randn(8, 16)
    if rank == 1:
        x[0, 0] = float("inf")
    try:
        mtq.calibrate(model, "max", lambda m: m(x), groups={"dp": dist.group.WORLD})
    except mtq.CalibrationError as e:
        return str(e), torch.equal(model[0].input_quantizer.amax, before)
    return None, None


@pytest.mark.slow  # spawned ranks
def test_every_rank_refuses_when_one_ranks_data_held_inf():
    (msg0, kept0), (msg1, kept1) = spawn(_calibrate_with_inf_on_rank_1, 2, timeout=120)
    # both ranks raise: one that went on would wait in its next collective
    assert [msg0 is None, msg1 is None] == [False, False]
    assert re.search(r"held \d+ infinite and 0 NaN values on all ranks", msg0), msg0
    assert "0.input_quantizer: 0 NaN, 0 Inf seen; amax inf (max-reduced from another rank)" in msg0, msg0
    assert "0.input_quantizer: 0 NaN, 1 Inf seen" in msg1, msg1
    assert [kept0, kept1] == [True, True]  # mtq.calibrate puts every quantizer back
