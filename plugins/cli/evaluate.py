"""What the ``modelopt-moe`` commands measure on a Megatron GPT at any parallel layout: the LM loss, the full logits,
the KL to a teacher, and the layout-independent state a checkpoint round trip is compared by.

Batches are :func:`~modelopt_moe.plugins.cli.text_data.text_batches` items (``tokens``, ``labels``,
``position_ids``, ``attention_mask``), or any batch of the contract of
:mod:`modelopt_moe.plugins.megatron.batches` (a ``loss_mask`` weights the losses as in training). Every function
here that reduces or gathers must be called by every rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.experts import TEGroupedMLP

from modelopt_moe.plugins.megatron.forward_step import lm_loss_func

__all__ = ["lm_loss", "gather_logits", "loss_and_kl", "held_out_metrics", "iter_params_with_global_names",
           "global_param_name", "global_state"]

_LOCAL_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")
# A grouped expert weight (TEGroupedMLP): ".experts.linear_fc1.weight3" is local expert 3's fc1 weight.
_GROUPED_EXPERT_RE = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def _to_model_device(batch: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in batch.items()}


def lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` (a ``GPTModel``) on ``batch`` (over the tokens its ``loss_mask``
    keeps, if it has one); differentiable.

    Megatron computes the vocab-parallel cross-entropy, so the value is the same on every rank of any layout.
    """
    b = _to_model_device(batch, model)
    per_token = model(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])
    return lm_loss_func(b.get("loss_mask"), per_token)[0]


def gather_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Full-vocabulary logits ``[batch, seq, vocab]`` (gathered over TP), the same on every rank of any layout."""
    b = _to_model_device(batch, model)
    return model(b["tokens"], b["position_ids"], b.get("attention_mask"), runtime_gather_output=True)


def loss_and_kl(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]],
                teacher: torch.nn.Module | None = None, tp_group=None) -> dict[str, Any]:
    """The mean LM loss of ``model`` on ``batches`` and its mean KL to ``teacher`` (None without one), without
    gradient, in eval mode (the training mode is restored), and both per batch (``losses``, ``kls``: their spread
    is the noise of the means). ``tp_group``: the vocabulary-parallel group of the logits. Every rank must call it
    (the losses reduce over tensor-parallel ranks)."""
    from modelopt_moe.distill import logits_kl_loss

    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses = torch.stack([lm_loss(model, b) for b in batches])
        kls = None
        if teacher is not None:
            per_batch = []
            for batch in batches:
                b = _to_model_device(batch, model)
                args = (b["tokens"], b["position_ids"], b.get("attention_mask"))
                kl = logits_kl_loss(model(*args), teacher(*args), tp_group=tp_group)
                per_batch.append(lm_loss_func(b.get("loss_mask"), kl)[0])
            kls = torch.stack(per_batch)
    model.train(was_training)
    return {"loss": float(losses.mean()), "kl": None if kls is None else float(kls.mean()),
            "losses": losses.tolist(), "kls": None if kls is None else kls.tolist()}


def held_out_metrics(model: torch.nn.Module, teacher: torch.nn.Module | None,
                     batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, float | None]:
    """:func:`loss_and_kl` over Megatron's tensor-parallel group, with the perplexity ``exp(loss)``: ``{"loss",
    "perplexity", "kl"}`` (``kl`` None without a teacher). Every rank must call it."""
    out = loss_and_kl(model, batches, teacher, parallel_state.get_tensor_model_parallel_group())
    perplexity = math.exp(out["loss"]) if out["loss"] < 700 else math.inf
    return {"loss": out["loss"], "perplexity": perplexity, "kl": out["kl"]}


def global_param_name(name: str, num_local_experts: int, ep_rank: int) -> str:
    """Parameter name with the local expert index replaced by the global one (layout-independent).

    Grouped experts' ``...experts.linear_fc1.weight{i}`` maps to the ``SequentialMLP`` name
    ``...experts.local_experts.{g}.linear_fc1.weight`` of the same global expert ``g``, so both expert kinds
    get the same names.
    """
    grouped = _GROUPED_EXPERT_RE.search(name)
    if grouped:
        g = ep_rank * num_local_experts + int(grouped.group(3))
        return f"{name[:grouped.start()]}.experts.local_experts.{g}.{grouped.group(1)}.{grouped.group(2)}"
    return _LOCAL_EXPERT_RE.sub(
        lambda m: f".local_experts.{ep_rank * num_local_experts + int(m.group(1))}.", name
    )


def _num_local_experts(model: torch.nn.Module) -> int:
    for m in model.modules():
        if hasattr(m, "local_experts"):
            return len(m.local_experts)
        if isinstance(m, TEGroupedMLP):
            return m.num_local_experts
    return 0


def iter_params_with_global_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Yield ``(name, param)`` with local expert indices replaced by global ones (for cross-layout checks)."""
    n_local = max(1, _num_local_experts(model))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for name, p in model.named_parameters():
        yield global_param_name(name, n_local, ep_rank), p


def global_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tensor-parallel shards concatenated; experts under their global index) and every quantizer
    amax (expert amaxes per global expert), the same dict on every rank of any layout: compare checkpoints across
    layouts with it. Every rank must call it (all-gathers over the TP group and the world)."""
    from modelopt_moe.checkpoint import iter_expert_quantizers
    from modelopt_moe.quantization.conversion import named_quantizers

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    local: dict[str, torch.Tensor] = {}
    for name, p in iter_params_with_global_names(model):
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        local[name] = t.cpu().clone()
    for e in iter_expert_quantizers(model):
        grid, q = e.owner.expert_grid(), e.quantizer
        for i in range(e.gemm.num_local):
            if q.amax is not None:
                local[f"{e.name}.{grid.global_index(e.gemm.num_local, i)}._amax"] = q.expert_amax(i).detach().cpu()
    experts = {e.name for e in iter_expert_quantizers(model)}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for name, q, _ in named_quantizers(model):
        if name not in experts and q.amax is not None:  # a per-channel dense amax may hold this TP rank's channels
            key = f"{name}._amax" if q.axis is None else f"{name}._amax@tp{tp_rank}of{tp}"
            local[key] = q.amax.detach().cpu().clone()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged
