"""``mtq.print_quant_summary`` called from one rank, as everyone prints (``if rank == 0:``), enters no collective:
the other ranks' next collective is unaffected (public API only, as a user's script calls it)."""

import pytest
import torch
import torch.distributed as dist

from modelopt_moe.launch import spawn


def _summary_on_rank0_then_a_collective(rank, world_size):
    import modelopt_moe.quantization as mtq
    from modelopt_moe.quantization.nn import GroupedLinear

    torch.manual_seed(0)
    experts = GroupedLinear(num_gemms=4, in_features=32, out_features=16)
    tokens, splits = torch.randn(12, 32), [3, 3, 0, 6]
    mtq.quantize(experts, mtq.FP8_DEFAULT_CFG, lambda m: m(tokens, splits))
    text = None
    if rank == 0:
        text = mtq.print_quant_summary(experts, file=False)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the next collective of a training script
    gathered = mtq.print_quant_summary(experts, file=False, gather=True)  # opt-in: every rank calls it
    return text, total.item(), gathered


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
def test_summary_from_rank0_alone_leaves_the_next_collective_of_every_rank_intact():
    results = spawn(_summary_on_rank0_then_a_collective, 2, timeout=60)
    assert [total for _, total, _ in results] == [3.0, 3.0]
    text = results[0][0]
    assert text.startswith("rank 0's quantizers, with its local experts")
    assert "(rank 0's local experts: 0-3):" in text
    assert "0 of" not in text.splitlines()[-1]
    assert "every rank's experts" in results[0][2]
