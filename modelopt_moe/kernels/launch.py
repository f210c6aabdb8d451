"""How the grouped kernels are launched: the backend, what a list of experts looks like to a kernel, and the cached
tables the weight kernels read. Internal to :mod:`modelopt_moe.kernels`; every op module builds on it.

Parts, in this order:

1. backend: :data:`TRITON_AVAILABLE`, :func:`kernels_available` (Triton or the torch fallback), :func:`use_kernels`
   (whether a quantizer takes the kernels, for the config's ``kernel`` preference), :func:`eager` (whether an op may
   skip the custom-op dispatcher);
2. signatures of expert lists (:class:`Signature`) and the memo of lists that passed their checks;
3. the per-expert table (its columns ``COL_*``) and the plan cache (:func:`weight_plan`, :func:`clear_table_cache`);
4. tiling and the launch arguments every launcher shares.

Pointer table and CUDA graphs: the N experts stay separate tensors (TE's ``weight0..weight{N-1}``); a weight kernel
reads them through a device table of int64 element offsets from a base tensor (the one with the lowest address), so
nothing is stacked. The table is built on the host from ``data_ptr()`` s (host metadata, no device sync) and copied
to the device once from pinned memory with ``non_blocking=True``. It is cached, keyed on the pointers, shapes and
tiling, so repeated calls with the same tensors (the usual case: parameters keep their storage across optimizer
steps) launch only the kernel. A cached table can never be stale: its content is a pure function of its key. Entries
created while a CUDA graph is being captured are kept forever (the captured copy reads their pinned host buffer at
every replay); other entries are evicted least-recently-used. As for any CUDA graph, replays are correct as long as
the captured tensors keep their addresses.
"""

from __future__ import annotations

import operator
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from ..numerics import KernelRoutine, get_format

try:
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    TRITON_AVAILABLE = False

MAX_EXPERTS = 512  # experts per launch
TILE_ELEMS = 4096  # elements per program: 8 KiB of bf16 in and out, 32 per thread at 4 warps
NUM_WARPS = 4
MAX_TILE_W = 1024  # widest 2-D tile row
# The token fake-quant kernels' elements per program (rows of up to a quarter of it, 32 elements per thread), unless
# the format's KernelSpec.token_tile says otherwise: measured 0.92-0.93 of copy bandwidth on an H100 against 0.88 at
# 4096 for FP8 and MX tokens (docs/benchmarks.md).
TOKEN_TILE_ELEMS = 8192
_CACHE_SIZE = 64


# ----------------------------------------------------------------------------------------------------------------
# Backend
# ----------------------------------------------------------------------------------------------------------------
# Whether our kernels were built for the Triton interpreter: a plain bool, recorded when they are imported, so that
# torch.compile traces kernels_available() as a constant (it cannot inspect a compiled kernel object).
_INTERPRETED: bool | None = None


def _interpret_mode() -> bool:
    """Whether our kernels run (or, not yet imported, would run) in the Triton interpreter."""
    global _INTERPRETED
    if _INTERPRETED is None:
        mod = sys.modules.get(__package__ + ".tile_kernels")  # imported by every kernel module
        if mod is None:
            return os.environ.get("TRITON_INTERPRET", "0") == "1"
        _INTERPRETED = type(mod.to_fp32).__name__ == "InterpretedFunction"
    return _INTERPRETED


