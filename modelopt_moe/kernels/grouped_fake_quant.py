"""Grouped fake quantization of MoE experts: all N experts in one launch, bit-exact with ``formats.fake_quant``.

Parts, in this order (the ``@triton.jit`` kernels themselves live in :mod:`.weight_fake_quant_kernels` and
:mod:`.input_fake_quant_kernels`, imported lazily so that this module imports with torch alone and so that
``TRITON_INTERPRET=1`` may be set any time before the first launch):

1. launchers (``_launch_*``) and pure-torch fallbacks (``_torch_*``, :func:`formats.fake_quant` per expert), chosen
   by :func:`kernels_available`;
2. public functions that validate their inputs with ``ValueError`` and call the custom ops:
   :func:`grouped_weight_fake_quant`, :func:`grouped_weight_clip_grad`, :func:`grouped_input_fake_quant`,
   :func:`grouped_input_clip_grad`;
3. ``torch.library.custom_op`` s in the ``modelopt_moe`` namespace, each with ``register_fake``;
4. autograd functions :class:`GroupedWeightFakeQuant` and :class:`GroupedInputFakeQuant` (pass-through or clipped
   straight-through estimator).

Weights: the N experts stay separate tensors (TE's ``weight0..weight{N-1}``). The kernel reads them through a device
table of int64 element offsets from a base tensor (the one with the lowest address), so nothing is stacked. The
output is ONE new buffer; the public function returns N views of it shaped like the inputs.

Pointer table and CUDA graphs: the table is built on the host from ``data_ptr()`` s (host metadata, no device sync)
and copied to the device once from pinned memory with ``non_blocking=True``. It is cached, keyed on the pointers,
shapes and tiling, so repeated calls with the same tensors (the usual case: parameters keep their storage across
optimizer steps) launch only the kernel. A cached table can never be stale: its content is a pure function of its
key. Entries created while a CUDA graph is being captured are kept forever (the captured copy reads their pinned
host buffer at every replay); other entries are evicted least-recently-used. As for any CUDA graph, replays are
correct as long as the captured tensors keep their addresses.

Clipped straight-through estimator: ``grad * (|w| <= amax)`` with the same amax tensor as the forward (the expert's,
or the channel's for ``[N, C]``); NVFP4 clips against its global (expert/channel) amax, block int formats against
the amax passed in, if any (their dynamic block amax never clips). An invalid amax (formats.py's rule: <= 2**-24,
NaN, Inf) clips nothing. This matches ``tensor_quantizer.clip_mask`` (so a NaN weight gets a zero gradient, and a
NaN gradient stays NaN even where clipped).
"""

import functools
import operator
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from ..numerics import NVFP4_BLOCK_SIZE, clip_limit, fake_quant, get_format
from . import table_layout as tbl

try:
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    TRITON_AVAILABLE = False

__all__ = [
    "TRITON_AVAILABLE",
    "MAX_EXPERTS",
    "kernels_available",
    "grouped_weight_fake_quant",
    "grouped_weight_clip_grad",
    "grouped_input_fake_quant",
    "grouped_input_clip_grad",
    "GroupedWeightFakeQuant",
    "GroupedWeightSTE",
    "GroupedInputFakeQuant",
    "grouped_weight_fake_quant_ste",
    "grouped_input_fake_quant_ste",
]

MAX_EXPERTS = 512
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STE_MODES = ("pass_through", "clipped")
_TILE_ELEMS = 4096  # elements per program: 8 KiB of bf16 in and out, 32 per thread at 4 warps
_NUM_WARPS = 4
# Launch configuration of the weight fake-quant kernel (see _weight_config), chosen with
# tools/tune_weight_kernel.py on an H200 (docs/benchmarks.md), which overrides entries through _TUNE to compare
# variants. Every option gives the same bits.
_WEIGHT_DEFAULTS = {
    "tile": _TILE_ELEMS,  # elements per program
    "warps": _NUM_WARPS,
    "uniform": True,  # experts of one shape: expert = tile // tiles_per_expert instead of a table search
    "even": True,  # with uniform, and every tile full: no masks
    "hw_cvt": True,  # GPU: fp8 rounding (and NVFP4's e4m3 block scale) by the hardware converter
    "lean": True,  # drop the upper exponent clamp that saturation makes redundant
    "fast_max": True,  # GPU: NVFP4 block max by the NaN-ignoring hardware max
}
_WEIGHT_FORMAT_DEFAULTS = {"nvfp4": {"tile": 2048}}  # fewer registers per program for the block max and scales
_TUNE: dict = {}
_MAX_TILE_W = 1024
_CACHE_SIZE = 64


# ----------------------------------------------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _weight_kernels():
    from . import weight_fake_quant_kernels

    return weight_fake_quant_kernels


@functools.lru_cache(maxsize=1)
def _input_kernels():
    from . import input_fake_quant_kernels

    return input_fake_quant_kernels


# Whether our kernels were built for the Triton interpreter: a plain bool, recorded when they are imported, so that
# torch.compile traces kernels_available() as a constant (it cannot inspect a compiled kernel object).
_INTERPRETED: bool | None = None


