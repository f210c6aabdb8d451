"""What the KL to the teacher does not show: whether the student picks the teacher's token, and how it generates.

* :func:`top1_agreement`: teacher-forced, the share of positions where the student's most likely next token is the
  teacher's (on vocabulary-parallel logits, without gathering them);
* :func:`greedy_generate` and :func:`generation_stats`: greedy continuations of a few held-out prompts by student and
  teacher, the share of generated tokens they agree on, and each one's end-of-sequence rate and mean length (a
  student that stops later or never, at the same KL, shows here).

Every function here runs the same collectives on every rank, whatever the data (generation always runs its
``max_new_tokens`` steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["top1_agreement", "greedy_generate", "generation_stats", "held_out_prompts"]


def _vocab_parallel_argmax(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """The index of the largest logit over the whole vocabulary (the first of equals, as ``argmax``), from this rank's
    ``[..., V / tp]`` slice: one all-reduce of the maxima, one of the candidates."""
    size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    values, index = logits.float().max(-1)
    if size == 1:
        return index
    index = index + dist.get_rank(tp_group) * logits.shape[-1]
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=tp_group)
    candidate = torch.where(values == best, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=tp_group)
    return candidate


def top1_agreement(model: torch.nn.Module, teacher: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]],
                   tp_group=None) -> list[float]:
    """Teacher-forced top-1 agreement, per batch: the share of positions where ``model``'s most likely next token
    is ``teacher``'s. Without gradient, in eval mode (``model``'s training mode is restored). Every rank must call
    it."""
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for batch in batches:
            device = next(model.parameters()).device
            args = tuple(batch[k].to(device) for k in ("tokens", "position_ids", "attention_mask"))
            same = _vocab_parallel_argmax(model(*args), tp_group) == _vocab_parallel_argmax(teacher(*args), tp_group)
            out.append(same.float().mean().item())
    model.train(was_training)
    return out


def greedy_generate(model: torch.nn.Module, prompts: torch.Tensor, max_new_tokens: int, *, multiple_of: int = 1
                    ) -> torch.Tensor:
    """Greedy continuation ``[n, max_new_tokens]`` of ``prompts`` (``[n, P]`` token ids) by a Megatron GPT, without
    a cache (each step reruns the whole prefix). The input is right-padded to a multiple of ``multiple_of`` (the
    tensor-parallel size under sequence parallelism); causal attention keeps the padding out of the real positions.
    Every rank gets the same tokens (the logits are gathered over the vocabulary). Every rank must call it."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = prompts.to(device)
    n, prompt_len = tokens.shape
    with torch.no_grad():
        for _ in range(max_new_tokens):
            length = tokens.shape[1]
            padded = -(-length // multiple_of) * multiple_of
            x = torch.nn.functional.pad(tokens, (0, padded - length))
            positions = torch.arange(padded, device=device).expand(n, padded)
            mask = torch.ones(padded, padded, dtype=torch.bool, device=device).triu(1)[None, None]
            logits = model(x, positions, mask, runtime_gather_output=True)
            tokens = torch.cat([tokens, logits[:, length - 1].float().argmax(-1, keepdim=True)], 1)
    model.train(was_training)
    return tokens[:, prompt_len:].cpu()


def _lengths(generated: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the number of tokens up to and with the first end token (all of them without one), and whether
    it ended."""
    is_eos = generated == eos_token_id
    ended = is_eos.any(-1)
    first = torch.where(ended, is_eos.float().argmax(-1) + 1, torch.full_like(ended, generated.shape[1],
                                                                                dtype=torch.long))
    return first, ended


def generation_stats(generated: torch.Tensor, eos_token_id: int, reference: torch.Tensor | None = None) -> dict:
    """``{"mean length", "end rate", "same tokens as the reference"}`` of greedy generations ``[n, M]``: the mean
    number of tokens up to and with the first ``eos_token_id`` (M without one), the share of sequences that emitted
    it, and the share of positions, up to the shorter of each pair's lengths, where ``generated`` has the token of
    ``reference`` (the teacher's generation; None without one)."""
    length, ended = _lengths(generated, eos_token_id)
    out = {"mean length": length.float().mean().item(), "end rate": ended.float().mean().item(),
           "same tokens as the reference": None}
    if reference is not None:
        ref_length, _ = _lengths(reference, eos_token_id)
        both = torch.minimum(length, ref_length)
        within = torch.arange(generated.shape[1]).expand_as(generated) < both.unsqueeze(-1)
        out["same tokens as the reference"] = ((generated == reference) & within).sum().item() / within.sum().item()
    return out


def held_out_prompts(batches: Sequence[dict[str, torch.Tensor]], count: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of the first ``count`` sequences of ``batches`` (``[n, length]``, n <= count)."""
    return torch.cat([b["tokens"][:, :length] for b in batches])[:count]
