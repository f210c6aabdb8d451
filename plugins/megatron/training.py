"""Megatron's real training machinery around a (quantized) model: ``Float16Module``, ``DistributedDataParallel``,
``get_megatron_optimizer`` and ``get_forward_backward_func``, on GPUs or on CPU (gloo). ``modelopt-moe qat`` and
``modelopt-moe demo`` train through it.

The flow (the shape of Megatron-LM's ``examples/run_simple_mcore_train_loop.py``, with Megatron's own optimizer
instead of ``torch.optim``), inside every rank::

    from modelopt_moe.plugins.megatron import init_model_parallel, training

    init_model_parallel(tp=2, ep=2)
    model = build_megatron_model(hf_dir)                    # or your own model provider
    mtq.quantize(model, cfg, forward_loop)                  # before wrapping
    trainer = training.setup_training(model)                # Float16Module + DDP + distributed optimizer
    loss = training.train_step(trainer, micro_batches)      # one optimizer step over the micro-batches
    training.unwrap(trainer.model)                          # the GPTModel again (its parameters live in DDP's buffers)

With virtual pipeline stages ``setup_training`` takes the list of this stage's model chunks (``vp_stage`` order)
and ``trainer.model`` is the list of their DDP wrappers.

Batches are dicts of ``tokens``, ``labels``, ``position_ids`` and ``attention_mask``
(:func:`~modelopt_moe.plugins.megatron.lm_forward_step`). Every class used is Megatron's; on a machine without CUDA
the calls that need it run inside :func:`modelopt_moe.plugins.megatron_cpu.megatron_training_shims` (a no-op with
CUDA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from modelopt_moe.distill import DistillationModel
from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

from .distill import get_qad_optimizer, qad_lr_scheduler, qad_optimizer_config
from .forward_step import lm_forward_step
from .pipeline_state import stage_chunks, virtual_pipeline_size
from .schedule import get_forward_backward_func as reusing_forward_backward_func
from .schedule import teacher_hidden_state_kwargs

__all__ = ["Trainer", "setup_training", "train", "train_step", "unwrap"]


@dataclasses.dataclass
class Trainer:
    """What :func:`setup_training` built: the DDP-wrapped model (a list of DDP-wrapped chunks when it was given
    virtual pipeline chunks), Megatron's optimizer and LR scheduler, and the schedule that runs the micro-batches of a
    step."""

    model: DistributedDataParallel | list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    bf16: bool
    scheduler: OptimizerParamScheduler | None = None
    reuse_quantized_weights: bool = False
    autoswitch: bool = False
    _schedule: object = dataclasses.field(default=None, repr=False)

    def forward_backward_func(self, step: int = 0):
        """Megatron's schedule, or modelopt_moe's drop-in (created once, at the first step ``step``) that reuses
        fake-quantized weights within a step and counts autoswitch steps."""
        if not (self.reuse_quantized_weights or self.autoswitch):
            return megatron_forward_backward_func()
        if self._schedule is None:
            self._schedule = reusing_forward_backward_func(reuse_quantized_weights=self.reuse_quantized_weights,
                                                           first_step=step)
        return self._schedule


def unwrap(model: torch.nn.Module | Sequence[torch.nn.Module]) -> torch.nn.Module | list[torch.nn.Module]:
    """The innermost module under ``DistributedDataParallel`` / ``Float16Module`` / ``DistillationModel`` wrappers
    (a distillation model's student); of a list of model chunks, the list of theirs."""
    if isinstance(model, (list, tuple)):
        return [unwrap(m) for m in model]
    while isinstance(model, (DistributedDataParallel, Float16Module, DistillationModel)):
        model = model.module
    return model


def setup_training(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    bf16: bool = True,
    use_distributed_optimizer: bool = True,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    lr_decay_steps: int | None = None,
    reuse_quantized_weights: bool = False,
    autoswitch: bool = False,
    recipe=None,
) -> Trainer:
    """Wrap ``model`` for training the Megatron way and build Megatron's optimizer.

    ``bf16=True``: ``Float16Module`` (bf16 parameters; the model should be built with ``params_dtype=bf16`` or it is
    cast here), DDP with gradients reduced in fp32, and ``get_megatron_optimizer`` with ``bf16=True`` (Adam on fp32
    main parameters). ``bf16=False``: fp32 parameters, no ``Float16Module``. The model's ``TransformerConfig`` gets
    ``bf16`` set accordingly, ``finalize_model_grads_func`` (DDP's gradient reduce, the sequence-parallel and
    embedding gradient all-reduces) and ``grad_scale_func`` (the optimizer's loss scale), as Megatron-LM's training
    loop sets them.

    With virtual pipeline stages pass the list of this stage's model chunks (chunk ``i`` built with ``vp_stage=i``),
    as Megatron-LM's training does: each chunk gets its own ``Float16Module`` and DDP (gradient buckets on the first
    chunk only), one optimizer spans the list, and the chunks' config gets Megatron-LM's p2p setting for the
    interleaved schedule (``overlap_p2p_comm=True``, ``batch_p2p_comm=False``: batched, two stages pair activations
    with gradients). :func:`train_step` then runs the interleaved schedule over the list. With ``bf16`` the
    activations sent between pipeline stages are bf16 (``pipeline_dtype``), as the parameters.

    Args:
        model: The (quantized) GPTModel, not wrapped yet, or the list of this stage's model chunks.
        bf16: bf16 parameters with fp32 main parameters, or fp32 throughout.
        use_distributed_optimizer: Megatron's distributed optimizer (optimizer state and main parameters sharded
            over data parallel ranks) or the per-rank Float16 / FP32 optimizer.
        lr: Adam learning rate (constant; no scheduler).
        weight_decay: Adam weight decay.
        clip_grad: Gradient-norm clip (Megatron's ``clip_grads``).
        lr_decay_steps: With a value: Megatron's ``OptimizerParamScheduler``, cosine decay from ``lr`` to
            ``lr / 10`` over that many steps (its state is part of a resumable checkpoint).
        reuse_quantized_weights: Train with ``modelopt_moe.plugins.megatron.get_forward_backward_func``, which reuses
            each module's fake-quantized weights across the micro-batches of a step.
        autoswitch: Train with that function (reusing weights only if asked), whose calls are autoswitch steps.
        recipe: A :class:`~modelopt_moe.distill.QADRecipe`: its optimizer settings and learning-rate schedule over
            ``lr_decay_steps`` steps (required with it) replace ``lr``, ``weight_decay`` and ``clip_grad``. Which
            parameters train is the model's ``requires_grad`` (``select_trainable``).

    Returns:
        The :class:`Trainer`.

    Raises:
        ValueError: one model at virtual pipeline stages (``virtual_pipeline_model_parallel_size`` > 1), or a list
            that is not this stage's chunks in ``vp_stage`` order (names the entry).
    """
    chunks = stage_chunks(model, "setup_training")  # checked: modules, one per virtual stage, vp_stage order
    configs = [get_model_config(c) for c in chunks]
    for config in configs:
        config.bf16, config.fp16 = bf16, False
        if bf16:
            config.pipeline_dtype = torch.bfloat16
        if virtual_pipeline_size() > 1:
            config.overlap_p2p_comm, config.batch_p2p_comm = True, False
    config = configs[0]
    with megatron_training_shims():
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        ddp_chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config,
                                    module=Float16Module(config, chunk) if bf16 else chunk,
                                    disable_bucketing=i > 0)  # as Megatron-LM wraps virtual pipeline chunks
            for i, (config, chunk) in enumerate(zip(configs, chunks, strict=True))
        ]
        precision = dict(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                         use_distributed_optimizer=use_distributed_optimizer)
        if recipe is not None:
            opt_config = qad_optimizer_config(recipe, **precision)
        else:
            opt_config = OptimizerConfig(
                optimizer="adam",
                lr=lr,
                min_lr=lr / 10,  # the scheduler's floor (it reads max_lr / min_lr from each param group)
                weight_decay=weight_decay,
                clip_grad=clip_grad,
                **precision,
            )
        # With a recipe some parameters may be frozen: no empty optimizer in the chain (see get_qad_optimizer).
        build_optimizer = get_qad_optimizer if recipe is not None else get_megatron_optimizer
        extra = {"amax_lr_mult": recipe.amax_lr_mult} if recipe is not None else {}
        optimizer = build_optimizer(opt_config, ddp_chunks, **extra)
    scheduler = None
    if recipe is not None:
        if lr_decay_steps is None:
            raise ValueError("setup_training: a recipe needs lr_decay_steps (the steps its schedule spans)")
        scheduler = qad_lr_scheduler(optimizer, recipe, lr_decay_steps)
    elif lr_decay_steps is not None:
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=lr, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=0, lr_decay_steps=lr_decay_steps,
            lr_decay_style="cosine", start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=lr_decay_steps,
            wd_incr_style="constant")
    for config in configs:
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
    ddp_model = ddp_chunks if isinstance(model, (list, tuple)) else ddp_chunks[0]
    return Trainer(model=ddp_model, optimizer=optimizer, bf16=bf16, scheduler=scheduler,
                   reuse_quantized_weights=reuse_quantized_weights, autoswitch=autoswitch)