def _interpret_mode() -> bool:
    """Whether our kernels run (or, not yet imported, would run) in the Triton interpreter."""
    global _INTERPRETED
    if _INTERPRETED is None:
        import sys

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


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def format_constexprs(fmt: str, block_size: int | None) -> dict:
    """The kernels' format constexprs: ``FMT`` (the format's code) and ``INT_BLOCK`` (an int format whose amax
    comes from each block of the data)."""
    return {"FMT": get_format(fmt).code, "INT_BLOCK": get_format(fmt).kind == "int" and block_size is not None}


def _launch_kwargs(device: torch.device) -> dict:
    # No fused multiply-add: the rounding relies on x * scale being rounded before the magic add.
    # BITWISE_CVT: the interpreter's fp32 -> bf16 .to() is wrong, so it rounds by arithmetic; GPUs use cvt.rn.
    return {"num_warps": _NUM_WARPS, "enable_fp_fusion": False, "BITWISE_CVT": device.type != "cuda"}


# ----------------------------------------------------------------------------------------------------------------
# Weight-list signatures: what the checks and the tables of a list of experts depend on, read without Python work per
# expert (``map`` over C accessors), so that a call with already-seen tensors costs no per-expert tensor ops.
# ----------------------------------------------------------------------------------------------------------------
_T = torch.Tensor
_dtype_of = operator.attrgetter("dtype")


class _Signature:
    """Addresses, shapes, strides, dtypes and devices of a list of tensors: everything the checks and the tables of
    a grouped call depend on. Read with ``map`` over C accessors (no Python work per expert); hashed once (hashing the
    long tuple would otherwise dominate a cache hit)."""

    __slots__ = ("value", "hash")

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.value = (tuple(map(_T.data_ptr, tensors)), tuple(map(_T.size, tensors)), tuple(map(_T.stride, tensors)),
                      tuple(map(_dtype_of, tensors)), tuple(map(_T.get_device, tensors)))
        self.hash = hash(self.value)

    @property
    def shapes(self) -> tuple[torch.Size, ...]:
        return self.value[1]

    @property
    def devices(self) -> tuple[int, ...]:
        return self.value[4]

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Signature) and self.hash == other.hash and self.value == other.value


def _signature(tensors: Sequence[torch.Tensor]) -> _Signature | None:
    """The :class:`_Signature` of ``tensors``, or None if an entry is not a tensor or has no storage to point at
    (fake tensors outside ``torch.compile``): such lists are checked every call."""
    try:
        return _Signature(tensors)
    except (TypeError, RuntimeError, NotImplementedError):
        return None


# Signatures (with the format, block size and amax shape) of weight lists that passed _check_weights: a later call
# with the same tensors skips the per-expert loop. A pure function of its key, so it can never be stale.
_checked: "OrderedDict[tuple, None]" = OrderedDict()


# ----------------------------------------------------------------------------------------------------------------
# Weight tables (host-built, cached, one non-blocking H2D copy on a miss)
# ----------------------------------------------------------------------------------------------------------------
class _WeightPlan:
    """Tiling and device table for one call of a grouped weight kernel."""

    __slots__ = ("table", "host", "base", "aux_base", "n_tiles", "total", "tile_r", "tile_nb", "bs", "vec", "two_d",
                 "steps", "uniform", "even", "u_tiles", "u_rows", "u_cols", "u_ctiles")


_plan_cache: "OrderedDict[tuple, _WeightPlan]" = OrderedDict()
_captured_plans: dict[tuple, _WeightPlan] = {}


def _tiling(shapes: list[tuple[int, ...]], bs: int, two_d: bool, tile_elems: int = _TILE_ELEMS) -> tuple[int, int]:
    """(TILE_R, TILE_NB) for inner block ``bs``: about ``tile_elems`` elements per program."""
    if not two_d:
        return 1, max(1, tile_elems // bs)
    tile_w = max(bs, min(_MAX_TILE_W, _next_pow2(max(s[1] for s in shapes))))
    return max(1, tile_elems // tile_w), tile_w // bs


def _weight_config(fmt: str) -> dict:
    """Launch options of the weight fake-quant kernel for format ``fmt`` (defaults, then tuning overrides)."""
    cfg = {**_WEIGHT_DEFAULTS, **_WEIGHT_FORMAT_DEFAULTS.get(fmt, {})}
    cfg.update(_TUNE.get(fmt, _TUNE.get("*", {})))
    return cfg


def _weight_plan(inputs: Sequence[torch.Tensor], aux: Sequence[torch.Tensor] | None, bs: int, two_d: bool,
                 tile_elems: int = _TILE_ELEMS, sig: _Signature | None = None,
                 aux_sig: _Signature | None = None) -> _WeightPlan:
    """The tiling and table of ``inputs`` (and ``aux``, read at the same offsets); ``sig`` / ``aux_sig``: their
    signatures when the caller has them."""
    aux_sig = None if aux is None else aux_sig or _Signature(aux)
    key = (sig or _Signature(inputs), aux_sig, bs, two_d, tile_elems)
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
        row = [0] * tbl.NCOL
        row[tbl.COL_IN], row[tbl.COL_AUX], row[tbl.COL_OUT] = in_off // esize, aux_off // aux_esize, out_off
        row[tbl.COL_ROWS], row[tbl.COL_COLS], row[tbl.COL_TILE0], row[tbl.COL_CTILES] = nrows, cols, n_tiles, ctiles
        rows.append(row)
        n_tiles += tiles
        out_off += numel
    if any(r[tbl.COL_IN] * esize != ptrs[i] - ptrs[base] for i, r in enumerate(rows)):
        raise ValueError("grouped fake quant: tensor addresses are not aligned to their element size")

    plan = _WeightPlan()
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
    r0_rows, r0_cols = rows[0][tbl.COL_ROWS], rows[0][tbl.COL_COLS]
    plan.uniform = all(s == shapes[0] for s in shapes) and n_tiles < 2**31 and r0_rows * r0_cols < 2**31
    plan.u_rows, plan.u_cols, plan.u_ctiles = r0_rows, r0_cols, rows[0][tbl.COL_CTILES]
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


# ----------------------------------------------------------------------------------------------------------------
# Launchers (Triton) and fallbacks (pure torch); inputs are already validated
# ----------------------------------------------------------------------------------------------------------------
def _amax_mode(amax: torch.Tensor | None, n: int) -> tuple[int, int]:
    """(AMAX_MODE, stride between experts) for the weight kernels."""
    if amax is None:
        return 0, 0
    if amax.dim() == 0:
        return 1, 0
    if amax.dim() == 1:
        return 1, 1
    return 2, amax.shape[1]


def _inner_block(fmt: str, block_size: int | None) -> tuple[int, bool]:
    """(inner tile dim, whether it is a quantization block) for format ``fmt``."""
    if fmt == "nvfp4":
        return NVFP4_BLOCK_SIZE, True
    if block_size is not None:
        return block_size, True
    return 16, False


def _padded(weights, block_size) -> bool:
    """Whether an int block of ``block_size`` overhangs the last dim of some expert (then zero-padded)."""
    return block_size is not None and any(w.dim() == 0 or w.shape[-1] % block_size for w in weights)


def _launch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=True, sig=None) -> torch.Tensor:
    k = _weight_kernels()
    amax_mode, amax_stride = _amax_mode(amax, len(weights))
    bs, _ = _inner_block(fmt, block_size)
    cfg = _weight_config(fmt)
    # Padded int blocks need the 2-D tiling: its tiles start at a row and mask the columns past the last one (loaded
    # as 0: the zero padding), so no block spans two rows.
    plan = _weight_plan(weights, None, bs, two_d=amax_mode == 2 or _padded(weights, block_size),
                        tile_elems=cfg["tile"], sig=sig)
    out = torch.empty(plan.total, dtype=weights[0].dtype, device=weights[0].device)
    if plan.n_tiles == 0:
        return out
    amax_arg = amax if amax is not None else plan.table  # any tensor: never read when AMAX_MODE == 0
    uniform = bool(cfg["uniform"]) and plan.uniform
    kwargs = _launch_kwargs(out.device)
    kwargs["num_warps"] = cfg["warps"]
    k.grouped_weight_fake_quant_kernel[(plan.n_tiles,)](
        weights[plan.base], out, plan.table, amax_arg, len(weights), amax_stride, plan.u_tiles,
        plan.u_rows, plan.u_cols, plan.u_ctiles,
        **format_constexprs(fmt, block_size), AMAX_MODE=amax_mode,
        TWO_D=plan.two_d, TILE_R=plan.tile_r, TILE_NB=plan.tile_nb, BS=plan.bs, VEC=plan.vec,
        SEARCH_STEPS=plan.steps, UNIFORM=uniform, EVEN=uniform and bool(cfg["even"]) and plan.even,
        NARROW=bool(narrow_range), **_rounding_options(cfg, out.device), **kwargs,
    )
    return out


def _rounding_options(cfg: dict, device: torch.device) -> dict:
    """The kernels' rounding options of launch config ``cfg`` (same bits with or without; GPU-only ones off
    elsewhere)."""
    on_gpu = device.type == "cuda"
    return {"HW_CVT": on_gpu and bool(cfg["hw_cvt"]), "LEAN": bool(cfg["lean"]),
            "FAST_MAX": on_gpu and bool(cfg["fast_max"])}


def _expert_amax(amax: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Expert ``i``'s amax in the shape formats.fake_quant broadcasts: scalar, or [C, 1] per channel."""
    if amax is None or amax.dim() == 0:
        return amax
    return amax[i] if amax.dim() == 1 else amax[i].unsqueeze(-1)


def _int_kwargs(fmt: str, narrow_range: bool) -> dict:
    """``fake_quant``'s range keyword for int formats (none for float formats, which reject it)."""
    return {"narrow_range": narrow_range} if get_format(fmt).kind == "int" else {}


def _torch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    out = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype, device=weights[0].device)
    o = 0
    kw = _int_kwargs(fmt, narrow_range)
    for i, w in enumerate(weights):
        out[o : o + w.numel()] = fake_quant(w, fmt, _expert_amax(amax, i), block_size, **kw).reshape(-1)
        o += w.numel()
    return out


def _launch_weight_clip_grad(grads, weights, amax, grads_sig=None, weights_sig=None) -> torch.Tensor:
    k = _weight_kernels()
    amax_mode, amax_stride = _amax_mode(amax, len(weights))
    plan = _weight_plan(grads, weights, 16, two_d=amax_mode == 2, sig=grads_sig, aux_sig=weights_sig)
    out = torch.empty(plan.total, dtype=grads[0].dtype, device=grads[0].device)
    if plan.n_tiles == 0:
        return out
    k.grouped_weight_clip_grad_kernel[(plan.n_tiles,)](
        grads[plan.base], weights[plan.aux_base], out, plan.table, amax, len(weights), amax_stride,
        AMAX_MODE=amax_mode, TWO_D=plan.two_d, TILE_R=plan.tile_r, TILE_NB=plan.tile_nb, BS=plan.bs,
        VEC=plan.vec, SEARCH_STEPS=plan.steps, **_launch_kwargs(out.device),
    )
    return out


def _torch_weight_clip_grad(grads, weights, amax) -> torch.Tensor:
    out = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
    o = 0
    for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
        keep = w.abs() <= clip_limit(_expert_amax(amax, i))
        out[o : o + g.numel()] = (g * keep).reshape(-1)
        o += g.numel()
    return out


def _input_tiling(n_cols: int, bs: int) -> tuple[int, int, int]:
    tile_w = max(bs, min(_MAX_TILE_W, _next_pow2(n_cols)))
    return max(1, _TILE_ELEMS // tile_w), tile_w // bs, tile_w


def _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range=True, row_scale=None) -> torch.Tensor:
    """The input kernel; with ``row_scale`` [T] each output row is also multiplied by its scale (same launch)."""
    k = _input_kernels()
    y = torch.empty_like(x)
    t, kdim = x.shape
    if x.numel() == 0:
        return y
    bs, _ = _inner_block(fmt, block_size)
    tile_r, tile_nb, tile_w = _input_tiling(kdim, bs)
    n = m_splits.numel()
    per_expert = amax is not None and amax.dim() == 1
    amax_arg = amax if amax is not None else m_splits  # never read for block int formats
    k.grouped_input_fake_quant_kernel[(_cdiv(t, tile_r), _cdiv(kdim, tile_w))](
        x, y, m_splits, amax_arg, row_scale if row_scale is not None else m_splits, t, kdim, n,
        **format_constexprs(fmt, block_size), PER_EXPERT=per_expert,
        N_PAD=_next_pow2(n), TILE_R=tile_r, TILE_NB=tile_nb, BS=bs, NARROW=bool(narrow_range),
        HAS_SCALE=row_scale is not None, **_rounding_options(_weight_config(fmt), x.device),
        **_launch_kwargs(x.device),
    )
    return y


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_amax(x, m_splits, amax) -> torch.Tensor | None:
    """Per-row amax [T, 1] for per-expert amax (no host sync: output_size is given), else amax unchanged."""
    if amax is None or amax.dim() == 0:
        return amax
    rows = torch.repeat_interleave(amax.float(), m_splits.long(), output_size=x.shape[0])
    return rows.unsqueeze(-1)


def _torch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    # Per-row amax gives the same bits as fake_quant per row group: every format's arithmetic is row-local.
    return fake_quant(x, fmt, _row_amax(x, m_splits, amax), block_size, **_int_kwargs(fmt, narrow_range))


def _launch_input_clip_grad(grad, x, m_splits, amax, row_scale=None) -> torch.Tensor:
    """The clipped-STE kernel; with ``row_scale`` [T] the gradient is first multiplied by its row's scale."""
    k = _input_kernels()
    out = torch.empty_like(grad)
    t, kdim = x.shape
    if x.numel() == 0:
        return out
    tile_r, tile_nb, tile_w = _input_tiling(kdim, 16)
    n = m_splits.numel()
    k.grouped_input_clip_grad_kernel[(_cdiv(t, tile_r), _cdiv(kdim, tile_w))](
        grad, x, out, m_splits, amax, row_scale if row_scale is not None else amax, t, kdim, n,
        PER_EXPERT=amax.dim() == 1, N_PAD=_next_pow2(n), TILE_R=tile_r, TILE_NB=tile_nb, BS=16,
        HAS_SCALE=row_scale is not None, **_launch_kwargs(x.device),
    )
    return out


def _torch_input_clip_grad(grad, x, m_splits, amax) -> torch.Tensor:
    return grad * (x.abs() <= clip_limit(_row_amax(x, m_splits, amax)))


# ----------------------------------------------------------------------------------------------------------------
# Validation and public functions
# ----------------------------------------------------------------------------------------------------------------
def _check_format(fmt: str, block_size: int | None) -> None:
    spec = get_format(fmt)  # ValueError on an unknown format
    if block_size is None:
        return
    if fmt == "nvfp4" and block_size != NVFP4_BLOCK_SIZE:
        raise ValueError(f"nvfp4 uses blocks of {NVFP4_BLOCK_SIZE}, got block_size={block_size}")
    if spec.kind == "fp8":
        raise ValueError(f"format {fmt!r} has no block mode, got block_size={block_size}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size & (
            block_size - 1) or block_size > 4096:
        raise ValueError(f"block_size must be a power of two in [2, 4096], got {block_size!r}")


def _needs_amax(fmt: str, block_size: int | None) -> bool:
    return not (get_format(fmt).kind == "int" and block_size is not None)


def _check_amax_tensor(amax: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(amax, torch.Tensor):
        raise ValueError(f"{what}: amax must be a tensor, got {type(amax).__name__}")
    if not amax.is_floating_point():
        raise ValueError(f"{what}: amax must be a floating tensor, got {amax.dtype}")
    if amax.device != device:
        raise ValueError(f"{what}: amax is on {amax.device} but the data is on {device}")
    return amax.float().contiguous()


def _check_weights(weights: Sequence[torch.Tensor], what: str, amax: torch.Tensor | None, fmt: str | None,
                   block_size: int | None) -> tuple[list[torch.Tensor], torch.Tensor | None, _Signature | None]:
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
        amax = _check_amax_tensor(amax, w0.device, what)
    if not _eager():  # traced, or fake tensors under a dispatch mode: no addresses to read
        _check_each_weight(weights, what, amax, fmt, block_size)
        return weights, amax, None
    sig = _signature(weights)
    memo = (sig, fmt, block_size, None if amax is None else amax.shape)
    if sig is not None and memo in _checked:
        _checked.move_to_end(memo)
        return weights, amax, sig
    _check_each_weight(weights, what, amax, fmt, block_size)
    if sig is not None:
        _checked[memo] = None
        if len(_checked) > 4 * _CACHE_SIZE:
            _checked.popitem(last=False)
    return weights, amax, sig


def _check_each_weight(weights: list[torch.Tensor], what: str, amax: torch.Tensor | None, fmt: str | None,
                       block_size: int | None) -> None:
    """The per-expert checks of :func:`_check_weights` (``amax`` already checked as a tensor on the right device)."""
    w0 = weights[0]
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{what}: expert {i} is a {type(w).__name__}, not a tensor")
        if w.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{what}: expert {i} has dtype {w.dtype}; expected one of {_FLOAT_DTYPES}")
        if w.dtype != w0.dtype:
            raise ValueError(f"{what}: expert {i} has dtype {w.dtype} but expert 0 has {w0.dtype}")
        if w.device != w0.device:
            raise ValueError(f"{what}: expert {i} is on {w.device} but expert 0 is on {w0.device}")
        if not w.is_contiguous():
            raise ValueError(f"{what}: expert {i} (shape {tuple(w.shape)}) is not contiguous")
        if fmt is not None:
            # Int blocks zero-pad a partial last block (formats.fake_quant); NVFP4's blocks must tile exactly.
            if fmt == "nvfp4" and (w.dim() == 0 or w.shape[-1] % NVFP4_BLOCK_SIZE):
                raise ValueError(f"{what}: expert {i} has shape {tuple(w.shape)}; format {fmt!r} needs a last dim "
                                 f"that is a multiple of the block size {NVFP4_BLOCK_SIZE}")
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


def grouped_weight_fake_quant(
    weights: Sequence[torch.Tensor], amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    narrow_range: bool = True,
) -> list[torch.Tensor]:
    """Fake-quantizes N expert weights in one launch, bit-exact with ``formats.fake_quant`` per expert.

    Args:
        weights: N (1 <= N <= 512) contiguous tensors of one dtype (bf16, fp16 or fp32) on one device; shapes may
            differ (a last dim that is a multiple of the block size for block formats).
        amax: per expert ``[N]``, per expert and output channel ``[N, C]`` (2-D ``[C, K]`` experts), or a scalar
            shared by all experts; any float dtype (used as fp32). ``None`` only for int formats with
            ``block_size``. NVFP4 uses it as the global amax.
        fmt: ``"e4m3"``, ``"e5m2"``, ``"nvfp4"``, or ``"int2"`` .. ``"int8"``.
        block_size: int formats only: dynamic per-block amax over blocks of this many elements of the last dim (a
            power of two; a last dim that is not a multiple is zero-padded). NVFP4 always uses blocks of 16.
        narrow_range: int formats only: levels ``[-B, B]`` (True) or ``[-B-1, B]`` (formats.int_range).

    Returns:
        N tensors shaped like ``weights``: views of one new buffer.

    Raises:
        ValueError: on an empty or too long list, mixed dtypes or devices, non-contiguous experts, a bad amax shape,
            device or dtype, an unknown format, or a last dim that is not a multiple of the block size.
    """
    weights, amax, sig = _check_weight_fake_quant(weights, amax, fmt, block_size, "grouped_weight_fake_quant")
    if _eager():  # the op's body without the dispatcher round trip (list conversions, schema checks)
        flat = _weight_fake_quant_impl(weights, amax, fmt, block_size, bool(narrow_range), sig)
    else:
        flat = torch.ops.modelopt_moe.grouped_weight_fake_quant(weights, amax, fmt, block_size, bool(narrow_range))
    return _split_views(flat, weights, sig)


def _eager() -> bool:
    """Whether a custom op may be bypassed: not traced by torch.compile and no dispatch mode (fake tensors,
    functionalization) that must see the op."""
    return not torch.compiler.is_compiling() and _current_dispatch_mode() is None


def _check_weight_fake_quant(weights, amax, fmt: str, block_size: int | None, what: str):
    """The checks of a grouped weight fake quant: (weights as a list, the fp32 amax or None where unused, the
    weights' signature)."""
    _check_format(fmt, block_size)
    if amax is None and _needs_amax(fmt, block_size):
        raise ValueError(f"{what}: format {fmt!r} needs an amax tensor, got None")
    weights, amax, sig = _check_weights(weights, what, amax, fmt, block_size)
    return weights, amax if _needs_amax(fmt, block_size) else None, sig


def _split_views(flat: torch.Tensor, like: Sequence[torch.Tensor], sig: _Signature | None = None) -> list[torch.Tensor]:
    """``flat`` as views shaped like ``like`` (whose signature ``sig`` has the shapes): one ``unbind`` when all share
    a shape (the usual experts), else one view per tensor."""
    shapes = sig.shapes if sig is not None else tuple(map(_T.size, like))
    if shapes.count(shapes[0]) == len(shapes):
        return list(flat.view(len(shapes), *shapes[0]).unbind(0))
    return [v.view(shape) for v, shape in zip(flat.split([t.numel() for t in like]), shapes, strict=True)]


def grouped_weight_clip_grad(
    grads: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], amax: torch.Tensor
) -> list[torch.Tensor]:
    """Clipped straight-through gradient of N experts in one launch: ``grad * (|w| <= amax)``.

    Args:
        grads: N contiguous gradients, shaped like ``weights``, one float dtype.
        weights: the N forward inputs.
        amax: the forward's amax (``[N]``, ``[N, C]`` or scalar); invalid entries clip nothing.

    Returns:
        N gradients, views of one new buffer, in the dtype of ``grads``.

    Raises:
        ValueError: on mismatched lists, shapes, devices, non-contiguous tensors or a bad amax.
    """
    what = "grouped_weight_clip_grad"
    weights, amax, weights_sig = _check_weights(weights, what, amax, None, None)
    grads, _, grads_sig = _check_weights(grads, what, None, None, None)
    if amax is None:
        raise ValueError(f"{what}: amax is required (use the gradients unchanged for no clipping)")
    if len(grads) != len(weights):
        raise ValueError(f"{what}: {len(grads)} gradients for {len(weights)} experts")
    if grads_sig is None or weights_sig is None or (grads_sig.shapes, grads_sig.devices) != (
            weights_sig.shapes, weights_sig.devices):
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            if g.shape != w.shape:
                raise ValueError(f"{what}: gradient {i} has shape {tuple(g.shape)}, weight has {tuple(w.shape)}")
            if g.device != w.device:
                raise ValueError(f"{what}: gradient {i} is on {g.device}, weight on {w.device}")
    if _eager():
        flat = _weight_clip_grad_impl(grads, weights, amax, grads_sig, weights_sig)
    else:
        flat = torch.ops.modelopt_moe.grouped_weight_clip_grad(grads, weights, amax)
    return _split_views(flat, grads, grads_sig)


def _check_input(x: torch.Tensor, m_splits, amax: torch.Tensor | None, what: str):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{what}: x must be a 2-D [tokens, features] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{what}: x has dtype {x.dtype}; expected one of {_FLOAT_DTYPES}")
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
        amax = _check_amax_tensor(amax, x.device, what)
        if not (amax.dim() == 0 or (amax.dim() == 1 and amax.shape[0] == n)):
            raise ValueError(f"{what}: amax must be a scalar (shared) or [{n}] (per expert), got shape "
                             f"{tuple(amax.shape)}")
    return m_splits, amax


def grouped_input_fake_quant(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    narrow_range: bool = True,
) -> torch.Tensor:
    """Fake-quantizes the concatenated tokens of N experts in one launch, each row group with its expert's amax.

    Args:
        x: ``[T, K]`` contiguous bf16/fp16/fp32; rows ``[sum(m_splits[:i]), sum(m_splits[:i+1]))`` belong to expert
            ``i``. ``sum(m_splits)`` must equal ``T`` (not checked: that would need a host sync); rows past it are
            quantized with the last expert's amax.
        m_splits: ``[N]`` integer tensor on ``x``'s device (offsets are computed on the device, no sync), or a list
            of ints (then copied to the device).
        amax: ``[N]`` per expert or a scalar shared by all; ``None`` only for int formats with ``block_size``.
        fmt: ``"e4m3"``, ``"e5m2"``, ``"nvfp4"``, or ``"int2"`` .. ``"int8"``.
        block_size: int formats only: dynamic per-block amax along the last dim (power of two; a last dim that is
            not a multiple is zero-padded).
        narrow_range: int formats only: levels ``[-B, B]`` (True) or ``[-B-1, B]``.

    Returns:
        ``y`` shaped and typed like ``x``.

    Raises:
        ValueError: on a bad shape, dtype, device, contiguity, amax shape, format or block size.
    """
    m_splits, amax = _check_input_fake_quant(x, m_splits, amax, fmt, block_size, "grouped_input_fake_quant")
    op = _input_fake_quant_impl if _eager() else torch.ops.modelopt_moe.grouped_input_fake_quant
    return op(x, m_splits, amax, fmt, block_size, bool(narrow_range))


def _check_input_fake_quant(x, m_splits, amax, fmt: str, block_size: int | None, what: str):
    """The checks of a grouped input fake quant: (device m_splits, the fp32 amax or None where unused)."""
    _check_format(fmt, block_size)
    if amax is None and _needs_amax(fmt, block_size):
        raise ValueError(f"{what}: format {fmt!r} needs an amax tensor, got None")
    m_splits, amax = _check_input(x, m_splits, amax, what)
    if fmt == "nvfp4" and x.shape[1] % NVFP4_BLOCK_SIZE:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}; format {fmt!r} needs a last dim that is a "
                         f"multiple of the block size {NVFP4_BLOCK_SIZE}")
    return m_splits, amax if _needs_amax(fmt, block_size) else None


def grouped_input_clip_grad(grad: torch.Tensor, x: torch.Tensor, m_splits, amax: torch.Tensor) -> torch.Tensor:
    """Clipped straight-through gradient of :func:`grouped_input_fake_quant`: ``grad * (|x| <= amax_of_row)``.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or a bad amax.
    """
    what = "grouped_input_clip_grad"
    if amax is None:
        raise ValueError(f"{what}: amax is required (use the gradient unchanged for no clipping)")
    m_splits, amax = _check_input(x, m_splits, amax, what)
    if not isinstance(grad, torch.Tensor) or grad.shape != x.shape or grad.device != x.device:
        raise ValueError(f"{what}: grad must be a tensor shaped like x {tuple(x.shape)} on {x.device}")
    if grad.dtype not in _FLOAT_DTYPES or not grad.is_contiguous():
        raise ValueError(f"{what}: grad must be a contiguous bf16/fp16/fp32 tensor, got {grad.dtype}")
    op = _input_clip_grad_impl if _eager() else torch.ops.modelopt_moe.grouped_input_clip_grad
    return op(grad, x, m_splits, amax)


# ----------------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile; register_fake gives the output metadata). No host sync inside.
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_moe::grouped_weight_fake_quant", mutates_args=())
def _grouped_weight_fake_quant_op(
    weights: list[torch.Tensor], amax: Optional[torch.Tensor], fmt: str, block_size: Optional[int],  # noqa: UP045
    narrow_range: bool = True,
) -> torch.Tensor:
    return _weight_fake_quant_impl(weights, amax, fmt, block_size, narrow_range)