def kernels_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``.

    True on CUDA with compiled Triton, and on CPU when the kernels run in the Triton interpreter
    (``TRITON_INTERPRET=1`` set before the first launch). Everywhere else the pure-torch fallback is used.
    """
    if not TRITON_AVAILABLE:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and not _interpret_mode()
    if device.type == "cpu":
        return _interpret_mode()
    return False


def use_kernels(preference: str, device: torch.device, available: bool | None = None) -> bool:
    """Whether fake quant on ``device`` runs the one-launch Triton kernels, for the config's ``kernel`` preference
    (``auto``: on CUDA; ``triton``: wherever they can run, else an error; ``torch``: never). The one rule that expert
    and dense quantizers alike follow; ``available``: whether the kernels can run there (default
    :func:`kernels_available`).

    Raises:
        RuntimeError: ``triton`` where the kernels cannot run.
    """
    if preference == "torch":
        return False
    available = kernels_available(device) if available is None else available
    if preference == "triton" and not available:
        raise RuntimeError(f"kernel='triton' but the Triton kernels cannot run on {device} (no triton, or a CPU "
                           "tensor without TRITON_INTERPRET=1); use kernel='auto' or 'torch'")
    return available and (preference == "triton" or device.type == "cuda")


def eager() -> bool:
    """Whether a custom op may be bypassed (its body called directly, without the dispatcher's list conversions and
    schema checks): not traced by torch.compile and no dispatch mode (fake tensors, functionalization) that must
    see the op."""
    return not torch.compiler.is_compiling() and _current_dispatch_mode() is None


# ----------------------------------------------------------------------------------------------------------------
# Signatures of expert lists: what the checks and the tables of a list of experts depend on, read without Python
# work per expert (``map`` over C accessors), so that a call with already-seen tensors costs no per-expert tensor ops.
# ----------------------------------------------------------------------------------------------------------------
_T = torch.Tensor
_dtype_of = operator.attrgetter("dtype")


class Signature:
    """Addresses, shapes, contiguity, dtypes and devices of a list of tensors: everything the checks and the tables
    of a grouped call depend on (a contiguous tensor's strides follow from its shape; lists with a non-contiguous
    entry fail the checks and get no table). Read with ``map`` over C accessors (no Python work per expert); hashed
    once (hashing the long tuple would otherwise dominate a cache hit)."""

    __slots__ = ("value", "hash")

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.value = (tuple(map(_T.data_ptr, tensors)), tuple(map(_T.size, tensors)),
                      tuple(map(_T.is_contiguous, tensors)), tuple(map(_dtype_of, tensors)),
                      tuple(map(_T.get_device, tensors)))
        self.hash = hash(self.value)

    @property
    def shapes(self) -> tuple[torch.Size, ...]:
        """The tensors' shapes."""
        return self.value[1]

    @property
    def devices(self) -> tuple[int, ...]:
        """The tensors' device indices (``Tensor.get_device``: -1 for the CPU)."""
        return self.value[4]

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Signature) and self.hash == other.hash and self.value == other.value


# One object per distinct signature seen recently: a call's signature is compared in full once, here, and the cache
# keys built from it then match the stored keys by identity (a full comparison costs as much as reading the list).
_interned: OrderedDict[Signature, Signature] = OrderedDict()


def signature(tensors: Sequence[torch.Tensor]) -> Signature | None:
    """The :class:`Signature` of ``tensors`` (the one object of an equal signature seen recently), or None if an
    entry is not a tensor or has no storage to point at (fake tensors outside ``torch.compile``): such lists are
    checked every call."""
    try:
        sig = Signature(tensors)
    except (TypeError, RuntimeError, NotImplementedError):
        return None
    seen = _interned.get(sig)
    if seen is not None:
        _interned.move_to_end(seen)
        return seen
    _interned[sig] = sig
    if len(_interned) > 4 * _CACHE_SIZE:
        _interned.popitem(last=False)
    return sig


# Keys (a signature with the format, block size and amax shape) of expert lists that passed their checks: a later
# call with the same tensors skips the per-expert loop. A pure function of its key, so it can never be stale.
_checked: OrderedDict[tuple, None] = OrderedDict()


def checked_before(key: tuple) -> bool:
    """Whether the expert list of ``key`` passed its checks before (and marks it recently used)."""
    if key in _checked:
        _checked.move_to_end(key)
        return True
    return False


def remember_checked(key: tuple) -> None:
    """Records that the expert list of ``key`` passed its checks."""
    _checked[key] = None
    if len(_checked) > 4 * _CACHE_SIZE:
        _checked.popitem(last=False)


