"""The language-model batch contract of :func:`~modelopt_moe.plugins.megatron.lm_forward_step` and of
``modelopt-moe qat --data`` / ``--eval-data``, checked before a batch reaches the model.

A batch is a dict of ``tokens``, ``labels`` and ``position_ids`` (int64 ``[batch, seq]``; token and label ids in
``[0, vocab_size)``), ``attention_mask`` (bool, True where attention is masked, broadcastable to
``[batch, 1, seq, seq]``, or None or absent for causal attention alone) and, optionally, ``loss_mask``
(``[batch, seq]``, nonzero where a token counts; labels elsewhere are not looked at). Megatron does not check these:
with tensor parallelism a token id beyond the vocabulary becomes a zero embedding and trains silently, and a
missing key fails deep inside the model. Each check runs on this rank's batch alone (no collective); reading the
id range synchronises with the device when the batch is already on a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BatchError", "LM_BATCH_CONTRACT", "check_lm_batch", "model_vocab_size"]

LM_BATCH_CONTRACT = ("a dict of tokens, labels, position_ids (int64 [batch, seq]; token and label ids in [0, "
                     "vocab_size)), attention_mask (bool, True where masked, broadcastable to [batch, 1, seq, seq]; "
                     "None or absent: causal) and optionally loss_mask ([batch, seq], nonzero where a token counts)")

_IDS = ("tokens", "labels", "position_ids")


class BatchError(ValueError):
    """A batch that breaks the language-model batch contract (:data:`LM_BATCH_CONTRACT`); the message names where it
    came from, the key, what it holds and what was expected."""


def model_vocab_size(model: torch.nn.Module) -> int | None:
    """The vocabulary size of a Megatron ``GPTModel`` inside its wrappers (DDP, ``Float16Module``, a distillation
    model: each holds the next one as ``.module``); None where there is none."""
    m = model
    while m is not None:
        size = getattr(m, "vocab_size", None)
        if isinstance(size, int):
            return size
        m = getattr(m, "module", None)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def check_lm_batch(batch: Any, vocab_size: int | None = None, *, source: str = "the batch",
                   batch_size: int | None = None, seq_len: int | None = None) -> None:
    """Checks one batch against :data:`LM_BATCH_CONTRACT`.

    Args:
        batch: the batch.
        vocab_size: the model's vocabulary; token ids (and labels where ``loss_mask`` counts them) must lie in
            ``[0, vocab_size)``. None skips the range check.
        source: where the batch came from, for the message (e.g. ``"--data my_project.data:batches, split
            'calib', batch 0"``).
        batch_size: the expected batch dimension (None: any).
        seq_len: the expected sequence length (None: any).

    Raises:
        BatchError: naming ``source``, the key, its value (dtype, shape or id range) and what is expected.
    """

    def fail(problem: str) -> None:
        raise BatchError(f"{source}: {problem}; expected {LM_BATCH_CONTRACT}")

    if not isinstance(batch, Mapping):
        fail(f"got {_describe(batch)}, not a dict")
    missing = [k for k in _IDS if k not in batch]
    if missing:
        fail(f"no {', '.join(missing)} (its keys: {sorted(map(str, batch))})")
    for key in _IDS:
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 2:
            fail(f"{key} is {_describe(value)}, expected an int64 tensor [batch, seq]")
    tokens = batch["tokens"]
    b, s = tokens.shape
    if (batch_size is not None and b != batch_size) or (seq_len is not None and s != seq_len) or not b * s:
        want = f"[{batch_size if batch_size is not None else 'batch'}, {seq_len if seq_len is not None else 'seq'}]"
        fail(f"tokens have shape {list(tokens.shape)}, expected {want}" + ("" if b * s else " and not empty"))
    if batch["labels"].shape != tokens.shape:
        fail(f"labels have shape {list(batch['labels'].shape)}, expected the tokens' {list(tokens.shape)}")
    if batch["position_ids"].shape not in (tokens.shape, torch.Size([1, s])):
        fail(f"position_ids have shape {list(batch['position_ids'].shape)}, expected the tokens' "
             f"{list(tokens.shape)} (or [1, {s}])")
    loss_mask = batch.get("loss_mask")
    if loss_mask is not None and (not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != tokens.shape):
        fail(f"loss_mask is {_describe(loss_mask)}, expected a tensor of the tokens' shape {list(tokens.shape)}")
    mask = batch.get("attention_mask")
    if mask is not None:
        fits = (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                and all(n in (1, want) for n, want in zip(mask.shape, (b, 1, s, s), strict=True)))
        if not fits:
            fail(f"attention_mask is {_describe(mask)}, expected a bool tensor broadcastable to [{b}, 1, {s}, {s}] "
                 "(True where attention is masked), or None")
    if vocab_size is None:
        return
    counted = batch["labels"] if loss_mask is None else batch["labels"][loss_mask.to(batch["labels"].device) != 0]
    for key, ids in (("tokens", tokens), ("labels", counted)):
        if not ids.numel():
            continue
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab_size:
            outside = int(((ids < 0) | (ids >= vocab_size)).sum())
            where = " (where loss_mask counts them)" if key == "labels" and loss_mask is not None else ""
            fail(f"{key}{where} hold ids from {lo} to {hi} ({outside} of {ids.numel()} outside the model's vocabulary "
                 f"of {vocab_size}: ids 0..{vocab_size - 1}); an id beyond it would train on a zero embedding")