def _weight_fake_quant_impl(weights, amax, fmt, block_size, narrow_range, sig: _Signature | None = None):
    if kernels_available(weights[0].device):
        return _launch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range, sig)
    return _torch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range)


@_grouped_weight_fake_quant_op.register_fake
def _(weights, amax, fmt, block_size, narrow_range=True):
    return weights[0].new_empty(sum(w.numel() for w in weights))


@torch.library.custom_op("modelopt_moe::grouped_weight_clip_grad", mutates_args=())
def _grouped_weight_clip_grad_op(
    grads: list[torch.Tensor], weights: list[torch.Tensor], amax: torch.Tensor
) -> torch.Tensor:
    return _weight_clip_grad_impl(grads, weights, amax)


def _weight_clip_grad_impl(grads, weights, amax, grads_sig=None, weights_sig=None) -> torch.Tensor:
    if kernels_available(weights[0].device):
        return _launch_weight_clip_grad(grads, weights, amax, grads_sig, weights_sig)
    return _torch_weight_clip_grad(grads, weights, amax)


@_grouped_weight_clip_grad_op.register_fake
def _(grads, weights, amax):
    return grads[0].new_empty(sum(g.numel() for g in grads))


@torch.library.custom_op("modelopt_moe::grouped_input_fake_quant", mutates_args=())
def _grouped_input_fake_quant_op(
    x: torch.Tensor, m_splits: torch.Tensor, amax: Optional[torch.Tensor], fmt: str,  # noqa: UP045
    block_size: Optional[int], narrow_range: bool = True,  # noqa: UP045
) -> torch.Tensor:
    return _input_fake_quant_impl(x, m_splits, amax, fmt, block_size, narrow_range)


