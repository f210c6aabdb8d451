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

The 2-D block kernel launches in several ways (:data:`BLOCK2D_VARIANTS`: two passes or whole blocks, one program per
block or a persistent grid, pipelined by the compiler or by hand), all with the same bits; :data:`BLOCK2D_DEFAULT`
names the one every launch uses (``tools/bench_expert_fake_quant.py --block2d-variants`` times them all).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

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
    launch_kwargs,
    rounding_options,
    signature,
    token_tiling,
)
from .tuning import weight_kernel_config

__all__ = ["takes_weights", "takes_tokens", "weight_blocks_fake_quant", "token_groups_fake_quant",
           "clear_block_tables", "Block2dVariant", "BLOCK2D_VARIANTS", "BLOCK2D_DEFAULT", "block2d_resources"]


@dataclass(frozen=True)
class Block2dVariant:
    """How the 2-D block kernel is launched; every variant gives the same bits.

    Attributes:
        chunk: rows of a block read per step, in two passes (the max, then the values: the block is read twice);
            0 reads the whole block at once (one read; ``rows * cols / (32 * warps)`` values per thread).
        warps: ``num_warps`` of a program.
        programs_per_sm: 0 launches one program per block; k > 0 a persistent grid of k programs per SM, each looping
            over blocks.
        stages: software-pipelining stages of the persistent loop (``tl.range(num_stages=...)``: the next block's
            loads in flight while this one is reduced and stored); 1 is none.
        uniform: when all experts share one shape, find a block's expert by a division instead of a table search, and
            drop the masks when every block is full.
        prefetch: (persistent, whole blocks) pipeline by hand instead: load the next block's raw values into
            registers before this block is reduced and stored.
    """

    chunk: int = 32
    warps: int = 4
    programs_per_sm: int = 0
    stages: int = 1
    uniform: bool = False
    prefetch: bool = False

    def __post_init__(self):
        if self.prefetch and (self.chunk != 0 or self.programs_per_sm == 0):
            raise ValueError(f"Block2dVariant: prefetch needs chunk=0 and programs_per_sm > 0, got {self}")


BLOCK2D_VARIANTS: dict[str, Block2dVariant] = {
    "two-pass": Block2dVariant(chunk=32, warps=4),
    "two-pass-uniform": Block2dVariant(chunk=32, warps=4, uniform=True),
    "whole-w8": Block2dVariant(chunk=0, warps=8, uniform=True),
    "whole-w16": Block2dVariant(chunk=0, warps=16, uniform=True),
    "whole-w32": Block2dVariant(chunk=0, warps=32, uniform=True),
    # Two passes with few blocks in flight (k per SM): the second pass's read stays in L2.
    "persistent-two-pass-p4": Block2dVariant(chunk=32, warps=4, programs_per_sm=4, uniform=True),
    "persistent-two-pass-p8": Block2dVariant(chunk=32, warps=4, programs_per_sm=8, uniform=True),
    # Whole blocks in a persistent loop; the compiler's pipelining stages the next blocks in shared memory (32 KB each).
    "persistent-w8-s2": Block2dVariant(chunk=0, warps=8, programs_per_sm=1, stages=2, uniform=True),
    "persistent-w16-s2": Block2dVariant(chunk=0, warps=16, programs_per_sm=1, stages=2, uniform=True),
    "persistent-w16-s3": Block2dVariant(chunk=0, warps=16, programs_per_sm=1, stages=3, uniform=True),
    "persistent-w16-s4": Block2dVariant(chunk=0, warps=16, programs_per_sm=1, stages=4, uniform=True),
    "persistent-w32-s2": Block2dVariant(chunk=0, warps=32, programs_per_sm=1, stages=2, uniform=True),
    "persistent-w32-s3": Block2dVariant(chunk=0, warps=32, programs_per_sm=1, stages=3, uniform=True),
    # The same pipelining by hand: the next block's raw values in registers.
    "prefetch-w16": Block2dVariant(chunk=0, warps=16, programs_per_sm=1, uniform=True, prefetch=True),
    "prefetch-w32": Block2dVariant(chunk=0, warps=32, programs_per_sm=1, uniform=True, prefetch=True),
}
# The variant every launch uses (tools/bench_expert_fake_quant.py --block2d-variants measures them all).
BLOCK2D_DEFAULT = "prefetch-w16"
_INTERPRETER_SMS = 2  # the Triton interpreter has no SMs: a persistent grid there has 2 * programs_per_sm programs
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
    """(device table, its host source, index of the base tensor, number of blocks, output length, the elements per
    16-byte vector every expert allows, whether all experts share one shape)."""
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
    entry = (table, host, base, n_blocks, out_off, vec, all(w.shape == weights[0].shape for w in weights))
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


