"""What the tests of one Megatron MoE layer on the GPU share: its input hidden states."""

import torch


def hidden_states(seed: int, tokens: int, hidden: int, batch: int = 4) -> torch.Tensor:
    """bf16 hidden states ``[tokens // batch, batch, hidden]`` (Megatron's sequence-first layout) on the GPU, drawn
    from ``seed``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens // batch, batch, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
