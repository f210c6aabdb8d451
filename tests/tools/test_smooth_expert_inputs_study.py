"""tools/smooth_expert_inputs_study.py: its per-channel transforms of the experts preserve a small Megatron MoE GPT's
function (SwiGLU, SequentialMLP and grouped experts, fp32 and bf16), are refused by name where they would not
(non-gated, clamped or offset GLUs), and the tool runs end to end."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402
from smooth_expert_inputs_study import parse_transform, smoothing_scales, spread_order

from modelopt_moe.launch import spawn

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "smooth_expert_inputs_study.py")


def test_smoothquant_and_block_equalizer_scales():
    x = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0])
    assert torch.equal(smoothing_scales(x, w, 0.5), torch.tensor([2.0, 0.5, 1.0, 1.0]))  # no token / zero column: 1
    assert torch.equal(smoothing_scales(x, w, 1.0), torch.tensor([4.0, 1.0, 1.0, 1.0]))
    assert torch.equal(smoothing_scales(torch.tensor([3.0]), torch.tensor([1.0]), 0.5, pow2=True), torch.tensor([2.0]))
    # blocks of 2: each channel's amax raised to its block's largest
    assert torch.equal(smoothing_scales(torch.tensor([4.0, 1.0, 2.0, 8.0, 5.0]), torch.ones(5), None, block=2),
                       torch.tensor([1.0, 0.25, 0.25, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"alpha=1.5; expected a value in \[0, 1\]"):
        smoothing_scales(x, w, 1.5)
    with pytest.raises(ValueError, match="non-finite"):
        smoothing_scales(torch.tensor([float("nan")]), torch.ones(1), 0.5)


def test_scales_are_smoothquant_rounded_to_powers_of_two_and_one_where_nothing_was_seen():
    x = torch.tensor([4.0, 1.0, 0.0, 9.0, 3.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0, 1.0])
    # sqrt(4/1) = 2, sqrt(1/4) = 0.5, no token: 1, dead column: 1, sqrt(3) = 1.73 -> 2
    assert torch.equal(smoothing_scales(x, w, 0.5, pow2=True), torch.tensor([2.0, 0.5, 1.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"alpha=1.5; expected a value in \[0, 1\]"):
        smoothing_scales(x, w, 1.5)


def test_spread_deals_the_largest_channels_one_per_block():
    order = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])  # channels, largest first
    assert spread_order(order, block=4).tolist() == [5, 7, 1, 3, 0, 2, 6, 4]
    with pytest.raises(ValueError, match="experts.0: 6 channels is not a multiple of the block 4"):
        spread_order(torch.arange(6), "experts.0", block=4)


def test_transform_specs_parse_and_bad_ones_are_named():
    assert parse_transform("none") == []
    assert parse_transform("smooth0.5p2+perm") == [("smooth", 0.5, True), ("perm", None, False)]
    assert parse_transform("blockeq") == [("blockeq", None, False)]
    assert parse_transform("fc1in0.25") == [("fc1in", 0.25, False)]
    assert parse_transform("spread+ship0.5") == [("spread", None, False), ("ship", 0.5, True)]
    for spec, message in [("smooth", "unknown step 'smooth'"), ("smooth2", "alpha 2.0 outside"),
                          ("perm+gptq", "unknown step 'gptq'"), ("ship0.5+perm", "put it last")]:
        with pytest.raises(ValueError, match=re.escape(f"transform '{spec}'")) as info:
            parse_transform(spec)
        assert message in str(info.value)


def _worker(rank, world_size):
    import megatron_harness.models as mm
    import torch.nn.functional as F
    from smooth_expert_inputs_study import apply_transform

    mm.init_model_parallel(1, 1, seed=7)
    batches = mm.text_batches(2, 32, 2)

    def logits(model):
        with torch.no_grad():
            return torch.cat([model(b["tokens"], b["position_ids"], b["attention_mask"]) for b in batches])

    def loop(model):
        logits(model)

    swiglu = {"gated_linear_unit": True, "activation_func": F.silu}
    out = {}
    for experts in ("sequential", "grouped"):
        for dtype, spec in ((torch.float32, "smooth0.5"), (torch.float32, "blockeq+perm"), (torch.float32, "awq"),
                            (torch.bfloat16, "smooth0.5p2"), (torch.bfloat16, "smooth0.5"),
                            (torch.bfloat16, "fc1in0.5p2+smooth0.5p2")):
            model = mm.build_moe_gpt(ffn_hidden=64, num_experts=4, params_dtype=dtype, experts=experts,
                                     **swiglu).eval()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            ref = logits(model)
            apply_transform(model, spec, loop)
            moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
            out[(experts, str(dtype), spec)] = ((logits(model).float() - ref.float()).abs().max().item(),
                                                ref.float().abs().max().item(), moved)
    gelu = mm.build_moe_gpt(ffn_hidden=64, num_experts=4).eval()
    ref = logits(gelu)
    apply_transform(gelu, "perm+spread", loop)  # any elementwise activation: a permutation of the channels
    out["gelu perm"] = (logits(gelu) - ref).abs().max().item(), ref.abs().max().item()
    before = {n: p.detach().clone() for n, p in gelu.named_parameters()}
    apply_transform(gelu, "fc1in0.5", loop)  # fc1's inputs: scaled before the activation
    out["gelu fc1in"] = ((logits(gelu) - ref).abs().max().item(), ref.abs().max().item(),
                         [n for n, p in gelu.named_parameters() if not torch.equal(p, before[n])])
    errors = {}
    for name, spec, model in (
            ("gelu", "smooth0.5", gelu),
            ("clamped", "smooth0.5", mm.build_moe_gpt(ffn_hidden=64, num_experts=4, activation_func_clamp_value=7.0,
                                                      **swiglu)),
            ("offset", "smooth0.5", mm.build_moe_gpt(ffn_hidden=64, num_experts=4, glu_linear_offset=1.0, **swiglu)),
            ("shared", "fc1in0.5", mm.build_moe_gpt(ffn_hidden=64, num_experts=4,
                                                    moe_shared_expert_intermediate_size=64))):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            apply_transform(model, spec, loop)
        except ValueError as e:
            errors[name] = (str(e), all(torch.equal(p, before[n]) for n, p in model.named_parameters()))
    mm.destroy_model_parallel()
    return out, errors


def test_transforms_preserve_the_model_and_unsound_experts_are_refused_by_name():
    out, errors = spawn(_worker, 1, timeout=seconds(300))[0]
    for experts in ("sequential", "grouped"):
        for key, tol in [(("float32", "smooth0.5"), 1e-5), (("float32", "blockeq+perm"), 1e-5),
                         (("float32", "awq"), 1e-5),
                         (("bfloat16", "smooth0.5p2"), 0.0),  # powers of two: exact in bf16
                         (("bfloat16", "smooth0.5"), 0.05),  # the scaled weights round to bf16
                         (("bfloat16", "fc1in0.5p2+smooth0.5p2"), 0.0)]:
            diff, scale, moved = out[(experts, f"torch.{key[0]}", key[1])]
            assert diff <= tol * scale, (experts, key, diff, scale)
            assert any("linear_fc1" in n for n in moved), (experts, key)
            assert any("linear_fc2" in n for n in moved), (experts, key)
            assert all("experts" in n for n in moved) != key[1].startswith("fc1in"), moved
    diff, scale = out["gelu perm"]
    assert diff <= 1e-5 * scale
    diff, scale, moved = out["gelu fc1in"]
    assert diff <= 1e-5 * scale
    assert {n.split(".")[3] for n in moved} == {"pre_mlp_layernorm", "mlp"}, moved
    assert any("router.weight" in n for n in moved), moved
    assert not any("linear_fc2" in n for n in moved), moved
    message, untouched = errors["gelu"]
    assert "expert decoder.layers.0.mlp.experts.local_experts.0: gated_linear_unit=False (gelu" in message
    assert untouched  # refused before any weight changed
    assert "activation_func_clamp_value=7.0" in errors["clamped"][0]
    assert "glu_linear_offset=1.0" in errors["offset"][0]
    assert "layer decoder.layers.0: shared experts read the MoE input too" in errors["shared"][0]
    assert all(untouched for _, untouched in errors.values())


@pytest.mark.slow
def test_quick_run_prints_every_transform_and_refuses_scales_on_the_gelu_model():
    res = subprocess.run([sys.executable, TOOL, "--quick", "--glu", "swiglu", "--variants", "none", "smooth0.5p2",
                          "perm"], capture_output=True, text=True, timeout=seconds(600))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split(" | ") for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0] for r in rows[1:]] == ["| none", "| smooth0.5p2", "| perm"], res.stdout
    assert rows[2][1] == "0.0e+00"  # powers of two: the bf16 model is unchanged
    res = subprocess.run([sys.executable, TOOL, "--variants", "none", "smooth0.5"], capture_output=True, text=True,
                         timeout=seconds(120))
    assert res.returncode != 0
    assert "transform 'smooth0.5' scales fc2's input channels: --glu none" in res.stderr, res.stderr
