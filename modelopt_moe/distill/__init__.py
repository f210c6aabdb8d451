"""Quantization-aware distillation (QAD): the student learns the teacher's output distribution.

``logits_kl_loss`` (per-token forward KL, correct on vocabulary-parallel logits), ``vocab_parallel_cross_entropy``
and ``DistillationModel`` (the student beside a frozen teacher, whose forward returns the per-token loss). Imports
torch alone; the Megatron helpers are in ``modelopt_moe.plugins.megatron`` (``distillation_model``).
"""

from .losses import logits_kl_loss, vocab_parallel_cross_entropy
from .model import DistillationModel

__all__ = ["logits_kl_loss", "vocab_parallel_cross_entropy", "DistillationModel"]
