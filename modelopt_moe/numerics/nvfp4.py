"""NVFP4: E2M1 values in blocks of 16 along the last dim, E4M3 block scales under a per-tensor second-level scale.

Global scale ``sg = amax / (6 * 448)``; each block of 16 along the last dim gets ``sb = e4m3(clamp(blockmax / 6 / sg,
0, 448))`` and ``s = sb * sg``; values ``x / s`` round to E2M1 ``{0, .5, 1, 1.5, 2, 3, 4, 6}`` (ties to even,
saturating at 6); output ``q * s``. Where ``s == 0`` (an all-zero block, or a block scale that underflows E4M3)
``x * 0`` is used instead of ``x / s``. An invalid amax (<= 2**-24, NaN, Inf) gives ``sg = 1``. Blocks are never
padded: the last dim must be a multiple of 16. With dynamic block scales (the default) the per-tensor amax is the
only calibrated number; the block scales come from the data.

Static block scales (``block_sizes.type: static``, Model Optimizer's static NVFP4): each block has a calibrated
amax ``a_b`` (``[..., K // 16]``) that replaces the block max: ``sb = e4m3(clamp(a_b / 6 / sg, 0, 448))``, the rest
unchanged. With ``four_over_six`` the second-level scale normalizes the block scales to 256 instead of 448
(``sg = amax / (6 * 256)``), as Model Optimizer's ``fp8_max_for_normalization``: a block may then take a scale of up
to 1.5 times its max / 6 (its max maps to E2M1's 4 instead of 6) without leaving E4M3's range.

Export: two E2M1 codes per byte (column ``2j`` in the low nibble of byte ``j``; code bit 3 the sign, bits 0-2 the
index into ``0, 0.5, 1, 1.5, 2, 3, 4, 6``), the E4M3 block scales, and the second-level scale as each file format
stores it (Model Optimizer ``weight_scale_2 = sg``; compressed-tensors ``weight_global_scale = 1 / sg``). NVFP4 with
4-over-6 block scales exports through the same codec: plain NVFP4 tensors with the block scales its rule chose and
``sg = amax / 1536``; a 4-over-6 input's scale is ``input amax / 1536`` (see ``_NVFP4Codec``).
"""

from __future__ import annotations

import torch

from .format import (
    ExportCodec,
    Format,
    KernelRoutine,
    KernelSpec,
    Quantized,
    ScaleLayout,
    UnsupportedSetting,
    check_finite_weight,
    nan_ignoring_block_max,
    reciprocal,
    safe_amax,
    true_div,
)
from .fp8 import E4M3, E4M3_MAX

__all__ = ["NVFP4_BLOCK_SIZE", "E2M1_MAX", "E2M1_VALUES", "FOUR_OVER_SIX_SCALE_MAX", "NVFP4Format", "NVFP4",
           "round_to_e2m1", "e2m1_codes", "e2m1_values", "pack_fp4", "unpack_fp4", "encode_nvfp4", "nvfp4_global_scale",
           "fp8_scale_candidates", "within_block_amax", "NVFP4FourOverSixFormat", "NVFP4_FOUR_OVER_SIX",
           "block_square_error", "pairwise_block_sum"]