def train_step(trainer: Trainer, micro_batches: Sequence[dict[str, torch.Tensor]], step: int = 0,
               after_backward: Callable[[], None] | None = None) -> float:
    """One optimizer step over ``micro_batches`` (gradient accumulation through ``get_forward_backward_func``);
    ``step`` is its index (the first one starts the autoswitch step count). ``after_backward`` is called once the
    gradients are reduced into ``param.main_grad`` (all of them with the per-rank optimizer; this rank's shard with
    the distributed one), before the optimizer step.

    Returns:
        The mean loss over the micro-batches (the same on every rank).

    Raises:
        RuntimeError: The optimizer skipped the step (non-finite gradients).
    """
    model, optimizer = trainer.model, trainer.optimizer
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        chunk.train()
    seq_len = micro_batches[0]["tokens"].shape[1]
    micro_batch_size = micro_batches[0]["tokens"].shape[0]
    schedule = trainer.forward_backward_func(step)
    shape_kwargs = {"micro_batch_size": micro_batch_size}
    if schedule is megatron_forward_backward_func():  # modelopt_moe's drop-in passes these itself
        shape_kwargs = teacher_hidden_state_kwargs(chunks, shape_kwargs)
    # Megatron's interleaved schedule reads one data iterator per chunk, each the step's micro-batches in order.
    data = [iter(micro_batches) for _ in chunks] if isinstance(model, list) else iter(micro_batches)
    with megatron_training_shims():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reported = schedule(
            forward_step_func=lm_forward_step,
            data_iterator=data,
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            decoder_seq_length=seq_len,
            forward_only=False,
            **shape_kwargs,
        )
        if after_backward is not None:  # the schedule's finalize_model_grads has reduced the gradients
            after_backward()
        update_successful, _grad_norm, _num_zeros = optimizer.step()
    if not update_successful:
        raise RuntimeError("train_step: the optimizer skipped the update (non-finite gradients)")
    if trainer.scheduler is not None:
        trainer.scheduler.step(increment=1)
    return _mean_reported_loss(reported)


