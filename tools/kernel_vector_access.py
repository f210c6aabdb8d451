"""Which Triton kernels read and write bf16 in 16-byte vectors: compiles each kernel of ``modelopt_moe.kernels`` for a
Hopper GPU (sm_90; no GPU needed, Triton's CUDA backend compiles on any machine) in the cases its launcher takes
(experts of one shape or of several, full or partial tiles, flat or per-row tiles) and counts the global loads and
stores of its PTX: 16-byte vectors (``v4.b32``: 8 bf16 values) and single bf16 elements (``b16``).

An alignment hint (``tl.multiple_of``) that the compiler cannot use, e.g. one on a broadcast 2-D offset tensor (it
says nothing along a row), on an int64 value loaded from the per-expert table, or lost in an int32 cast, leaves
single-element accesses: a fraction of the copy bandwidth, with the same bits. Prints a table; exits with status 1
when some kernel has a single-element bf16 access.

Usage: ``python tools/kernel_vector_access.py``. Run it with ``TRITON_INTERPRET`` unset (the interpreter's kernels
do not compile).
"""

from __future__ import annotations

import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

from modelopt_moe.kernels import (
    fp8_block_kernels,
    input_fake_quant_kernels,
    quant_stats_kernels,
    weight_amax_kernels,
    weight_fake_quant_kernels,
)
from modelopt_moe.kernels.launch import format_constexprs, token_tiling

TARGET = GPUTarget("cuda", 90, 32)
# Arguments by name: pointer dtypes (bf16 data), and the integers the launch specializes as multiples of 16 (Triton
# does so for every integer argument that is one): row lengths of 16-byte aligned weights and tokens.
POINTERS = {"table_ptr": "*i64", "m_splits_ptr": "*i64", "amax_ptr": "*fp32", "stats_ptr": "*fp32",
            "scale_ptr": "*fp32", "block_ptr": "*fp32"}
MULTIPLES_OF_16 = {"u_cols", "n_cols"}
_FP8 = format_constexprs("e4m3", None)
# The launchers' weight tiles of 4096 elements in blocks of 16: flat, or rows of 1024 (per-row tiles).
_WEIGHT = dict(TILE_R=1, TILE_NB=256, BS=16, VEC=8, SEARCH_STEPS=7, BITWISE_CVT=False)
_ROWS = dict(TILE_R=4, TILE_NB=64)
_BLOCK2D = dict(BOUND=448.0, MANT=3, EMIN=-6, EMAX=8, BR=128, BC=128, SEARCH_STEPS=7, BITWISE_CVT=False, VEC=8,
                HW_CVT=True)
_TOKENS = dict(N_PAD=128, TILE_R=4, BITWISE_CVT=False)  # 8192 elements: rows of 2048


