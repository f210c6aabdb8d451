"""``SequentialMLP`` experts with biases (gpt-oss in the local spec) trainable at expert-parallel and expert-tensor-
parallel size 1.

Megatron-Core 0.19.2's expert ``MLP`` adds its ``linear_fc2`` bias in place (``output += bias * prob`` in
``MLP.forward``) to what the row-parallel linear returns. With one expert-parallel and one expert-tensor-parallel rank,
that is the output of the tensor-parallel reduction (``reduce_from_tensor_model_parallel_region``, or the
sequence-parallel reduce-scatter), an autograd ``Function`` that returns its input as is over a group of one: autograd
refuses to change such an output in place ("Output 0 of _ReduceFromModelParallelRegion is a view and is being
modified inplace"), so every training backward fails. ``TEGroupedMLP`` (the TE spec) adds its biases out of place and
needs nothing.

Megatron has no setting that keeps its formula and adds out of place; its linears' ``explicit_expert_comm`` flag (a
public attribute that Megatron's own ``SharedExpertMLP`` also sets after construction, for its overlapped
communication) makes ``RowParallelLinear.forward`` return the local GEMM's output itself, leaving the reduction to the
caller. Over a group of one that reduction (forward and backward) is the identity, so the forward and the gradients
are the same numbers, on a tensor the in-place add may change. Everything else the flag touches is the same at this
size too: the linear's ``_forward_impl`` gets ``sequence_parallel=False`` and no gradient all-reduce either way, and
the bias is still returned (the expert linears skip the bias add). At expert-parallel or expert-tensor-parallel
size > 1 Megatron sets the flag itself; this module then changes nothing.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.utils import get_pg_size

__all__ = ["expert_biases_trainable"]


def expert_biases_trainable(model: torch.nn.Module) -> int:
    """Routes every expert ``RowParallelLinear`` with a bias whose reduction group is one rank through Megatron's
    explicit expert communication (see the module docstring: the same numbers, trainable).

    Args:
        model: a Megatron-Core model (any wrapper).

    Returns:
        How many linears changed (0 at expert-parallel or expert-tensor-parallel size > 1, or without expert biases).
    """
    changed = 0
    for module in model.modules():
        if (isinstance(module, RowParallelLinear) and module.is_expert and module.bias is not None
                and module.skip_bias_add and not module.explicit_expert_comm and get_pg_size(module.tp_group) == 1):
            module.explicit_expert_comm = True
            changed += 1
    return changed
