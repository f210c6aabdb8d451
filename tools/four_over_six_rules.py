"""Study-only 4-over-6 block-selection rules: which error decides between a block's max on E2M1's 6 and on its 4.

The library's format ``nvfp4_four_over_six`` (:class:`modelopt_moe.numerics.nvfp4.NVFP4FourOverSixFormat`) keeps,
per block of 16, the candidate of smaller squared error (``mse``). The 4-over-6 paper's library (``fouroversix``,
``AdaptiveBlockScalingRule``) also offers ``l1_norm`` (the sum of ``|error|``, Transformer Engine's and FlashInfer's
``MAE``) and ``abs_max`` (the largest ``|error|``). This module quantizes with any of the three, to measure them in
the QAD study (``tools/qad_study.py``: formats ``nvfp4_46mse``, ``nvfp4_46l1``, ``nvfp4_46amax``), without changing
the library's format:

- :func:`four_over_six_quantize` is the format's own quantization (``_quantize_by``) with the rule's block error: the
  same two candidates, the same ``sg = amax / (6 * 256)``, 4 only where its error is strictly smaller (6 on ties and
  NaN); the rule ``mse`` gives the format's bits exactly.
- :func:`use_rule` makes a model's forwards quantize ``nvfp4_four_over_six`` with a rule: a forward pre-hook sets it,
  a forward hook clears it (both return None), and the format's quantization, patched once in this process, reads it.
  Outside those forwards the format is the library's, untouched.
"""

from __future__ import annotations

import torch

from modelopt_moe.numerics.format import Quantized
from modelopt_moe.numerics.nvfp4 import NVFP4FourOverSixFormat, block_square_error, pairwise_block_sum

__all__ = ["RULES", "block_error", "four_over_six_quantize", "use_rule", "active_rule"]

RULES = ("mse", "l1_norm", "abs_max")
_ACTIVE: list[str] = []  # the rule of the forward in progress (a stack: a forward inside a forward keeps its own)
_LIBRARY_QUANTIZE = NVFP4FourOverSixFormat._quantize


def block_error(error: torch.Tensor, rule: str) -> torch.Tensor:
    """One block's error under ``rule`` from its fp32 ``error`` ``[..., 16]`` (dequantized minus input): ``mse``
    the library's :func:`block_square_error`, ``l1_norm`` the sum of ``|error|`` (the same pairwise tree),
    ``abs_max`` the largest ``|error|`` (NaN if any is NaN). ``[..., 1]``.

    Raises:
        ValueError: ``rule`` is not one of :data:`RULES`.
    """
    if rule == "mse":
        return block_square_error(error)
    if rule == "l1_norm":
        return pairwise_block_sum(error.abs())
    if rule == "abs_max":
        return error.abs().amax(-1, keepdim=True)
    raise ValueError(f"4-over-6 rule {rule!r}: expected one of {RULES}")


def four_over_six_quantize(fmt: NVFP4FourOverSixFormat, xf: torch.Tensor, amax, rule: str) -> Quantized:
    """``fmt``'s 4-over-6 quantization of fp32 ``xf`` with each block's candidate chosen by ``rule``."""
    return fmt._quantize_by(xf, amax, lambda error: block_error(error, rule))


def active_rule() -> str | None:
    """The rule of the forward in progress, or None (the library's format)."""
    return _ACTIVE[-1] if _ACTIVE else None


def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
    rule = active_rule()
    if rule is None:
        return _LIBRARY_QUANTIZE(self, xf, amax, block_size, narrow_range, unsigned)
    return four_over_six_quantize(self, xf, amax, rule)


def use_rule(model: torch.nn.Module, rule: str) -> list:
    """Every forward of ``model`` quantizes ``nvfp4_four_over_six`` with ``rule`` (on CPU: the format's reference
    path; the Triton kernels keep the library's rule, so a CUDA model is refused). Returns the hook handles.

    Raises:
        ValueError: an unknown ``rule``, or a model with parameters on a GPU.
    """
    if rule not in RULES:
        raise ValueError(f"4-over-6 rule {rule!r}: expected one of {RULES}")
    if any(p.is_cuda for p in model.parameters()):
        raise ValueError("4-over-6 rules other than the library's run on CPU only (the Triton kernels keep 'mse')")
    NVFP4FourOverSixFormat._quantize = _quantize  # idempotent: inactive, it is the library's

    def enter(module, args):
        _ACTIVE.append(rule)

    def leave(module, args, output):
        _ACTIVE.pop()

    return [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
