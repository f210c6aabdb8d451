"""GPU tests: one process with one GPU, joined in a one-rank NCCL group with Megatron's parallel state at TP1/EP1."""

import os
import socket

import pytest
import torch


@pytest.fixture(scope="module")
def megatron_one_gpu():
    """torch.distributed (NCCL, world 1) and Megatron's model-parallel groups at TP=1, EP=1, for one test module."""
    import megatron_harness.models as mm
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    mm.init_model_parallel(1, 1, seed=1234)
    yield
    mm.destroy_model_parallel()


@pytest.fixture(autouse=True)
def _fresh_moe_aux_loss_scale():
    """Each test starts without Megatron's process-global MoE aux-loss scale: a backward outside a schedule in one
    test leaves a 0-dim scale that a later test's schedule cannot copy its ``[1]`` scale into."""
    yield
    try:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    except ImportError:
        return
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