def _input_fake_quant_impl(x, m_splits, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    if kernels_available(x.device):
        return _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)
    return _torch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)


@_grouped_input_fake_quant_op.register_fake
def _(x, m_splits, amax, fmt, block_size, narrow_range=True):
    return torch.empty_like(x)


@torch.library.custom_op("modelopt_moe::grouped_input_clip_grad", mutates_args=())
def _grouped_input_clip_grad_op(
    grad: torch.Tensor, x: torch.Tensor, m_splits: torch.Tensor, amax: torch.Tensor
) -> torch.Tensor:
    return _input_clip_grad_impl(grad, x, m_splits, amax)


def _input_clip_grad_impl(grad, x, m_splits, amax) -> torch.Tensor:
    if kernels_available(x.device):
        return _launch_input_clip_grad(grad, x, m_splits, amax)
    return _torch_input_clip_grad(grad, x, m_splits, amax)


@_grouped_input_clip_grad_op.register_fake
def _(grad, x, m_splits, amax):
    return torch.empty_like(grad)


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------
def _check_ste(ste: str) -> None:
    if ste not in _STE_MODES:
        raise ValueError(f"ste must be one of {_STE_MODES}, got {ste!r}")


class GroupedWeightFakeQuant(torch.autograd.Function):
    """``apply(amax, fmt, block_size, ste, narrow_range, *weights) -> tuple of N fake-quantized weights`` (views of
    one buffer).

    Backward: ``ste="pass_through"`` returns the gradients unchanged (no launch); ``"clipped"`` zeroes them where
    ``|w| > amax`` in one launch (no clipping without an amax). amax gets no gradient.
    """

    @staticmethod
    def forward(ctx, amax, fmt, block_size, ste, narrow_range, *weights):
        _save_weight_ste(ctx, ste, amax, weights)
        return tuple(grouped_weight_fake_quant(list(weights), amax, fmt, block_size, narrow_range))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None, *_weight_ste_grads(ctx, grads))


