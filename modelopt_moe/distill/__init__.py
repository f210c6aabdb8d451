"""Quantization-aware distillation (QAD): the student learns the teacher's output distribution.

``logits_kl_loss`` (per-token forward KL, correct on vocabulary-parallel logits), ``vocab_parallel_cross_entropy``,
``DistillationModel`` (the student beside a frozen teacher, whose forward returns the per-token loss) and
``QADRecipe`` (the training settings: what trains, learning rate and schedule, Adam, loss). Imports
torch alone; the Megatron helpers are in ``modelopt_moe.plugins.megatron`` (``distillation_model``).
"""

from .losses import logits_kl_loss, vocab_parallel_cross_entropy
from .model import DistillationModel
from .recipe import PARAM_GROUPS, QADRecipe, param_group

__all__ = ["logits_kl_loss", "vocab_parallel_cross_entropy", "DistillationModel", "QADRecipe", "PARAM_GROUPS",
           "param_group"]