# ----------------------------------------------------------------------------------------------------------------
# The per-expert table (int64 [N, NCOL], one row per expert) and the plan cache. The @triton.jit code reads the
# same column numbers (tile_kernels.py).
# ----------------------------------------------------------------------------------------------------------------
COL_IN = 0  # element offset of the input (forward) / gradient (backward) from its base tensor
COL_AUX = 1  # element offset of the weight from its base tensor (backward only)
COL_OUT = 2  # element offset of this expert in the output buffer
COL_ROWS = 3
COL_COLS = 4
COL_TILE0 = 5  # first program id of this expert (cumulative tile count)
COL_CTILES = 6  # column tiles per row tile (2-D tiling only)
NCOL = 8  # one spare column keeps rows 64-byte aligned


class WeightPlan:
    """Tiling and device table for one call of a grouped weight kernel."""

    __slots__ = ("table", "host", "base", "aux_base", "n_tiles", "total", "tile_r", "tile_nb", "bs", "vec", "two_d",
                 "steps", "uniform", "even", "u_tiles", "u_rows", "u_cols", "u_ctiles")


_plan_cache: OrderedDict[tuple, WeightPlan] = OrderedDict()
_captured_plans: dict[tuple, WeightPlan] = {}


def _tiling(shapes: list[tuple[int, ...]], bs: int, two_d: bool, tile_elems: int = TILE_ELEMS) -> tuple[int, int]:
    """(TILE_R, TILE_NB) for inner block ``bs``: about ``tile_elems`` elements per program."""
    if not two_d:
        return 1, max(1, tile_elems // bs)
    tile_w = max(bs, min(MAX_TILE_W, next_pow2(max(s[1] for s in shapes))))
    return max(1, tile_elems // tile_w), tile_w // bs


def weight_plan(inputs: Sequence[torch.Tensor], aux: Sequence[torch.Tensor] | None, bs: int, two_d: bool,
                tile_elems: int = TILE_ELEMS, sig: Signature | None = None,
                aux_sig: Signature | None = None) -> WeightPlan:
    """The tiling and table of ``inputs`` (and ``aux``, read at the same offsets); ``sig`` / ``aux_sig``: their
    signatures when the caller has them."""
    aux_sig = None if aux is None else aux_sig or signature(aux)
    key = (sig or signature(inputs), aux_sig, bs, two_d, tile_elems)
    plan = _plan_cache.get(key) or _captured_plans.get(key)
    if plan is not None:
        if key in _plan_cache:
            _plan_cache.move_to_end(key)
        return plan

    device = inputs[0].device
    shapes = [tuple(t.shape) for t in inputs]
    ptrs = [t.data_ptr() for t in inputs]
    aux_ptrs = [t.data_ptr() for t in aux] if aux is not None else []
    tile_r, tile_nb = _tiling(shapes, bs, two_d, tile_elems)
    tile_elems = tile_r * tile_nb * bs
    tile_w = tile_nb * bs
    esize = inputs[0].element_size()
    aux_esize = aux[0].element_size() if aux else esize
    base = min(range(len(ptrs)), key=ptrs.__getitem__)
    aux_base = min(range(len(aux_ptrs)), key=aux_ptrs.__getitem__) if aux else 0
    vec = 16 // max(esize, aux_esize)
    rows, n_tiles, out_off = [], 0, 0
    for i, shape in enumerate(shapes):
        numel = inputs[i].numel()
        cols = shape[-1] if len(shape) >= 1 and shape[-1] > 0 else 1
        nrows = numel // cols
        if two_d:
            if cols >= 2**31:  # the 2-D tiles' in-expert offsets and masks are int32
                raise ValueError(f"grouped fake quant: tensor {i} has rows of {cols} elements; rows of per-row "
                                 f"tiles must hold fewer than 2**31")
            ctiles = -(-cols // tile_w)
            tiles = -(-nrows // tile_r) * ctiles
            if cols % vec:
                vec = 1
        else:
            ctiles = 1
            tiles = -(-numel // tile_elems)
        in_off = ptrs[i] - ptrs[base]
        aux_off = aux_ptrs[i] - aux_ptrs[aux_base] if aux else 0
        # VEC > 1 promises the kernel 16-byte aligned expert starts and sizes (its vectorization hints).
        if in_off % 16 or aux_off % 16 or out_off % vec or numel % vec or ptrs[i] % 16 or (aux and aux_ptrs[i] % 16):
            vec = 1
        row = [0] * NCOL
        row[COL_IN], row[COL_AUX], row[COL_OUT] = in_off // esize, aux_off // aux_esize, out_off
        row[COL_ROWS], row[COL_COLS], row[COL_TILE0], row[COL_CTILES] = nrows, cols, n_tiles, ctiles
        rows.append(row)
        n_tiles += tiles
        out_off += numel
    if any(r[COL_IN] * esize != ptrs[i] - ptrs[base] for i, r in enumerate(rows)):
        raise ValueError("grouped fake quant: tensor addresses are not aligned to their element size")

    plan = WeightPlan()
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
        plan.table = host.to(device, non_blocking=True)
    else:
        plan.table = host
    plan.host = host  # keeps the pinned source of a captured copy alive
    plan.base, plan.aux_base, plan.n_tiles, plan.total = base, aux_base, n_tiles, out_off
    plan.tile_r, plan.tile_nb, plan.bs, plan.vec, plan.two_d = tile_r, tile_nb, bs, vec, two_d
    plan.steps = max(0, (len(inputs) - 1).bit_length())
    # One shape for all experts: the kernel may locate a tile by division instead of the table search.
    r0_rows, r0_cols = rows[0][COL_ROWS], rows[0][COL_COLS]
    plan.uniform = all(s == shapes[0] for s in shapes) and n_tiles < 2**31 and r0_rows * r0_cols < 2**31
    plan.u_rows, plan.u_cols, plan.u_ctiles = r0_rows, r0_cols, rows[0][COL_CTILES]
    plan.u_tiles = n_tiles // len(inputs)
    if two_d:
        plan.even = plan.uniform and r0_rows % tile_r == 0 and r0_cols % tile_w == 0
    else:
        plan.even = plan.uniform and (r0_rows * r0_cols) % tile_elems == 0
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _captured_plans[key] = plan
    else:
        _plan_cache[key] = plan
        if len(_plan_cache) > _CACHE_SIZE:
            _plan_cache.popitem(last=False)
    return plan


def clear_table_cache() -> None:
    """Drops cached pointer tables (not those created during CUDA graph capture, which the graphs still read) and
    the memo of checked weight lists."""
    _plan_cache.clear()
    _checked.clear()
    _interned.clear()


# ----------------------------------------------------------------------------------------------------------------
# Tiling and launch arguments
# ----------------------------------------------------------------------------------------------------------------
def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers."""
    return -(-a // b)


def input_tiling(n_cols: int, bs: int, tile_elems: int = TILE_ELEMS) -> tuple[int, int, int]:
    """(TILE_R, TILE_NB, tile width) of the token kernels for rows of ``n_cols`` and inner block ``bs``, with
    ``tile_elems`` elements per program (rows of at most a quarter of them)."""
    tile_w = max(bs, min(tile_elems // 4, next_pow2(n_cols)))
    return max(1, tile_elems // tile_w), tile_w // bs, tile_w


def token_tiling(fmt: str, n_cols: int, bs: int, device: torch.device) -> tuple[int, int, int, dict]:
    """(TILE_R, TILE_NB, tile width, launch keywords) of the token fake-quant kernels for format ``fmt``, rows of
    ``n_cols`` and inner block ``bs``: the format's elements per program (``KernelSpec.token_tile``, else
    :data:`TOKEN_TILE_ELEMS`) at the format's elements per thread (``KernelSpec.token_thread_elems``)."""
    spec = get_format(fmt).kernel
    tile = spec.token_tile or TOKEN_TILE_ELEMS
    warps = max(1, tile // (32 * spec.token_thread_elems))
    return (*input_tiling(n_cols, bs, tile), {**launch_kwargs(device), "num_warps": warps})


def format_constexprs(fmt: str, block_size: int | None) -> dict:
    """The kernels' format constexprs, read from the format's :class:`~modelopt_moe.numerics.KernelSpec`: the tile
    routine ``FAMILY`` with its constants, and ``INT_BLOCK`` (each block's amax comes from the data)."""
    spec = get_format(fmt)
    return spec.kernel.constexprs(data_blocks=not spec.needs_amax(block_size))


def launch_kwargs(device: torch.device) -> dict:
    """Launch keywords every kernel takes on ``device``: warps, no fp fusion, and how to round to the output dtype."""
    # No fused multiply-add: the rounding relies on x * scale being rounded before the magic add.
    # BITWISE_CVT: the interpreter's fp32 -> bf16 .to() is wrong, so it rounds by arithmetic; GPUs use cvt.rn.
    return {"num_warps": NUM_WARPS, "enable_fp_fusion": False, "BITWISE_CVT": device.type != "cuda"}


def rounding_options(cfg, device: torch.device) -> dict:
    """The kernels' rounding options of launch config ``cfg`` (:func:`.tuning.weight_kernel_config`; same bits with
    or without; GPU-only ones off elsewhere)."""
    on_gpu = device.type == "cuda"
    return {"HW_CVT": on_gpu and bool(cfg["hw_cvt"]), "LEAN": bool(cfg["lean"]),
            "FAST_MAX": on_gpu and bool(cfg["fast_max"])}


def amax_mode(amax: torch.Tensor | None, n: int) -> tuple[int, int]:
    """(AMAX_MODE, stride between experts) for the weight kernels."""
    if amax is None:
        return 0, 0
    if amax.dim() == 0:
        return 1, 0
    if amax.dim() == 1:
        return 1, 1
    return 2, amax.shape[1]


def kernels_take(fmt: str, block_size) -> bool:
    """Whether the tile kernels run format ``fmt`` with ``block_size`` (else the pure-torch reference does, on any
    device): every format with a kernel routine, except float formats' blocks from the data (1-D or 2-D) until a
    routine takes them."""
    kernel = get_format(fmt).kernel
    if kernel is None:
        return False
    return block_size is None or (isinstance(block_size, int) and kernel.routine != KernelRoutine.SCALED_FLOAT)


def inner_block(fmt: str, block_size: int | None) -> tuple[int, bool]:
    """(inner tile dim, whether it is a quantization block) for format ``fmt``: its fixed block's length, else the
    dynamic ``block_size``, else 16 elements that are no block."""
    fixed = get_format(fmt).block_length
    if fixed is not None:
        return fixed, True
    if block_size is not None:
        return block_size, True
    return 16, False


def padded(weights, fmt: str, block_size: int | None) -> bool:
    """Whether a block that pads (an int block of ``block_size``, a fixed block of a format that pads: MX) overhangs
    the last dim of some expert (then zero-padded)."""
    spec = get_format(fmt)
    block = block_size if block_size is not None else spec.block_length if spec.pads else None
    return block is not None and any(w.dim() == 0 or w.shape[-1] % block for w in weights)


def split_views(flat: torch.Tensor, like: Sequence[torch.Tensor], sig: Signature | None = None) -> list[torch.Tensor]:
    """``flat`` as views shaped like ``like`` (whose signature ``sig`` has the shapes): one ``unbind`` when all share
    a shape (the usual experts), else one view per tensor."""
    shapes = sig.shapes if sig is not None else tuple(map(_T.size, like))
    if shapes.count(shapes[0]) == len(shapes):
        return list(flat.view(len(shapes), *shapes[0]).unbind(0))
    return [v.view(shape) for v, shape in zip(flat.split([t.numel() for t in like]), shapes, strict=True)]