class GroupedWeightSTE(torch.autograd.Function):
    """``apply(amax, ste, values, *weights) -> values`` (as views): fake-quantized weights computed earlier (e.g. kept
    across gradient-accumulation micro-batches) put back into the graph with :class:`GroupedWeightFakeQuant`'s
    backward."""

    @staticmethod
    def forward(ctx, amax, ste, values, *weights):
        _save_weight_ste(ctx, ste, amax, weights)
        # New tensor objects for the same values (a reused list goes into several graphs), made in C, not per expert
        # in Python.
        return tuple(map(_T.detach, values))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *_weight_ste_grads(ctx, grads))


def _save_weight_ste(ctx, ste: str, amax: torch.Tensor | None, weights) -> None:
    _check_ste(ste)
    ctx.clipped = ste == "clipped" and amax is not None
    if ctx.clipped:
        ctx.save_for_backward(amax, *weights)


def _weight_ste_grads(ctx, grads) -> list:
    """Pass-through: the gradients unchanged (no launch); clipped: zero where ``|w| > amax`` (one launch)."""
    if not ctx.clipped:
        return list(grads)
    amax, *weights = ctx.saved_tensors
    grads = [torch.zeros_like(w) if g is None else g.contiguous() for g, w in zip(grads, weights, strict=True)]
    return grouped_weight_clip_grad(grads, weights, amax)