NVFP4_BLOCK_SIZE = 16
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FOUR_OVER_SIX_SCALE_MAX = 256.0  # block-scale normalization of 4-over-6 (Model Optimizer's E4M3_MAX_46)
# |value| * 2 -> code index (0, 1, 2, 3, 4, 6, 8, 12 -> 0..7); other entries are never looked up.
_DOUBLED_TO_INDEX = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Rounds fp32 values to the nearest E2M1 value (ties to even mantissa), saturating at +-6, NaN kept."""
    a = v.abs()
    # Each step is (upper edge, inclusive?): a tie goes to the neighbour whose mantissa bit is 0.
    mag = torch.full_like(a, E2M1_MAX)
    mag = torch.where(a <= 5.0, 4.0, mag)
    mag = torch.where(a < 3.5, 3.0, mag)
    mag = torch.where(a <= 2.5, 2.0, mag)
    mag = torch.where(a < 1.75, 1.5, mag)
    mag = torch.where(a <= 1.25, 1.0, mag)
    mag = torch.where(a < 0.75, 0.5, mag)
    mag = torch.where(a <= 0.25, 0.0, mag)
    return torch.where(torch.isnan(v), v, torch.copysign(mag, v))


class NVFP4Format(Format):
    """E2M1 values with E4M3 block scales of the format's fixed block, under a per-tensor second-level scale."""

    def check_config(self, block_sizes: dict | None, axis) -> None:
        """Blocks of exactly the format's own length with E4M3 scales from the data, and a per-tensor amax."""
        bs = block_sizes
        if bs is None or bs.get(-1) != self.block_length:
            raise ValueError(f"num_bits e2m1 (NVFP4) needs block_sizes {{-1: {self.block_length}}}, got {bs!r}")
        scale_bits = bs.get("scale_bits", E4M3.num_bits)
        key = (scale_bits.strip().lower() if isinstance(scale_bits, str)
               else tuple(scale_bits) if isinstance(scale_bits, list) else scale_bits)
        if key not in (E4M3.num_bits, *E4M3.aliases):
            raise ValueError(f"NVFP4 block scales are E4M3: scale_bits must be (4, 3), got {scale_bits!r}")
        four_over_six = bs.get("four_over_six", False)
        if not isinstance(four_over_six, bool):
            raise ValueError(f"block_sizes.four_over_six must be true or false, got {four_over_six!r}")
        if four_over_six and bs.get("type", "dynamic") != "static":
            raise UnsupportedSetting("block_sizes.four_over_six", True, "4-over-6 chooses each block's scale when "
                                     "calibrating: it needs static block scales (block_sizes.type: static)")
        if axis is not None:
            raise ValueError(f"NVFP4 uses a per-tensor global amax: axis must be null, got {axis}")

    def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
        sg, blocks, block_max = self._blocks(xf, amax)
        q, sb = self._round_blocks(blocks, block_max, sg, E2M1_MAX)
        return Quantized(self.name, q, sg, sb, self.block_length)

    def _blocks(self, xf: torch.Tensor, amax) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The second-level scale ``sg`` (broadcasting over the ``[..., K/16, 16]`` block view), that view of ``xf``
        and each block's NaN-ignoring max ``[..., K/16, 1]``."""
        sg = true_div(safe_amax(amax, self.bound), self.bound)
        sg = sg.unsqueeze(-1) if sg.dim() > 0 else sg
        b = self.block_length
        return sg, xf.unflatten(-1, (-1, b)), nan_ignoring_block_max(xf, b)

    @staticmethod
    def _round_blocks(blocks, block_max, sg, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """E2M1 values and E4M3 block scales of ``blocks`` with each block's max mapped to ``divisor`` (6; 4-over-6
        also tries 4): ``sb = e4m3(clamp(blockmax / divisor / sg, 0, 448))``; where ``sb * sg == 0``, ``x * 0``."""
        sb = torch.clamp(true_div(true_div(block_max, divisor), sg), 0.0, E4M3_MAX).to(E4M3.element_dtype).float()
        s = sb * sg
        return round_to_e2m1(torch.where(s > 0, true_div(blocks, s), blocks * 0.0)), sb

    def quantize_static(self, x: torch.Tensor, amax: torch.Tensor, block_amax: torch.Tensor,
                        scale_max: float = E4M3_MAX) -> Quantized:
        """Static block scales: :meth:`quantize` with each block's calibrated amax in place of its max.

        Args:
            x: bf16, fp16 or fp32, last dim a multiple of 16.
            amax: the per-tensor (second-level) amax, broadcasting over ``x``'s leading dims as in :meth:`quantize`.
            block_amax: ``[..., K // 16]``, one amax per block of ``x``.
            scale_max: the block scales' normalization: 448, or 256 for 4-over-6.

        Raises:
            ValueError: a bad input (as :meth:`quantize`) or a ``block_amax`` that does not have one entry per block.
        """
        self._check_inputs(x, amax, None)
        b = self.block_length
        if tuple(block_amax.shape) != (*x.shape[:-1], x.shape[-1] // b):
            raise ValueError(f"NVFP4 static blocks: block amax of shape {tuple(block_amax.shape)} does not fit input "
                             f"{tuple(x.shape)}; expected {(*x.shape[:-1], x.shape[-1] // b)}")
        bound = E2M1_MAX * scale_max
        sg = true_div(safe_amax(amax, bound), bound)
        sg = sg.unsqueeze(-1) if sg.dim() > 0 else sg
        blocks = x.float().unflatten(-1, (-1, b))
        a = block_amax.float().unsqueeze(-1).to(blocks.device)
        a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
        t = true_div(true_div(a, E2M1_MAX), sg)
        # A zero, negative or NaN block amax is the scale +0.0 on every device: torch.clamp(-0.0, 0) keeps the -0.0 on
        # CPU and not on CUDA, and a -0.0 scale would flip the sign of the block's zero outputs.
        sb = torch.where(t > 0, torch.clamp(t, max=E4M3_MAX), 0.0).to(E4M3.element_dtype).float()
        s = sb * sg
        v = torch.where(s > 0, true_div(blocks, s), blocks * 0.0)
        return Quantized(self.name, round_to_e2m1(v), sg, sb, b)

    def fake_quant_static(self, x: torch.Tensor, amax: torch.Tensor, block_amax: torch.Tensor,
                          scale_max: float = E4M3_MAX) -> torch.Tensor:
        """:meth:`quantize_static`, dequantized, in ``x``'s dtype."""
        return self.dequantize(self.quantize_static(x, amax, block_amax, scale_max)).to(x.dtype)

    def dequantize(self, qx: Quantized) -> torch.Tensor:
        """``values * (sb * sg)``: one multiply by the combined scale, as the quantizer's ``s = sb * sg``."""
        return (qx.values * (qx.block_scale * qx.scale)).flatten(-2)


def block_square_error(error: torch.Tensor) -> torch.Tensor:
    """``sum(error ** 2)`` over the last dim ``[..., 16]`` of fp32 ``error``, summed as a fixed tree of adjacent
    pairs (``(e0 + e1) + (e2 + e3)``, ...): every sum adds exactly two numbers, so the kernels, whose reductions
    have no set order, reproduce it bit for bit. ``[..., 1]``."""
    return pairwise_block_sum(error * error)


def pairwise_block_sum(values: torch.Tensor) -> torch.Tensor:
    """The last dim of ``values`` (a power of two long) summed as a fixed tree of adjacent pairs, ``[..., 1]``: the
    order :func:`block_square_error` sums in."""
    while values.shape[-1] > 1:
        values = values[..., 0::2] + values[..., 1::2]
    return values


class NVFP4FourOverSixFormat(NVFP4Format):
    """NVFP4 with 4-over-6 block scales from the data (``block_sizes: {-1: 16, type: dynamic, four_over_six: true}``):
    at every call each block of 16 is quantized twice, its max mapped to E2M1's 6 (``sb = e4m3(blockmax / 6 / sg)``)
    and to its 4 (``sb = e4m3(blockmax / 4 / sg)``), and keeps the one of smaller squared error
    (:func:`block_square_error` of the dequantized block minus the input; 6 where the errors are equal or NaN). The
    second-level scale normalizes block scales to 256 (``sg = amax / (6 * 256)``) so that 1.5 times a block scale
    stays in E4M3's range. This is the rule of Transformer Engine's ``nvfp4_4over6`` recipe and of FlashInfer's 4/6
    NVFP4 quantization (Cook et al. 2025, "Four Over Six"); a quantized tensor is plain NVFP4 (codes, E4M3 block
    scales, a second-level scale), so an engine reads its weights as any NVFP4 weight.
    """

    def check_config(self, block_sizes: dict | None, axis) -> None:
        """NVFP4's rules, with ``four_over_six: true`` and block scales from the data."""
        bs = dict(block_sizes or {})
        if bs.get("four_over_six") is not True or bs.get("type", "dynamic") == "static":
            raise ValueError(f"format {self.name} is NVFP4 with block_sizes four_over_six: true and type: dynamic, "
                             f"got block_sizes {block_sizes!r}")
        bs.pop("four_over_six")
        super().check_config(bs, axis)

    def _quantize(self, xf, amax, block_size, narrow_range, unsigned) -> Quantized:
        return self._quantize_by(xf, amax, block_square_error)

    def _quantize_by(self, xf, amax, block_error) -> Quantized:
        """The quantization with each block's candidate chosen by ``block_error`` (fp32 errors ``[..., 16]`` ->
        ``[..., 1]``; the format's own is :func:`block_square_error`): 4 only where its error is strictly smaller."""
        sg, blocks, block_max = self._blocks(xf, amax)
        (q6, sb6), (q4, sb4) = (self._round_blocks(blocks, block_max, sg, d) for d in (E2M1_MAX, 4.0))
        four = block_error(q4 * (sb4 * sg) - blocks) < block_error(q6 * (sb6 * sg) - blocks)
        return Quantized(self.name, torch.where(four, q4, q6), sg, torch.where(four, sb4, sb6), self.block_length)


class _NVFP4Codec(ExportCodec):
    """NVFP4 weights, plain or with 4-over-6 block scales (``four_over_six``): both are stored as plain NVFP4 (codes,
    the E4M3 block scales training chose, the second-level scale ``sg = amax / bound``, ``bound`` 2688 or 1536), so
    every NVFP4 reader decodes them exactly. Inputs go with either rule; a 4-over-6 input's global scale is normalized
    to 256 (``input amax / 1536``) and the engine must run the 4-over-6 activation recipe to round as training did.

    Schemes: ``NVFP4`` / ``NVFP4_A16`` (plain), ``NVFP4_4O6`` (4/6 weights and inputs), ``NVFP4_4O6_A16`` (4/6
    weights, no input quantizer), ``NVFP4_4O6_WEIGHTS`` (4/6 weights, plain NVFP4 inputs: fully standard),
    ``NVFP4_4O6_INPUTS`` (plain weights, 4/6 inputs).
    """

    ct_format = "nvfp4-pack-quantized"
    group_size = NVFP4_BLOCK_SIZE

    def __init__(self, four_over_six: bool = False):
        self.four_over_six = four_over_six
        self.scheme = "NVFP4_4O6" if four_over_six else "NVFP4"
        self.label = "NVFP4 (4-over-6)" if four_over_six else "NVFP4"
        self.weight_text = self.label
        self.expressible = ("NVFP4 (4-over-6) weights with NVFP4 (4-over-6 or plain) inputs or none" if four_over_six
                            else "NVFP4 weights with NVFP4 (plain or 4-over-6) inputs or none")

    @property
    def _weight_format(self) -> NVFP4Format:
        return NVFP4_FOUR_OVER_SIX if self.four_over_six else NVFP4

    def accepts_weight(self, axis, block_size) -> bool:
        return True

    def input_problem(self, weight, x) -> str | None:
        if x.fmt in _NVFP4_INPUT_FORMATS:
            return None
        return f"{self.label} weights need NVFP4 inputs (plain or 4-over-6) or none, got input {x}"

    def schemes(self) -> list[dict]:
        own = self._weight_format.name
        other = (NVFP4 if self.four_over_six else NVFP4_FOUR_OVER_SIX).name
        mixed = "NVFP4_4O6_WEIGHTS" if self.four_over_six else "NVFP4_4O6_INPUTS"
        return [{"name": self.scheme, "per_channel": False, "input_quantized": True, "input_fmt": own},
                {"name": self.scheme + "_A16", "per_channel": False, "input_quantized": False},
                {"name": mixed, "per_channel": False, "input_quantized": True, "input_fmt": other}]

    def scheme_name(self, weight, x) -> str:
        if x is None:
            return self.scheme + "_A16"
        if x.fmt == self._weight_format.name:
            return self.scheme
        return "NVFP4_4O6_WEIGHTS" if self.four_over_six else "NVFP4_4O6_INPUTS"

    def modelopt_algo(self, scheme) -> str | None:
        return "NVFP4" if scheme.input_quantized else "W4A16_NVFP4"

    def ct_args(self, scheme, inputs: bool) -> dict:
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": NVFP4_BLOCK_SIZE,
                "strategy": "tensor_group", "dynamic": "local" if inputs else False,
                "scale_dtype": "torch.float8_e4m3fn"}

    def encode(self, module, weight, weight_amax, input_amax, scheme, file_format,
               static_blocks: tuple[torch.Tensor, float] | None = None) -> dict[str, torch.Tensor]:
        if weight.shape[1] % NVFP4_BLOCK_SIZE:
            raise ValueError(f"{module}.weight: NVFP4 needs the input dim to be a multiple of {NVFP4_BLOCK_SIZE}, "
                             f"got shape {tuple(weight.shape)}")
        if static_blocks is not None and self.four_over_six:
            raise ValueError(f"{module}.weight: {self.label} chooses its block scales from the data; static block "
                             "scales are plain NVFP4's (block_sizes.type: static)")
        block_amax, scale_max = static_blocks if static_blocks is not None else (None, E4M3_MAX)
        packed, block_scale, sg = encode_nvfp4(weight, weight_amax.float().reshape(()), f"{module}.weight",
                                               block_amax, scale_max, self._weight_format)
        input_fmt = _NVFP4_INPUT_FORMATS[getattr(scheme, "input_fmt", None) or self._weight_format.name]
        sg_in = nvfp4_global_scale(input_amax, input_fmt) if input_amax is not None else None
        if file_format == "modelopt":
            out = {f"{module}.weight": packed, f"{module}.weight_scale": block_scale,
                   f"{module}.weight_scale_2": self.scalar(sg, file_format)}
            if sg_in is not None:
                out[f"{module}.input_scale"] = self.scalar(sg_in, file_format)
            return out
        out = {f"{module}.weight_packed": packed, f"{module}.weight_scale": block_scale,
               f"{module}.weight_global_scale": self.scalar(reciprocal(sg), file_format)}
        if sg_in is not None:
            out[f"{module}.input_global_scale"] = self.scalar(reciprocal(sg_in), file_format)
        return out


# NVFP4's amax bound is the product of its element bound and its block-scale bound.
NVFP4 = NVFP4Format("nvfp4", (2, 1), E2M1_MAX, E2M1_MAX * E4M3_MAX, "NVFP4", frozenset({ScaleLayout.TWO_LEVEL}),
                    KernelSpec(KernelRoutine.TWO_LEVEL_E2M1, E2M1_MAX * E4M3_MAX, tile=2048,
                               token_tile=4096),
                    aliases=("e2m1", "nvfp4"), block=(NVFP4_BLOCK_SIZE,), block_scale=E4M3.name, export=_NVFP4Codec())
# Selected by block_sizes four_over_six with dynamic block scales (registry.format_of); NVFP4's tiles. Its tensors are
# plain NVFP4: the same codec, parametrized.
NVFP4_FOUR_OVER_SIX = NVFP4FourOverSixFormat(
    "nvfp4_four_over_six", (2, 1), E2M1_MAX, E2M1_MAX * FOUR_OVER_SIX_SCALE_MAX, "NVFP4 (4-over-6)",
    frozenset({ScaleLayout.TWO_LEVEL}),
    # Tokens: 16 elements per thread (the two candidates' registers), 1.3x faster than NVFP4's 32 (docs/benchmarks.md).
    KernelSpec(KernelRoutine.TWO_LEVEL_E2M1_FOUR_OVER_SIX, E2M1_MAX * FOUR_OVER_SIX_SCALE_MAX, tile=2048,
               token_tile=2048, token_thread_elems=16),
    block=(NVFP4_BLOCK_SIZE,), block_scale=E4M3.name, export=_NVFP4Codec(four_over_six=True))
# The input formats an NVFP4 weight (plain or 4-over-6) exports with, by name.
_NVFP4_INPUT_FORMATS = {NVFP4.name: NVFP4, NVFP4_FOUR_OVER_SIX.name: NVFP4_FOUR_OVER_SIX}


def within_block_amax(x: torch.Tensor, block_amax: torch.Tensor, block: int) -> torch.Tensor:
    """Where ``|x|`` is at most its block's amax (``block_amax``: ``[..., K // block]``), shaped like ``x``: the
    elements a clipped straight-through estimator of static block scales lets the gradient through."""
    return (x.abs().unflatten(-1, (-1, block)) <= block_amax.unsqueeze(-1)).flatten(-2)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, one per element) of fp32 values that lie on the E2M1 grid; ``-0.0`` keeps its sign.

    Raises:
        ValueError: a value is NaN or not on the grid.
    """
    doubled = values.abs() * 2
    on_grid = torch.isin(doubled, torch.tensor([2.0 * v for v in E2M1_VALUES], device=values.device))
    if not bool(on_grid.all()):
        bad = values[~on_grid].flatten()[:4].tolist()
        raise ValueError(f"e2m1_codes: values {bad} are not E2M1 values {E2M1_VALUES} (NaN weights cannot be encoded)")
    index = _DOUBLED_TO_INDEX.to(values.device)[doubled.to(torch.int64)]
    return index | (torch.signbit(values).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes (the sign bit gives ``-0.0`` for code 8)."""
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 7).to(torch.int64)]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` 4-bit codes -> ``[..., K // 2]`` bytes, column ``2j`` in the low nibble of byte ``j``."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dim of shape {tuple(codes.shape)} must be even")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., K // 2]`` uint8 -> ``[..., K]`` 4-bit codes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8 packed codes, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def encode_nvfp4(w: torch.Tensor, amax: torch.Tensor, name: str = "weight", block_amax: torch.Tensor | None = None,
                 scale_max: float = E4M3_MAX, fmt: NVFP4Format | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 codes of the 2-D ``w`` packed two per byte ``[R, K // 2]``, its E4M3 block scales ``[R, K // 16]`` and
    the training's second-level scale ``sg = amax / 2688`` (fp32 scalar); with ``block_amax`` (static block scales,
    ``[R, K // 16]``) the block scales the training used from it, and ``sg = amax / (6 * scale_max)``; with ``fmt``
    :data:`NVFP4_FOUR_OVER_SIX` the block scales its 4-over-6 rule chose, and ``sg = amax / 1536``.

    Raises:
        ValueError: ``w`` is not 2-D, holds NaN, or its last dim is not a multiple of 16.
    """
    if w.dim() != 2:
        raise ValueError(f"{name}: NVFP4 export takes a 2-D weight, got shape {tuple(w.shape)}")
    check_finite_weight(w, name)
    fmt = NVFP4 if fmt is None else fmt
    qx = fmt.quantize(w, amax) if block_amax is None else fmt.quantize_static(w, amax, block_amax, scale_max)
    codes = e2m1_codes(qx.values.flatten(-2))
    block_scale = qx.block_scale.squeeze(-1)
    if bool((block_scale > E4M3_MAX).any()):  # cannot happen (quantize clamps); a guard for the cast below
        raise ValueError(f"{name}: an NVFP4 block scale exceeds E4M3's range")
    return pack_fp4(codes), block_scale.to(E4M3.element_dtype), qx.scale.reshape(())


def nvfp4_global_scale(amax: torch.Tensor, fmt: NVFP4Format | None = None) -> torch.Tensor:
    """The training's NVFP4 second-level scale ``sg = amax / 2688`` (``fmt`` :data:`NVFP4_FOUR_OVER_SIX`:
    ``amax / 1536``; invalid amax -> 1)."""
    fmt = NVFP4 if fmt is None else fmt
    return fmt.quantize(torch.zeros(NVFP4_BLOCK_SIZE), amax.float().reshape(())).scale.reshape(())


def fp8_scale_candidates(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 126 finite positive E4M3 values divided by 448, ascending (fp32): Model Optimizer 0.47's candidates of
    the FP8 scale sweep (``fp8_scale_sweep``). A block whose amax is ``global_amax * c`` gets the block scale
    ``c * 448`` exactly, so the sweep tries every E4M3 block scale."""
    values = torch.arange(0, 128, dtype=torch.uint8, device=device).view(E4M3.element_dtype).float()
    return values[torch.isfinite(values) & (values > 0)] / E4M3_MAX
