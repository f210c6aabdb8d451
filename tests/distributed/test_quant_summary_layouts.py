"""``mtq.print_quant_summary`` on a Megatron MoE GPT split over ranks: every expert of every rank appears under its
global expert index, on rank 0, and the per-expert amax table is the same at TP=2 x EP=2 and TP=1 x EP=4 (4 gloo
ranks, one spawn, the same weights at both layouts). One story per summary: with ``gather=True`` every line
describes the whole model (an expert quantizer's line counts all 8 experts, with the range of the table's row);
without it, every line describes this rank (its local experts), and the summary says so first."""

import re

import pytest
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
        tables[(tp, ep, "local")] = mtq.print_quant_summary(model, file=False)  # this rank's alone
        tables[(tp, ep, "ep_rank")] = mm.parallel_layout()["ep_rank"]
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


@pytest.fixture(scope="module")
def results():
    return spawn(_summaries, 4, timeout=seconds(900))


def test_the_expert_table_lists_global_experts_and_is_the_same_at_any_layout(results):
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


def _expert_lines(summary: str) -> dict[str, str]:
    return {line.split()[0]: line.split(None, 1)[1] for line in summary.split("expert amax by", 1)[0].splitlines()
            if ".mlp.experts." in line}


def test_every_line_of_a_summary_tells_the_same_story(results):
    for rank, tables in enumerate(results):
        for tp, ep in ((2, 2), (1, 4)):
            whole, local = tables[(tp, ep)], tables[(tp, ep, "local")]
            rows = _expert_rows(whole)
            lines = _expert_lines(whole)
            assert len(lines) == 12, lines  # 2 layers x fc1/fc2 x input/weight/output
            for name, line in lines.items():
                assert ", 8 experts, " in line, (name, line)  # every rank's experts, as the table's title says
                if name in rows:  # the line's amax range is the table row's
                    lo, hi = min(rows[name].values()), max(rows[name].values())
                    want = f"amax={hi:.4g}" if lo == hi else f"amax[(8,)] {lo:.4g}..{hi:.4g}"
                    assert line.endswith(want), (name, line, rows[name])
            n_local, ep_rank = 8 // ep, tables[(tp, ep, "ep_rank")]
            first = range(ep_rank * n_local, (ep_rank + 1) * n_local)
            assert local.startswith(f"rank {rank}'s quantizers, with its local experts"), local
            assert f"(rank {rank}'s local experts: {first[0]}-{first[-1]}):" in local, local
            assert all(f", {n_local} experts, " in line for line in _expert_lines(local).values()), local
