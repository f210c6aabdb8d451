"""The data ``modelopt-moe demo`` trains on, and ``modelopt-moe qat`` without ``--data``: byte-level language-modelling
batches of real English text that ships with CPython (``pydoc_data.topics``, the language reference behind
``help()``), so the commands run without a download. Imports torch only.
"""

from __future__ import annotations

import torch

__all__ = ["corpus_bytes", "text_batches"]


def corpus_bytes() -> bytes:
    """Real English text that ships with CPython: the language reference topics behind ``help()``."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def text_batches(
    batch_size: int, seq_len: int, num_batches: int, vocab_size: int = 256, *, offset: int = 0,
    corpus: bytes | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Byte-level language-modelling batches from real English text (``pydoc_data.topics``), deterministic.

    Sample ``i`` of batch ``b`` is the ``seq_len + 1`` bytes starting at ``(offset + b * batch_size + i) *
    seq_len`` of the corpus (wrapping around); tokens are bytes modulo ``vocab_size``. Every rank gets the same
    batches: Megatron's tensor- and expert-parallel ranks must see the same data.

    Args:
        batch_size: Sequences per batch.
        seq_len: Tokens per sequence.
        num_batches: Number of batches.
        vocab_size: Token ids are ``byte % vocab_size`` (256 keeps bytes exact).
        offset: Index of the first sample (use different offsets for calibration and evaluation data).
        corpus: Other bytes to cut the samples from (default: :func:`corpus_bytes`).

    Returns:
        A list of dicts with ``tokens``, ``labels`` (next token), ``position_ids`` (all ``[batch_size, seq_len]``
        int64) and ``attention_mask`` (``[1, 1, seq_len, seq_len]`` bool, True where attention is masked: causal).
    """
    corpus = corpus_bytes() if corpus is None else corpus
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.int64) % vocab_size
    n = data.numel()
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(seq_len, dtype=torch.int64).expand(batch_size, seq_len)
    batches = []
    for b in range(num_batches):
        starts = [((offset + b * batch_size + i) * seq_len) % n for i in range(batch_size)]
        idx = torch.tensor(starts)[:, None] + torch.arange(seq_len + 1)[None, :]
        seqs = data[idx % n]
        batches.append(
            {"tokens": seqs[:, :-1].contiguous(), "labels": seqs[:, 1:].contiguous(),
             "position_ids": positions.clone(), "attention_mask": mask.clone()}
        )
    return batches
