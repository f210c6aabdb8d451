"""Checks the grouped ops share (each op's launcher calls them before anything runs): formats, amax tensors, lists
of experts, token matrices and their split sizes. Every failure is a ``ValueError`` naming the op, the offending
expert or tensor, its value and what was expected.

A list of experts is checked once per :class:`~.launch.Signature` (with the format, block size and amax shape): a
call with tensors seen before costs no Python work per expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..numerics import get_format
from .launch import MAX_EXPERTS, Signature, checked_before, eager, remember_checked, signature

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STE_MODES = ("pass_through", "clipped")


def check_format(fmt: str, block_size: int | None) -> None:
    """Checks that ``fmt`` is a known format and ``block_size`` one it takes (data blocks: a power of two in
    [2, 4096]; a format with a fixed block: that one; others: none)."""
    problem = get_format(fmt).block_size_problem(block_size)  # ValueError on an unknown format
    if problem is not None:
        raise ValueError(problem)
    if block_size is None or isinstance(block_size, tuple):  # 2-D blocks: the format's check above is all
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size & (
            block_size - 1) or block_size > 4096:
        raise ValueError(f"block_size must be a power of two in [2, 4096], got {block_size!r}")


def needs_amax(fmt: str, block_size: int | None) -> bool:
    """Whether format ``fmt`` reads an amax (all but formats whose every scale comes from the data)."""
    return get_format(fmt).needs_amax(block_size)


def check_ste(ste: str) -> None:
    """Checks a straight-through estimator name against :data:`STE_MODES`."""
    if ste not in STE_MODES:
        raise ValueError(f"ste must be one of {STE_MODES}, got {ste!r}")


def check_amax_tensor(amax: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """``amax`` as a contiguous fp32 tensor, after checking that it is a floating tensor on ``device``."""
    if not isinstance(amax, torch.Tensor):
        raise ValueError(f"{what}: amax must be a tensor, got {type(amax).__name__}")
    if not amax.is_floating_point():
        raise ValueError(f"{what}: amax must be a floating tensor, got {amax.dtype}")
    if amax.device != device:
        raise ValueError(f"{what}: amax is on {amax.device} but the data is on {device}")
    return amax.float().contiguous()


# ----------------------------------------------------------------------------------------------------------------
# Lists of experts
# ----------------------------------------------------------------------------------------------------------------
def check_weights(weights: Sequence[torch.Tensor], what: str, amax: torch.Tensor | None, fmt: str | None,
                  block_size: int | None) -> tuple[list[torch.Tensor], torch.Tensor | None, Signature | None]:
    """Checks a list of experts (and their amax); returns (the list, the fp32 amax, the list's signature; None
    while traced or under a dispatch mode, and for entries without addresses).

    The per-expert checks run once per distinct signature (with the format, block size and amax shape): a call
    with tensors seen before costs no Python work per expert.
    """
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Sequence):
        raise ValueError(f"{what}: expected a list of expert tensors, got {type(weights).__name__}")
    weights = list(weights)
    if not weights:
        raise ValueError(f"{what}: empty list of experts")
    if len(weights) > MAX_EXPERTS:
        raise ValueError(f"{what}: at most {MAX_EXPERTS} experts per launch, got {len(weights)}")
    w0 = weights[0]
    if amax is not None and isinstance(w0, torch.Tensor):  # else the per-expert checks below name expert 0
        amax = check_amax_tensor(amax, w0.device, what)
    if not eager():  # traced, or fake tensors under a dispatch mode: no addresses to read
        _check_each_weight(weights, what, amax, fmt, block_size)
        return weights, amax, None
    sig = signature(weights)
    memo = (sig, fmt, block_size, None if amax is None else amax.shape)
    if sig is not None and checked_before(memo):
        return weights, amax, sig
    _check_each_weight(weights, what, amax, fmt, block_size)
    if sig is not None:
        remember_checked(memo)
    return weights, amax, sig


def _check_each_weight(weights: list[torch.Tensor], what: str, amax: torch.Tensor | None, fmt: str | None,
                       block_size: int | None) -> None:
    """The per-expert checks of :func:`check_weights` (``amax`` already checked as a tensor on the right device)."""
    w0 = weights[0]
    # Blocks that pad a partial last block (data int blocks, MX) take any last dim; other fixed blocks must tile it.
    spec = None if fmt is None else get_format(fmt)
    fixed = None if spec is None or spec.pads else spec.block_length
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{what}: expert {i} is a {type(w).__name__}, not a tensor")
        if w.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{what}: expert {i} has dtype {w.dtype}; expected one of {FLOAT_DTYPES}")
        if w.dtype != w0.dtype:
            raise ValueError(f"{what}: expert {i} has dtype {w.dtype} but expert 0 has {w0.dtype}")
        if w.device != w0.device:
            raise ValueError(f"{what}: expert {i} is on {w.device} but expert 0 is on {w0.device}")
        if not w.is_contiguous():
            raise ValueError(f"{what}: expert {i} (shape {tuple(w.shape)}) is not contiguous")
        if fmt is not None:
            # Data blocks zero-pad a partial last block (integer.py); a format's fixed blocks must tile exactly.
            if fixed is not None and (w.dim() == 0 or w.shape[-1] % fixed):
                raise ValueError(f"{what}: expert {i} has shape {tuple(w.shape)}; format {fmt!r} needs a last dim "
                                 f"that is a multiple of the block size {fixed}")
            if block_size is not None and w.dim() == 0:
                raise ValueError(f"{what}: expert {i} is a scalar; block_size={block_size} needs a last dim")
    n = len(weights)
    if amax is not None:
        if amax.dim() == 2:
            if amax.shape[0] != n:
                raise ValueError(f"{what}: per-channel amax of shape {tuple(amax.shape)} does not match {n} experts")
            for i, w in enumerate(weights):
                if w.dim() != 2 or w.shape[0] != amax.shape[1]:
                    raise ValueError(f"{what}: per-channel amax of shape {tuple(amax.shape)} needs 2-D experts with "
                                     f"{amax.shape[1]} rows, expert {i} has shape {tuple(w.shape)}")
        elif amax.dim() == 1:
            if amax.shape[0] != n:
                raise ValueError(f"{what}: amax of shape {tuple(amax.shape)} does not match {n} experts "
                                 f"(expected [{n}], [{n}, C] or a scalar)")
        elif amax.dim() != 0:
            raise ValueError(f"{what}: amax must be a scalar, [N] or [N, C]; got shape {tuple(amax.shape)}")


def check_weight_fake_quant(weights, amax, fmt: str, block_size: int | None, what: str):
    """The checks of a grouped weight fake quant: (weights as a list, the fp32 amax or None where unused, the
    weights' signature)."""
    check_format(fmt, block_size)
    if amax is None and needs_amax(fmt, block_size):
        raise ValueError(f"{what}: format {fmt!r} needs an amax tensor, got None")
    weights, amax, sig = check_weights(weights, what, amax, fmt, block_size)
    return weights, amax if needs_amax(fmt, block_size) else None, sig


# ----------------------------------------------------------------------------------------------------------------
# Token matrices split by m_splits
# ----------------------------------------------------------------------------------------------------------------
def check_input(x: torch.Tensor, m_splits, amax: torch.Tensor | None, what: str):
    """Checks tokens ``x`` [T, K], their split sizes and amax; returns (m_splits as a device tensor, the fp32
    amax)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{what}: x must be a 2-D [tokens, features] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: x has dtype {x.dtype}; expected one of {FLOAT_DTYPES}")
    if not x.is_contiguous():
        raise ValueError(f"{what}: x of shape {tuple(x.shape)} is not contiguous")
    if isinstance(m_splits, Sequence) and not isinstance(m_splits, torch.Tensor):
        m_splits = torch.tensor(list(m_splits), dtype=torch.int64)
    if isinstance(m_splits, torch.Tensor) and m_splits.device.type == "cpu" and x.device.type != "cpu":
        # Host split sizes (TE's convention): an asynchronous copy from pinned memory. A plain copy from pageable
        # memory would block the host until the GPU catches up, on every forward.
        m_splits = m_splits.pin_memory().to(x.device, non_blocking=True)
    if not isinstance(m_splits, torch.Tensor) or m_splits.dim() != 1 or m_splits.is_floating_point() or (
            m_splits.dtype == torch.bool or m_splits.is_complex()):
        raise ValueError(f"{what}: m_splits must be a 1-D integer tensor (or a list of ints)")
    if m_splits.device != x.device:
        raise ValueError(f"{what}: m_splits is on {m_splits.device} but x is on {x.device}")
    n = m_splits.numel()
    if not 1 <= n <= MAX_EXPERTS:
        raise ValueError(f"{what}: expected 1..{MAX_EXPERTS} experts in m_splits, got {n}")
    m_splits = m_splits.contiguous()
    if amax is not None:
        amax = check_amax_tensor(amax, x.device, what)
        if not (amax.dim() == 0 or (amax.dim() == 1 and amax.shape[0] == n)):
            raise ValueError(f"{what}: amax must be a scalar (shared) or [{n}] (per expert), got shape "
                             f"{tuple(amax.shape)}")
    return m_splits, amax


def check_input_fake_quant(x, m_splits, amax, fmt: str, block_size: int | None, what: str):
    """The checks of a grouped input fake quant: (device m_splits, the fp32 amax or None where unused)."""
    check_format(fmt, block_size)
    if amax is None and needs_amax(fmt, block_size):
        raise ValueError(f"{what}: format {fmt!r} needs an amax tensor, got None")
    m_splits, amax = check_input(x, m_splits, amax, what)
    spec = get_format(fmt)
    fixed = None if spec.pads else spec.block_length
    if fixed is not None and x.shape[1] % fixed:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}; format {fmt!r} needs a last dim that is a "
                         f"multiple of the block size {fixed}")
    return m_splits, amax if needs_amax(fmt, block_size) else None
