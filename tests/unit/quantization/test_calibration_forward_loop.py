"""What a user's ``forward_loop`` sees during ``mtq.quantize``: the model's own outputs, however long calibration
runs and on every rank (public API only, as a user's script calls it)."""

import time

import pytest
import torch
from torch import nn

from modelopt_moe.launch import spawn

CALIBRATION_SECONDS = 2.8  # longer than any delay before a progress display appears


def _quantize_with_a_loss_computing_loop(rank, world_size):
    import modelopt_moe.quantization as mtq

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    batches = [torch.randn(8, 16) for _ in range(4)]
    seen = []

    def forward_loop(m):
        start = time.monotonic()
        while time.monotonic() - start < CALIBRATION_SECONDS:
            for x in batches:
                out = m(x)
                seen.append(type(out).__name__)
                out.float().pow(2).mean().item()  # a loop that uses its outputs (a loss, a metric)
            time.sleep(0.2)

    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop)
    return seen


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
def test_forward_loop_outputs_are_the_models_own_on_every_rank_however_long_calibration_runs():
    for rank, seen in enumerate(spawn(_quantize_with_a_loss_computing_loop, 2, timeout=120)):
        assert len(seen) >= 8, (rank, seen)
        assert set(seen) == {"Tensor"}, f"rank {rank}: forward_loop saw outputs of types {seen}"
