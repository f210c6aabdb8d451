"""Quantization-aware distillation (QAD): the student learns the teacher's output distribution.

``logits_kl_loss`` (per-token forward KL, correct on vocabulary-parallel logits), ``vocab_parallel_cross_entropy``,
``DistillationModel`` (the student beside a frozen teacher, whose forward returns the per-token loss) and
``QADRecipe`` (the training settings: what trains, learning rate and schedule, Adam, loss), the teacher's memory
(``store_weights_fp8``: its weights in FP8; ``TeacherLogitsWriter`` / ``TeacherLogitsStore`` /
``StoredTeacherLogits``: its top-k logits precomputed on disk and streamed). Imports
torch alone; the Megatron helpers are in ``modelopt_moe.plugins.megatron`` (``distillation_model``).
"""

import importlib

from .recipe import PARAM_GROUPS, QADRecipe, param_group

__all__ = ["logits_kl_loss", "vocab_parallel_cross_entropy", "DistillationModel", "QADRecipe", "PARAM_GROUPS",
           "param_group", "store_weights_fp8", "TeacherLogitsWriter", "TeacherLogitsStore", "StoredTeacherLogits",
           "LogitStoreError"]

# The losses and the module import torch; the recipe does not, so a command line can check its flags against the
# recipe before anything heavy is imported.
_LAZY = {"logits_kl_loss": ".losses", "vocab_parallel_cross_entropy": ".losses", "DistillationModel": ".model",
         "store_weights_fp8": ".teacher_fp8", **dict.fromkeys(
             ("TeacherLogitsWriter", "TeacherLogitsStore", "StoredTeacherLogits", "LogitStoreError"), ".logit_store")}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
