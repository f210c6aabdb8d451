"""FP8 in blocks whose amax comes from the data, on the Triton kernels: 2-D blocks of N expert weights in one launch,
and groups of the last dim of a token matrix in one launch; bit-exact with :func:`modelopt_moe.numerics.fake_quant`.

The grouped ops (:mod:`.weight_fake_quant`, :mod:`.input_fake_quant`) call these where the tile kernels do not take the
(format, block) pair (:func:`.launch.kernels_take`) and :func:`takes_weights` / :func:`takes_tokens` say these do; the
checks, custom ops and autograd are the grouped ops'. The ``@triton.jit`` code is in :mod:`.fp8_block_kernels`,
imported on the first launch.

The per-expert table is :mod:`.launch`'s (the same columns), with one tile per block: the N experts stay separate
tensors, read through their offsets from the lowest-addressed one, and the output is one new buffer. Tables are
cached by the experts' signature and block shape; a table created during CUDA graph capture is kept (the graph reads
its pinned source at every replay).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..numerics import KernelRoutine, get_format
from .launch import (
    COL_COLS,
    COL_CTILES,
    COL_IN,
    COL_OUT,
    COL_ROWS,
    COL_TILE0,
    NCOL,
    Signature,
    cdiv,
    input_tiling,
    launch_kwargs,
    rounding_options,
    signature,
)
from .tuning import weight_kernel_config

__all__ = ["takes_weights", "takes_tokens", "weight_blocks_fake_quant", "token_groups_fake_quant",
           "clear_block_tables"]

_CHUNK_ROWS = 32  # rows of a block read per step (registers: CHUNK x BC values per program)
_MAX_BLOCK = 4096
_CACHE_SIZE = 64
_tables: OrderedDict[tuple, tuple] = OrderedDict()
_captured: dict[tuple, tuple] = {}


@functools.lru_cache(maxsize=1)
def _kernels():
    from . import fp8_block_kernels

    return fp8_block_kernels


def _pow2(b) -> bool:
    return isinstance(b, int) and not isinstance(b, bool) and 2 <= b <= _MAX_BLOCK and not b & (b - 1)


def _scaled_float(fmt: str) -> bool:
    kernel = get_format(fmt).kernel
    return kernel is not None and kernel.routine == KernelRoutine.SCALED_FLOAT


def takes_weights(fmt: str, block_size, weights: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`weight_blocks_fake_quant` runs ``weights`` (2-D experts) in ``fmt`` with 2-D blocks of
    ``block_size`` (powers of two)."""
    return (_scaled_float(fmt) and isinstance(block_size, tuple) and len(block_size) == 2
            and all(map(_pow2, block_size)) and all(w.dim() == 2 for w in weights))


def takes_tokens(fmt: str, block_size) -> bool:
    """Whether :func:`token_groups_fake_quant` runs ``fmt`` with groups of ``block_size`` (a power of two)."""
    return _scaled_float(fmt) and _pow2(block_size)


def _constexprs(fmt: str) -> dict:
    k = get_format(fmt).kernel
    return {"BOUND": k.bound, "MANT": k.mant, "EMIN": k.emin, "EMAX": k.emax}


def _table(weights: Sequence[torch.Tensor], br: int, bc: int, sig: Signature | None) -> tuple:
    """(device table, its host source, index of the base tensor, number of blocks, output length)."""
    key = (sig or signature(weights), br, bc)
    hit = _tables.get(key) or _captured.get(key)
    if hit is not None:
        if key in _tables:
            _tables.move_to_end(key)
        return hit
    ptrs = [w.data_ptr() for w in weights]
    esize = weights[0].element_size()
    base = min(range(len(ptrs)), key=ptrs.__getitem__)
    rows, n_blocks, out_off = [], 0, 0
    vec = 16 // esize  # elements per 16-byte vector, promised to the kernel only if every expert allows it
    for w, p in zip(weights, ptrs, strict=True):
        r, c = w.shape
        if (p - ptrs[base]) % esize:
            raise ValueError("grouped fake quant: tensor addresses are not aligned to their element size")
        if p % 16 or c % vec or out_off % vec:
            vec = 1
        row = [0] * NCOL
        ctiles = cdiv(c, bc)
        row[COL_IN], row[COL_OUT], row[COL_ROWS], row[COL_COLS] = (p - ptrs[base]) // esize, out_off, r, c
        row[COL_TILE0], row[COL_CTILES] = n_blocks, ctiles
        rows.append(row)
        n_blocks += cdiv(r, br) * ctiles
        out_off += w.numel()
    host = torch.tensor(rows, dtype=torch.int64)
    device = weights[0].device
    if device.type == "cuda":
        host = host.pin_memory()
        table = host.to(device, non_blocking=True)
    else:
        table = host
    entry = (table, host, base, n_blocks, out_off, vec)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _captured[key] = entry
    else:
        _tables[key] = entry
        if len(_tables) > _CACHE_SIZE:
            _tables.popitem(last=False)
    return entry


def clear_block_tables() -> None:
    """Drops the cached tables (not those created during CUDA graph capture, which the graphs still read)."""
    _tables.clear()


def weight_blocks_fake_quant(weights: Sequence[torch.Tensor], fmt: str, block_size: tuple[int, int],
                             sig: Signature | None = None) -> torch.Tensor:
    """The N fake-quantized experts, concatenated flat (the grouped op's output buffer); inputs already checked
    by the grouped op and taken by :func:`takes_weights`."""
    br, bc = block_size
    table, _, base, n_blocks, total, vec = _table(weights, br, bc, sig)
    out = torch.empty(total, dtype=weights[0].dtype, device=weights[0].device)
    if n_blocks == 0:
        return out
    kwargs = launch_kwargs(out.device)
    hw_cvt = rounding_options(weight_kernel_config(fmt), out.device)["HW_CVT"]
    _kernels().grouped_weight_block2d_kernel[(n_blocks,)](
        weights[base], out, table, len(weights), **_constexprs(fmt), BR=br, BC=bc, CHUNK=min(br, _CHUNK_ROWS),
        SEARCH_STEPS=max(0, (len(weights) - 1).bit_length()), VEC=vec if bc % vec == 0 else 1, HW_CVT=hw_cvt,
        **kwargs)
    return out


def token_groups_fake_quant(x: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """``x`` [T, K] fake-quantized in groups of ``block_size`` of each row (every group its own amax); inputs already
    checked by the grouped op and taken by :func:`takes_tokens`."""
    y = torch.empty_like(x)
    t, k = x.shape
    if x.numel() == 0:
        return y
    tile_r, tile_nb, tile_w = input_tiling(k, block_size)
    _kernels().token_groups_kernel[(cdiv(t, tile_r), cdiv(k, tile_w))](
        x, y, t, k, **_constexprs(fmt), TILE_R=tile_r, TILE_NB=tile_nb, BS=block_size, **launch_kwargs(x.device))
    return y