def _variant(variant: str | Block2dVariant | None) -> Block2dVariant:
    if variant is None:
        variant = BLOCK2D_DEFAULT
    if isinstance(variant, Block2dVariant):
        return variant
    if variant not in BLOCK2D_VARIANTS:
        raise ValueError(f"2-D block kernel variant {variant!r}: expected one of {sorted(BLOCK2D_VARIANTS)}")
    return BLOCK2D_VARIANTS[variant]


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def _launch(weights: Sequence[torch.Tensor], fmt: str, block_size: tuple[int, int], sig: Signature | None,
            variant: str | Block2dVariant | None):
    """(output, the compiled kernel Triton returned: None without a launch or under the interpreter)."""
    v = _variant(variant)
    br, bc = block_size
    table, _, base, n_blocks, total, vec, one_shape = _table(weights, br, bc, sig)
    out = torch.empty(total, dtype=weights[0].dtype, device=weights[0].device)
    if n_blocks == 0:
        return out, None
    kwargs = launch_kwargs(out.device)
    kwargs["num_warps"] = v.warps
    hw_cvt = rounding_options(weight_kernel_config(fmt), out.device)["HW_CVT"]
    rows, cols = weights[0].shape
    # int32 block ids and in-expert offsets (what locate_tile's division computes in).
    uniform = v.uniform and one_shape and n_blocks < 2**31 and rows * cols < 2**31
    chunk = br if v.chunk == 0 else min(br, v.chunk)
    grid = n_blocks if v.programs_per_sm == 0 else min(n_blocks, v.programs_per_sm * _sm_count(out.device))
    u_tiles = n_blocks // len(weights) if uniform else 0
    handle = _kernels().grouped_weight_block2d_kernel[(grid,)](
        weights[base], out, table, len(weights), n_blocks, u_tiles, rows if uniform else 0, cols if uniform else 0,
        cdiv(cols, bc) if uniform else 0, **_constexprs(fmt), BR=br, BC=bc, CHUNK=chunk,
        SEARCH_STEPS=max(0, (len(weights) - 1).bit_length()), VEC=vec if bc % vec == 0 else 1, HW_CVT=hw_cvt,
        UNIFORM=uniform, EVEN=uniform and rows % br == 0 and cols % bc == 0, PERSISTENT=v.programs_per_sm > 0,
        STAGES=v.stages, PREFETCH=v.prefetch, **kwargs)
    return out, handle


def weight_blocks_fake_quant(weights: Sequence[torch.Tensor], fmt: str, block_size: tuple[int, int],
                             sig: Signature | None = None, variant: str | Block2dVariant | None = None) -> torch.Tensor:
    """The N fake-quantized experts, concatenated flat (the grouped op's output buffer); inputs already checked
    by the grouped op and taken by :func:`takes_weights`. ``variant``: a name of :data:`BLOCK2D_VARIANTS` or a
    :class:`Block2dVariant` (default :data:`BLOCK2D_DEFAULT`; the same bits in every variant)."""
    return _launch(weights, fmt, block_size, sig, variant)[0]


def block2d_resources(weights: Sequence[torch.Tensor], fmt: str, block_size: tuple[int, int],
                      variant: str | Block2dVariant | None = None) -> dict[str, int] | None:
    """Registers per thread (``n_regs``), spilled registers (``n_spills``) and shared memory bytes (``shared``) of the
    2-D block kernel compiled for ``variant`` on these weights (launches it once); None where Triton reports no
    compiled kernel (its interpreter)."""
    handle = _launch(weights, fmt, block_size, None, variant)[1]
    if getattr(handle, "n_regs", None) is None:
        return None
    return {"n_regs": int(handle.n_regs), "n_spills": int(handle.n_spills),
            "shared": int(getattr(handle.metadata, "shared", -1))}


def token_groups_fake_quant(x: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """``x`` [T, K] fake-quantized in groups of ``block_size`` of each row (every group its own amax); inputs already
    checked by the grouped op and taken by :func:`takes_tokens`."""
    y = torch.empty_like(x)
    t, k = x.shape
    if x.numel() == 0:
        return y
    tile_r, tile_nb, tile_w, kwargs = token_tiling(fmt, k, block_size, x.device)
    _kernels().token_groups_kernel[(cdiv(t, tile_r), cdiv(k, tile_w))](
        x, y, t, k, **_constexprs(fmt), TILE_R=tile_r, TILE_NB=tile_nb, BS=block_size, **kwargs)
    return y

