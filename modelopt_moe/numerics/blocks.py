"""Block scale layouts shared by the formats that take them: blocks of the last dim (1-D) or of the last two dims
(2-D), each with one scale from its own data.

A block size is an int (blocks of the last dim, ``128``: one scale per 128 consecutive elements of a row, e.g. per
token and group of 128 features) or a pair ``(rows, cols)``, last dim last (``(128, 128)``: one scale per 128 x 128
tile of a ``[..., R, C]`` weight). Dims that are not multiples of the block are zero-padded at their end, as Model
Optimizer pads its block views and as DeepSeek-style checkpoints size their scales (``ceil(R / 128) x ceil(C /
128)``): the last block of a row or column is simply smaller, its maximum unchanged, and the padding is dropped
from the output.
"""

from __future__ import annotations

import torch

__all__ = ["block_dims", "to_blocks", "from_blocks", "block_max", "blocks_shape"]


def block_dims(block_size) -> tuple[int, ...] | None:
    """``block_size`` as a tuple of positive block lengths, last dim last (``128`` -> ``(128,)``, ``(128, 128)`` as
    is); None when it is neither a positive int nor a pair of positive ints."""
    if isinstance(block_size, bool):
        return None
    if isinstance(block_size, int):
        return (block_size,) if block_size > 0 else None
    if isinstance(block_size, tuple | list) and len(block_size) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size):
        return tuple(block_size)
    return None


def blocks_shape(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    """How many blocks of ``dims`` cover the last ``len(dims)`` dims of ``shape`` (partial blocks counted)."""
    return tuple(-(-n // b) for n, b in zip(shape[-len(dims):], dims, strict=True))


def to_blocks(xf: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, int | tuple[int, int]]:
    """The zero-padded block view of ``xf`` and the unpadded length(s) :func:`from_blocks` needs.

    1-D ``(b,)``: ``[..., K]`` -> ``[..., ceil(K / b), b]`` and ``K``; 2-D ``(br, bc)``: ``[..., R, C]`` ->
    ``[..., ceil(R / br), br, ceil(C / bc), bc]`` and ``(R, C)``.
    """
    if len(dims) == 1:
        (b,) = dims
        k = xf.shape[-1]
        pad = -k % b
        xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
        return xp.unflatten(-1, (-1, b)), k
    br, bc = dims
    r, c = xf.shape[-2], xf.shape[-1]
    pr, pc = -r % br, -c % bc
    xp = torch.nn.functional.pad(xf, (0, pc, 0, pr)) if pr or pc else xf
    return xp.unflatten(-1, (-1, bc)).unflatten(-3, (-1, br)), (r, c)


def from_blocks(blocks: torch.Tensor, dims: tuple[int, ...], length) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: the block view back in the input's shape, padding dropped."""
    if len(dims) == 1:
        return blocks.flatten(-2)[..., :length]
    r, c = length
    return blocks.flatten(-2).flatten(-3, -2)[..., :r, :c]


def block_max(blocks: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Max of ``|x|`` over each block of a :func:`to_blocks` view, NaN ignored (an Inf counts), keeping size-1 dims
    where the block's elements were: ``[..., nb, 1]`` (1-D) or ``[..., nr, 1, nc, 1]`` (2-D)."""
    a = blocks.abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if len(dims) == 1:
        return a.amax(dim=-1, keepdim=True)
    return a.amax(dim=(-3, -1), keepdim=True)
