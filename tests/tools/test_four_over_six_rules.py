"""tools/four_over_six_rules.py, the study-only 4-over-6 selection rules: ``mse`` gives the library's
``nvfp4_four_over_six`` bit for bit, ``l1_norm`` and ``abs_max`` pick the candidate of smaller summed or largest
``|error|`` on hand-made blocks, and :func:`use_rule` changes the format only inside the model's forwards."""

import pytest
import torch
from four_over_six_rules import block_error, four_over_six_quantize, use_rule

from modelopt_moe.numerics import fake_quant, quantize
from modelopt_moe.numerics.nvfp4 import NVFP4_FOUR_OVER_SIX, NVFP4FourOverSixFormat

FMT = NVFP4_FOUR_OVER_SIX.name
SG_ONE = torch.tensor(6.0 * 256)  # sg = amax / (6 * 256) = 1: the block max 6 gets scale 1 (on 6) or 1.5 (on 4)


def _block(*values):
    return torch.tensor([*values, *[0.0] * (16 - len(values))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mse_rule_is_the_library_format_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(64, 256, generator=g),  # normal
                   torch.distributions.StudentT(3.0).sample((64, 256)),  # heavy tails
                   torch.randn(16, 256, generator=g) * 1e-3,  # small blocks: E4M3 scales near their low end
                   torch.zeros(2, 256)])  # all-zero blocks
    x[3, 5], x[70, 17] = float("nan"), float("inf")  # a NaN block and an Inf block stay on 6
    x = x.to(dtype)
    for amax in (x.float().nan_to_num(0, 0, 0).abs().amax(), torch.tensor(0.3), x.float().nan_to_num(0, 0, 0)
                 .abs().amax(-1, keepdim=True)):
        want = quantize(x, FMT, amax)
        got = four_over_six_quantize(NVFP4_FOUR_OVER_SIX, x.float(), amax, "mse")
        torch.testing.assert_close(got.values, want.values, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got.block_scale, want.block_scale, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got.scale, want.scale, rtol=0, atol=0)


def test_each_rule_picks_the_candidate_of_smaller_error_on_hand_made_blocks():
    # With sg = 1, a block of max 6 rounds on E2M1 x 1 (max on 6: 0 .5 1 1.5 2 3 4 6) or E2M1 x 1.5 (max on 4:
    # 0 .75 1.5 2.25 3 4.5 6). Errors (on 6 | on 4) per value: 5 -> 1 | .5; 1 -> 0 | .25; 3.75 -> .25 | .75;
    # 4.5 -> .5 | 0; 6 and 0 -> 0 | 0.
    blocks = torch.stack([
        _block(6, 5, 1, 1, 1, 1),  # squares 1 | .5;       sum 1 | 1.5;      max 1 | .5
        _block(6, 3.75, 4.5, 4.5, 4.5),  # squares .8125 | .5625; sum 1.75 | .75; max .5 | .75
        _block(6),  # every error 0: a tie keeps 6
        _block(6, 5, float("nan")),  # NaN: 6
    ])
    on_four = {"mse": [True, True, False, False], "l1_norm": [False, True, False, False],
               "abs_max": [True, False, False, False]}
    for rule, want in on_four.items():
        q = four_over_six_quantize(NVFP4_FOUR_OVER_SIX, blocks, SG_ONE, rule)
        assert (q.block_scale.flatten() == 1.5).tolist() == want, rule
        assert (q.block_scale.flatten()[[not w for w in want]] == 1.0).all(), rule
    errors = torch.tensor([[0.5, -1.0, 0.25] + [0.0] * 13])
    assert block_error(errors, "mse").item() == 1.3125
    assert block_error(errors, "l1_norm").item() == 1.75
    assert block_error(errors, "abs_max").item() == 1.0
    with pytest.raises(ValueError, match="'l2'"):
        block_error(errors, "l2")


class _Quantizes(torch.nn.Module):
    def forward(self, x):
        return fake_quant(x, FMT, SG_ONE)


def test_use_rule_changes_the_format_only_inside_the_models_forwards(monkeypatch):
    monkeypatch.setattr(NVFP4FourOverSixFormat, "_quantize", NVFP4FourOverSixFormat._quantize)  # restored after
    x = _block(6, 5, 1, 1, 1, 1).unsqueeze(0)
    library = fake_quant(x, FMT, SG_ONE)
    model, other = _Quantizes(), _Quantizes()
    handles = use_rule(model, "l1_norm")
    assert torch.equal(model(x), _block(6, 4, 1, 1, 1, 1).unsqueeze(0))  # l1_norm: the max on 6
    assert torch.equal(library, _block(6, 4.5, 0.75, 0.75, 0.75, 0.75).unsqueeze(0))  # mse: on 4
    assert torch.equal(other(x), library)  # another model, and no model: the library's rule
    assert torch.equal(fake_quant(x, FMT, SG_ONE), library)
    for h in handles:
        h.remove()
    assert torch.equal(model(x), library)
    with pytest.raises(ValueError, match="'l2'"):
        use_rule(model, "l2")