class GroupedInputFakeQuant(torch.autograd.Function):
    """``apply(x, m_splits, amax, fmt, block_size, ste, narrow_range=True) -> y``: per-expert input fake quant with
    an STE."""

    @staticmethod
    def forward(ctx, x, m_splits, amax, fmt, block_size, ste, narrow_range=True):
        _check_ste(ste)
        y = grouped_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)
        ctx.clipped = ste == "clipped" and amax is not None
        if ctx.clipped:
            m = m_splits if isinstance(m_splits, torch.Tensor) else torch.tensor(list(m_splits), device=x.device)
            ctx.save_for_backward(x, m, amax)
        return y

    @staticmethod
    def backward(ctx, grad):
        if not ctx.clipped:
            return grad, None, None, None, None, None, None
        x, m_splits, amax = ctx.saved_tensors
        return grouped_input_clip_grad(grad.contiguous(), x, m_splits, amax), None, None, None, None, None, None


def grouped_weight_fake_quant_ste(
    weights: Sequence[torch.Tensor], amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    ste: str = "pass_through", narrow_range: bool = True,
) -> list[torch.Tensor]:
    """Differentiable :func:`grouped_weight_fake_quant` (see :class:`GroupedWeightFakeQuant`)."""
    return list(GroupedWeightFakeQuant.apply(amax, fmt, block_size, ste, narrow_range, *weights))


def grouped_input_fake_quant_ste(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    ste: str = "pass_through", narrow_range: bool = True,
) -> torch.Tensor:
    """Differentiable :func:`grouped_input_fake_quant` (see :class:`GroupedInputFakeQuant`)."""
    return GroupedInputFakeQuant.apply(x, m_splits, amax, fmt, block_size, ste, narrow_range)