def _mean_reported_loss(reported: list) -> float:
    """The mean of the micro-batches' losses; with pipeline parallelism only the last stage has them, so every
    stage takes the last stage's value (one broadcast over the pipeline group, on every rank alike)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return float(torch.stack([r["lm loss"] for r in reported]).mean())
    loss = torch.stack([r["lm loss"] for r in reported]).mean().reshape(1) if reported else torch.zeros(1)
    group = parallel_state.get_pipeline_model_parallel_group()
    torch.distributed.broadcast(loss.float(), src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
    return float(loss)


def train(
    trainer: Trainer, batches: Sequence[dict[str, torch.Tensor]], steps: int, num_microbatches: int = 2,
    start_step: int = 0,
) -> list[float]:
    """``steps`` optimizer steps, step ``s`` over the ``num_microbatches`` consecutive items of ``batches`` (cycled)
    that follow those of the steps before it.

    Args:
        trainer: From :func:`setup_training`.
        batches: Micro-batches (dicts of ``tokens``, ``labels``, ``position_ids``, ``attention_mask``).
        steps: Optimizer steps.
        num_microbatches: Micro-batches per step (gradient accumulation).
        start_step: The index of the first step (a resumed run continues with the data of its iteration).

    Returns:
        The loss of every step.
    """
    return [train_step(trainer, [batches[(s * num_microbatches + m) % len(batches)] for m in range(num_microbatches)],
                       step=s)
            for s in range(start_step, start_step + steps)]
