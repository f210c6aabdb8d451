"""``mtq.print_quant_summary`` on a Megatron MoE GPT split over ranks: every expert of every rank appears under its
global expert index, on rank 0, and the per-expert amax table is the same at TP=2 x EP=2 and TP=1 x EP=4 (4 gloo
ranks, one spawn, the same weights at both layouts)."""

import re

from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn


def _summaries(rank, world_size):
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

    calib = mm.text_batches(2, 32, 2)
    tables = {}
    for tp, ep in ((2, 2), (1, 4)):
        mm.init_model_parallel(tp, ep, seed=1)
        model = mm.build_moe_gpt(num_experts=8, seed=3).eval()
        cfg = mtq.load_config("nvfp4_experts.yaml")
        mtq.quantize(model, cfg, lambda m: [mm.lm_loss(m, b) for b in calib])
        tables[(tp, ep)] = mtq.print_quant_summary(model, file=False, gather=True)  # a collective: every rank
        mm.destroy_model_parallel()
    return tables


def _expert_rows(summary: str) -> dict[str, dict[int, float]]:
    assert "expert amax by global expert index (every rank's experts: 0-7):" in summary
    table = summary.split("):\n", 1)[1]
    rows = {}
    for line in table.splitlines()[:-1]:  # the last line counts the enabled quantizers
        name, cells = line.split(None, 1)
        rows[name] = {int(g): float(a) for g, a in re.findall(r"(\d+):([0-9.e+-]+)", cells)}
    return rows


def test_the_expert_table_lists_global_experts_and_is_the_same_at_any_layout():
    results = spawn(_summaries, 4, timeout=seconds(900))
    a, b = (_expert_rows(results[0][layout]) for layout in ((2, 2), (1, 4)))
    # 2 layers x fc1/fc2 x weight/input
    assert set(a) == set(b), sorted(a)
    assert len(a) == 8, sorted(a)
    for name in a:
        assert sorted(a[name]) == list(range(8)), (name, a[name])  # every global expert, from every rank
        if "weight_quantizer" in name:
            assert a[name] == b[name], name  # the same weights: the same amax, at any layout
        else:  # inputs: calibrated through another TP split of attention (another summation order)
            assert all(abs(a[name][e] - b[name][e]) <= 0.02 * abs(b[name][e]) for e in range(8)), (name, a, b)
