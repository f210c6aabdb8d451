"""Megatron optimizers in our checkpoints: whether the given optimizer fits the state a checkpoint holds, and the
distributed optimizer's state when its inner optimizer is torch's Adam.

Megatron-Core 0.19 saves and loads the distributed optimizer's state right for Transformer Engine's or Apex's fused
Adam (the GPU path), which keeps one ``step`` per parameter group. Without them (a machine without CUDA) Megatron's
inner optimizer is torch's ``AdamW``, which keeps a ``step`` tensor per parameter, and Megatron's code for that case
goes wrong in three places:

* a freshly built optimizer has no state before its first step, and ``sharded_state_dict`` (save, and every load)
  asserts that the state holds exactly one step value (``assert len(steps) == 1`` on every rank):
  :func:`init_torch_adam_state` gives it the state torch's Adam creates at its first step (zeros, step 0), which
  changes no result;
* loading the parameter state copies into every tensor of a parameter's state, ``step`` too, which the checkpoint
  holds once per parameter group (``KeyError: 'step'``);
* loading gives every parameter the same ``step`` tensor, which torch's Adam then increments once per parameter in
  every step: from the first step after a resume the bias correction is wrong.

:func:`load_optimizer_state` loads the parameter state without the step and gives every parameter its own copy of the
saved step (every parameter of Megatron's distributed optimizer steps together: each gets its gradient from the
gradient buffer, so one step per optimizer is what torch's Adam had), and the step after a resume equals the
uninterrupted run's, bit for bit. Everything else is Megatron's own code, and with a fused Adam all of it is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from modelopt_moe.checkpoint.errors import CheckpointMismatchError

__all__ = ["check_optimizer_fits", "init_torch_adam_state", "own_steps", "load_optimizer_state"]

# The parameter-state format save_sharded_checkpoint writes (Megatron-LM's --dist-ckpt-optim-fully-reshardable).
_RESHARDABLE = "fully_reshardable"


def _chain(optimizer) -> list:
    """The optimizers of a Megatron ``ChainedOptimizer`` (dense and expert parameters), or ``[optimizer]``."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def _saved_chain(saved: dict) -> list[dict]:
    """The saved states in ``_chain``'s order (a ChainedOptimizer of several saves ``{0: ..., 1: ...}``)."""
    if saved and all(isinstance(k, int) for k in saved):
        return [v for _, v in sorted(saved.items())]
    return [saved]


def _adam_with_step_per_parameter(optimizer) -> bool:
    """Megatron's distributed optimizer over torch's Adam: the case this module exists for."""
    return (isinstance(optimizer, DistributedOptimizer) and not distrib_optimizer.HAVE_APEX_OR_TE
            and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Adam)
            and not optimizer.ddp_config.use_megatron_fsdp)


def _describe(distributed: bool) -> str:
    return ("Megatron's distributed optimizer (use_distributed_optimizer=True)" if distributed else
            "a non-distributed Megatron optimizer (use_distributed_optimizer=False)")


def check_optimizer_fits(optimizer, saved: dict, path: Path) -> None:
    """Refuses an optimizer that cannot take the optimizer state checkpoint ``path`` holds, before anything loads.

    Args:
        optimizer: the Megatron optimizer given to the load.
        saved: the checkpoint's common state ``["optimizer"]``.
        path: the checkpoint directory (for the message).

    Raises:
        CheckpointMismatchError: the checkpoint holds another number of optimizers, or the state of a distributed
            optimizer where the given one is not (or the reverse); names both and the fix.
    """
    given, held = _chain(optimizer), _saved_chain(saved)
    if len(given) != len(held):
        raise CheckpointMismatchError(
            f"load_sharded_checkpoint: {path} holds the state of {len(held)} optimizer(s), the optimizer given "
            f"({type(optimizer).__name__}) has {len(given)} (Megatron chains one per parameter kind: dense, "
            "experts): build it as the run that saved the checkpoint did (the same trainable parameters and "
            "OptimizerConfig), or load without optimizer=. Nothing was loaded")
    for i, (opt, state) in enumerate(zip(given, held, strict=True)):
        saved_distributed = isinstance(state, dict) and "param_state_sharding_type" in state
        if saved_distributed != isinstance(opt, DistributedOptimizer):
            raise CheckpointMismatchError(
                f"load_sharded_checkpoint: {path} holds the state of {_describe(saved_distributed)}, but the "
                f"optimizer given{f' (chained optimizer {i})' if len(given) > 1 else ''} is "
                f"{type(opt).__name__}, {_describe(not saved_distributed)}: build it with use_distributed_optimizer="
                f"{saved_distributed} in both OptimizerConfig and DistributedDataParallelConfig, as the run that "
                "saved the checkpoint did, or load without optimizer=. Nothing was loaded")


def _first_step_state(param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """The state torch's Adam creates for ``param`` at its first step (``Adam._init_group``)."""
    on_param = group.get("capturable") or group.get("fused")
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 and not group.get("fused") else torch.float32
    state = {"step": torch.zeros((), dtype=dtype, device=param.device if on_param else "cpu"),
             "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def init_torch_adam_state(optimizer) -> None:
    """Gives a distributed optimizer over torch's Adam that has not stepped yet the state of its first step, so that
    Megatron's ``sharded_state_dict`` finds one step value (0); a no-op for any other optimizer or one that has stepped.
    torch's Adam creates the same state at its first step: no result changes."""
    for opt in _chain(optimizer):
        if _adam_with_step_per_parameter(opt) and not opt.optimizer.state:
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    opt.optimizer.state[param] = _first_step_state(param, group)


def own_steps(optimizer) -> None:
    """Every parameter of a distributed optimizer over torch's Adam gets its own ``step`` tensor (Megatron's
    ``load_state_dict`` gives them one, shared)."""
    for opt in _chain(optimizer):
        if _adam_with_step_per_parameter(opt):
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


def _load_adam_distributed(opt: DistributedOptimizer, state: dict) -> None:
    kind = state.get("param_state_sharding_type")
    if kind != _RESHARDABLE:
        raise CheckpointMismatchError(
            f"load_sharded_checkpoint: the distributed optimizer's state is in Megatron's {kind!r} format, which "
            f"Megatron-Core cannot load into torch's Adam; save_sharded_checkpoint writes {_RESHARDABLE!r}")
    opt.load_state_dict({k: v for k, v in state.items() if k != "param_state"})  # groups, step, grad scaler
    steps = {param: s.pop("step") for param, s in opt.optimizer.state.items() if "step" in s}
    try:  # Megatron's loader copies into every tensor of a parameter's state, and the files hold no step per parameter
        opt.load_parameter_state_from_fully_reshardable(state["param_state"])
    finally:
        for param, step in steps.items():
            opt.optimizer.state[param]["step"] = step.clone()


def load_optimizer_state(optimizer, state) -> None:
    """``optimizer.load_state_dict(state)`` for the state ``dist_checkpointing.load`` returned, with the state of a
    distributed optimizer over torch's Adam loaded as the module docstring says (the rest is Megatron's own)."""
    given = _chain(optimizer)
    if not any(_adam_with_step_per_parameter(opt) for opt in given):
        optimizer.load_state_dict(state)
        return
    held = [state] if len(given) == 1 else _saved_chain(state)  # ChainedOptimizer.load_state_dict's order
    for opt, opt_state in zip(given, held, strict=True):
        if _adam_with_step_per_parameter(opt):
            _load_adam_distributed(opt, opt_state)
        else:
            opt.load_state_dict(opt_state)