def _token_blocks(block: int | None) -> dict:
    """The token tile's inner dim as the launcher sets it: a format's block (NVFP4's 16: the tile routine's
    quantization block), else 32; rows of 2048 either way."""
    bs = block or 32
    return {"BS": bs, "TILE_NB": 2048 // bs}


def _cases():
    """(label, kernel, constexprs, warps, pointer dtypes by name)."""
    w, b, s = weight_fake_quant_kernels, fp8_block_kernels, quant_stats_kernels
    out = []
    for two_d in (False, True):
        tiles = "per-row tiles" if two_d else "flat tiles"
        tiling = {**_WEIGHT, **(_ROWS if two_d else {})}
        for uniform, even in ((True, True), (True, False), (False, False)):
            shapes = "one shape" if uniform else "several shapes"
            out.append((f"weight fake quant, {tiles}, {shapes}, {'full' if even else 'partial'} tiles",
                        w.grouped_weight_fake_quant_kernel,
                        dict(_FP8, **tiling, AMAX_MODE=2 if two_d else 1, TWO_D=two_d, UNIFORM=uniform, EVEN=even,
                             HW_CVT=True), 4, {}))
        # 4-over-6 quantizes each block twice and sums its errors through reshapes: the same vectors all the same.
        out.append((f"weight fake quant, NVFP4 4-over-6, {tiles}, several shapes, partial",
                    w.grouped_weight_fake_quant_kernel,
                    dict(format_constexprs("nvfp4_four_over_six", 16), **tiling, AMAX_MODE=2 if two_d else 1,
                         TWO_D=two_d, UNIFORM=False, EVEN=False, HW_CVT=True, FAST_MAX=True), 4, {}))
        out.append((f"weight clipped gradient, {tiles}", w.grouped_weight_clip_grad_kernel,
                    dict(tiling, AMAX_MODE=2 if two_d else 1, TWO_D=two_d), 4, {}))
        out.append((f"weight fake quant + statistics, {tiles}", s.grouped_weight_fake_quant_stats_kernel,
                    dict(_FP8, **tiling, AMAX_MODE=2 if two_d else 1, TWO_D=two_d, UNIFORM=False), 4, {}))
        out.append((f"weight amax, {'per row' if two_d else 'per expert'}",
                    weight_amax_kernels.grouped_weight_amax_kernel,
                    dict(tiling, PER_ROW=two_d, UNIFORM=False), 4, {"out_ptr": "*fp32"}))
        del out[-1][2]["BITWISE_CVT"]  # the amax kernel writes fp32 maxima
    nvfp4 = format_constexprs("nvfp4", 16)
    out.append(("static NVFP4 blocks fake quant", w.grouped_static_blocks_fake_quant_kernel,
                dict(_WEIGHT, BOUND=nvfp4["BOUND"], UNIFORM=False), 4, {}))
    out.append(("static NVFP4 blocks clipped gradient", w.grouped_static_blocks_clip_grad_kernel, dict(_WEIGHT), 4,
                {}))
    for label, extra, warps in (("32-row slices", dict(CHUNK=32), 4),
                                ("prefetch (the default)",
                                 dict(CHUNK=128, PERSISTENT=True, PREFETCH=True), 16)):
        for uniform, even in ((True, True), (False, False)):
            shapes = "one shape, full" if uniform else "several shapes, partial"
            out.append((f"FP8 128x128 blocks, {label}, {shapes}", b.grouped_weight_block2d_kernel,
                        dict(_BLOCK2D, **extra, UNIFORM=uniform, EVEN=even), warps, {}))
    out.append(("FP8 token groups of 128", b.token_groups_kernel,
                dict(BOUND=448.0, MANT=3, EMIN=-6, EMAX=8, TILE_R=8, TILE_NB=8, BS=128, BITWISE_CVT=False), 8, {}))
    for fmt, block in (("e4m3", None), ("mxfp8", 32), ("nvfp4", 16), ("nvfp4_four_over_six", 16)):
        # the launcher's own tiling of rows of 2048 for the format (elements per program and per thread)
        tile_r, tile_nb, _, launch = token_tiling(fmt, 2048, block or 32, torch.device("cuda"))
        for scale in (False, True):
            out.append((f"token fake quant, {fmt}{', row scale' if scale else ''}",
                        input_fake_quant_kernels.grouped_input_fake_quant_kernel,
                        dict(format_constexprs(fmt, block), **{**_TOKENS, "TILE_R": tile_r}, PER_EXPERT=block is None,
                             HW_CVT=True, HAS_SCALE=scale, BS=block or 32, TILE_NB=tile_nb),
                        launch["num_warps"], {}))
    out.append(("token clipped gradient", input_fake_quant_kernels.grouped_input_clip_grad_kernel,
                dict(_TOKENS, PER_EXPERT=True, **_token_blocks(None)), 8, {}))
    out.append(("token fake quant + statistics", s.grouped_input_fake_quant_stats_kernel,
                dict(_FP8, **_TOKENS, PER_EXPERT=True, **_token_blocks(None)), 8, {}))
    return out


def ptx(kernel, constexprs: dict, warps: int, pointers: dict) -> str:
    """The PTX of ``kernel`` with ``constexprs`` (the others at their defaults): pointer arguments (names ending
    ``_ptr`` / ``_base``) 16-byte aligned, bf16 unless ``pointers`` or :data:`POINTERS` say otherwise; other arguments
    int32."""
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in constexprs},
                  **constexprs}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith(("_ptr", "_base")):
            signature[name] = pointers.get(name, POINTERS.get(name, "*bf16"))
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in MULTIPLES_OF_16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]


def accesses(code: str) -> dict[str, int]:
    """Global loads and stores of ``code``: 16-byte vectors and single bf16 elements."""
    out = {}
    for op in ("ld", "st"):
        lines = [line for line in code.splitlines() if re.search(rf"\b{op}\.global\S*\s", line)]
        out[f"{op} 16 B"] = sum(bool(re.search(r"\.v4\.(b32|u32|f32)\b", line)) for line in lines)
        out[f"{op} bf16"] = sum(bool(re.search(r"\.(b16|u16)\b", line)) and ".v" not in line for line in lines)
    return out


def main() -> int:
    """Prints the table; 1 if some kernel has a single-element bf16 access, else 0."""
    singles = []
    print(f"{'kernel':<72} {'ld 16 B':>7} {'ld bf16':>7} {'st 16 B':>7} {'st bf16':>7}")
    for label, kernel, constexprs, warps, pointers in _cases():
        counts = accesses(ptx(kernel, constexprs, warps, pointers))
        print(f"{label:<72} " + " ".join(f"{counts[k]:>7}" for k in ("ld 16 B", "ld bf16", "st 16 B", "st bf16")),
              flush=True)
        if counts["ld bf16"] or counts["st bf16"]:
            singles.append(label)
    if singles:
        print("single-element bf16 accesses in: " + "; ".join(singles))
        return 1
    print("every bf16 access is a 16-byte vector")
    return 0


if __name__ == "__main__":
    sys.exit(main())
