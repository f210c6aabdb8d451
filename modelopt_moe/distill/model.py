"""The student beside its frozen teacher: one module whose forward returns the per-token distillation loss.

The teacher is held outside the module tree (like a reference, not a child), so it has no place in
``parameters()``, ``state_dict()``, ``.bfloat16()``/``.cuda()``, ``train()`` or any wrapper built around the
distillation model: Megatron's DDP and optimizer see the student's parameters only, so the teacher costs no
gradient buffer and no optimizer state, and a checkpoint holds the student alone. Its forward runs under
``torch.no_grad()`` in eval mode.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quantization.conversion import register_wrapper
from .logit_store import StoredTeacherLogits
from .losses import check_top_p, logits_kl_loss, vocab_parallel_cross_entropy
from .recipe import TEACHER_FP8_GRANULARITIES
from .teacher_fp8 import store_weights_fp8

__all__ = ["DistillationModel"]


class DistillationModel(nn.Module):
    """``forward(*args, labels=None, **kwargs)`` runs ``student(*args, **kwargs)`` and, without gradient, the teacher
    on the same inputs (both must return logits: ``[..., V]`` or the same TP slice of the vocabulary), and returns
    the per-token loss ``kl_weight * KL(teacher || student) + lm_loss_weight * cross_entropy(student, labels)`` (the
    second term only when ``labels`` is given and ``lm_loss_weight`` is not 0).

    As a Megatron model: wrap it like the student (``Float16Module``, DDP) and keep the training loop; a forward step
    that calls ``model(tokens, position_ids, attention_mask, labels=labels)`` and averages the per-token output (the
    usual ``loss_func``) then trains by distillation through ``get_forward_backward_func``.
    ``modelopt_moe.plugins.megatron.distillation_model`` passes Megatron's tensor-parallel group.

    The student is the child ``module`` (the convention of Megatron's wrappers, so ``sharded_state_dict`` and
    ``set_input_tensor`` reach it); ``modelopt_moe`` treats this class as a wrapper, so quantization state and
    checkpoints name the student's modules as without it.

    Args:
        student: the model being trained (quantized or not).
        teacher: the frozen reference (e.g. the bf16 model the student was quantized from, or another checkpoint of
            the same architecture and parallel layout). It is put in eval mode and its parameters stop requiring
            gradients; its device and dtype stay the caller's. Or a
            :class:`~modelopt_moe.distill.logit_store.StoredTeacherLogits`: the teacher's top-k logits precomputed
            on disk (no teacher forward; the KL is then the top-k KL of the store's ``k``).
        temperature: softmax temperature of the KL term.
        kl_weight: weight of the KL term.
        lm_loss_weight: weight of the language-modelling cross entropy on ``labels``.
        tp_group: the tensor-parallel group the logits' vocabulary is split over (None: not split).
        top_k: None (the default): the exact KL; an integer: the KL on the teacher's ``top_k`` most likely tokens
            (:func:`.losses.logits_kl_loss`'s ``top_k``, an approximation). With stored teacher logits: None or
            the store's ``k``.
        top_p: None (the default): the exact KL; a number in (0, 1]: the KL on the teacher's nucleus of
            probability ``top_p`` (:func:`.losses.logits_kl_loss`'s ``top_p``, an approximation). Not with ``top_k``
            nor with stored teacher logits (they hold a top-k set already).
        teacher_fp8: None (the default): the teacher's weights stay as they are. ``"per_tensor"`` or
            ``"per_channel"``: they are stored as FP8 E4M3 codes and scales, dequantized per layer in the
            teacher's forward (:func:`.teacher_fp8.store_weights_fp8`, in place).

    Raises:
        ValueError: the teacher is the student, a weight is negative, ``top_k`` is not a positive integer or not
            the stored logits' ``k``, ``top_p`` is not in (0, 1] or is given with ``top_k`` or stored logits, or
            ``teacher_fp8`` is given with stored logits or is not a known granularity.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, *, temperature: float = 1.0, kl_weight: float = 1.0,
                 lm_loss_weight: float = 0.0, tp_group=None, top_k: int | None = None, top_p: float | None = None,
                 teacher_fp8: str | None = None):
        super().__init__()
        if teacher is student:
            raise ValueError("DistillationModel: the teacher must be a separate model from the student")
        if kl_weight < 0 or lm_loss_weight < 0:
            raise ValueError(f"DistillationModel: weights must be >= 0, got kl_weight={kl_weight}, "
                             f"lm_loss_weight={lm_loss_weight}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"DistillationModel: top_k must be a positive integer or None, got {top_k!r}")
        check_top_p("DistillationModel", top_p, top_k)
        if teacher_fp8 is not None and teacher_fp8 not in TEACHER_FP8_GRANULARITIES:
            raise ValueError(f"DistillationModel: teacher_fp8={teacher_fp8!r}; expected None or one of "
                             f"{list(TEACHER_FP8_GRANULARITIES)}")
        if isinstance(teacher, StoredTeacherLogits):
            if top_k not in (None, teacher.top_k):
                raise ValueError(f"DistillationModel: top_k={top_k} but the stored teacher logits "
                                 f"({teacher.store.directory}) hold the top {teacher.top_k}")
            if top_p is not None:
                raise ValueError(f"DistillationModel: top_p={top_p!r} with stored teacher logits "
                                 f"({teacher.store.directory}): they hold the teacher's top {teacher.top_k} already")
            if teacher_fp8 is not None:
                raise ValueError(f"DistillationModel: teacher_fp8={teacher_fp8!r} with stored teacher logits "
                                 f"({teacher.store.directory}): there are no teacher weights to store")
            top_k = teacher.top_k
        self.module = student
        self.top_k, self.top_p = top_k, top_p
        teacher.eval()
        teacher.requires_grad_(False)
        if teacher_fp8 is not None:
            store_weights_fp8(teacher, teacher_fp8)
        self.__dict__["_teacher"] = teacher  # not a submodule: see the module docstring
        self.temperature, self.kl_weight, self.lm_loss_weight = float(temperature), float(kl_weight), float(
            lm_loss_weight)
        self.__dict__["_tp_group"] = tp_group  # a process group: never pickled with the model

    @property
    def student(self) -> nn.Module:
        """The model being trained (the child ``module``)."""
        return self.module

    @property
    def teacher(self) -> nn.Module:
        """The frozen reference (not a submodule: it is in neither ``parameters()`` nor the state dict)."""
        return self.__dict__["_teacher"]

    @property
    def config(self):
        """The student's config (Megatron's ``get_model_config`` reads it)."""
        return self.module.config

    def forward(self, *args, labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The distillation loss of one batch: the student's forward with gradients, the teacher's without.

        Args:
            *args: the model's positional inputs, passed to both models.
            labels: token ids for the language-modelling term (used when ``lm_loss_weight`` > 0).
            **kwargs: the model's keyword inputs, passed to both models.

        Returns:
            fp32 ``[...]``, per token: ``kl_weight`` times :func:`.losses.logits_kl_loss`, plus ``lm_loss_weight`` times
            the student's cross entropy on ``labels`` when both are given.
        """
        student_logits = self.module(*args, **kwargs)
        with torch.no_grad():
            teacher_logits = self.teacher(*args, **kwargs)
        group = self.__dict__["_tp_group"]
        loss = logits_kl_loss(student_logits, teacher_logits, temperature=self.temperature, tp_group=group,
                              top_k=self.top_k, top_p=self.top_p)
        if self.kl_weight != 1.0:
            loss = loss * self.kl_weight
        if labels is not None and self.lm_loss_weight:
            loss = loss + self.lm_loss_weight * vocab_parallel_cross_entropy(student_logits, labels, tp_group=group)
        return loss

    def train(self, mode: bool = True):
        """Sets the student's training mode; the teacher stays in eval mode whatever ``mode`` is."""
        super().train(mode)
        self.teacher.eval()  # the teacher never trains (no dropout), whatever the schedule sets
        return self

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's pipeline hook, for the student (distillation runs with pipeline parallelism 1)."""
        self.module.set_input_tensor(input_tensor)

    def sharded_state_dict(self, *args, **kwargs):
        """The student's sharded state dict, under the student's own keys."""
        return self.module.sharded_state_dict(*args, **kwargs)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_tp_group"] = None
        return state


register_wrapper(DistillationModel)
