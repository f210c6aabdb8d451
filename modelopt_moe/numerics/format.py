"""What a number format is: the :class:`Format` base every format family derives from, and the arithmetic they share.

A format is one object (an instance of its family's subclass, registered once in :mod:`.registry`) that answers
every question the rest of the project asks about it, so that no module outside the format's home compares format
names:

* what it stores: ``name``, ``num_bits`` (Model Optimizer's spelling), ``element_max`` (the largest element),
  ``element_dtype`` (the torch dtype of its elements, None where torch has none), ``bound`` (the largest magnitude an
  amax maps to: the element bound times the block-scale bound for two-level formats);
* how it is scaled: ``scale_layouts`` (:class:`ScaleLayout`), ``block`` (the fixed block shape of block formats,
  last dim last: ``(16,)`` for NVFP4, ``(128, 128)`` for a 2-D block), ``block_scale`` (the format of the block
  scales of two-level formats), ``integer`` (levels are integers: ``narrow_range`` / ``unsigned`` apply), ``pads``
  (a partial last block is zero-padded: MX), ``scale_bits`` (Model Optimizer's ``scale_bits`` that select it: MX);
* whether it needs a calibrated amax (:meth:`Format.needs_amax`), which block sizes and configs it takes
  (:meth:`Format.block_size_problem`, :meth:`Format.check_config`);
* the reference quantize / dequantize (:meth:`Format.quantize`, :meth:`Format.dequantize`), pure-torch fp32 with IEEE
  rounding: the numeric contract;
* what the Triton kernels need (:class:`KernelSpec`: the tile routine and its constants, read as constexprs);
* how its weights are stored in Hugging Face checkpoints (:class:`ExportCodec`; None: not exportable).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

__all__ = [
    "TINY_AMAX",
    "FLOAT_DTYPES",
    "ScaleLayout",
    "KernelRoutine",
    "KernelSpec",
    "ExportCodec",
    "UnsupportedSetting",
    "Quantized",
    "Format",
    "safe_amax",
    "clip_limit",
    "true_div",
    "reciprocal",
    "check_finite_weight",
    "nan_ignoring_block_max",
]

# An amax at or below this (the smallest fp16 subnormal) is treated as "never calibrated / all zero".
TINY_AMAX = 2.0**-24
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ScaleLayout(enum.Enum):
    """Where a format's scales sit over a tensor."""

    PER_TENSOR = "per tensor"  # one scale (per expert)
    PER_CHANNEL = "per channel"  # one scale per slice along the kept axes
    BLOCKS_1D = "1-D blocks"  # one scale per block of the last dim
    BLOCKS_2D = "2-D blocks"  # one scale per block of the last two dims
    TWO_LEVEL = "two-level"  # quantized block scales under a per-tensor second-level scale (NVFP4)


class KernelRoutine(enum.IntEnum):
    """Which tile routine of the Triton kernels fake-quantizes a format (the kernels' ``FAMILY`` constexpr)."""

    SCALED_FLOAT = 0  # one divisor bound / amax, a small float grid (FP8)
    SCALED_INT = 1  # one divisor bound / amax per tensor, channel or data block, an integer grid
    TWO_LEVEL_E2M1 = 2  # E2M1 values, E4M3 block scales times a second-level scale (NVFP4)
    POWER_OF_TWO_BLOCKS = 3  # a small float grid, one power-of-two (E8M0) scale per block from the data (MX)
    # E2M1 values; each block quantized with its max on E2M1's 6 and on its 4, the smaller squared error kept (NVFP4
    # with 4-over-6 block scales from the data)
    TWO_LEVEL_E2M1_FOUR_OVER_SIX = 4


@dataclass(frozen=True)
class KernelSpec:
    """What the Triton kernels need of a format, passed as constexprs (never a name).

    Attributes:
        routine: the tile routine.
        bound: the routine's bound (the element bound; the amax bound for two-level formats).
        mant, emin, emax: float grids: mantissa bits, smallest and largest normal exponent of the elements.
        tile: the weight kernel's default elements per program for this format (None: the shared default).
        token_tile: the token fake-quant kernels' elements per program (None: the shared default).
        token_thread_elems: elements per thread of the token fake-quant kernels (their warps: ``token_tile`` over
            32 times this). Fewer leave a heavy tile routine more registers per element.
    """

    routine: KernelRoutine
    bound: float
    mant: int = 0
    emin: int = 0
    emax: int = 0
    tile: int | None = None
    token_tile: int | None = None
    token_thread_elems: int = 32

    def constexprs(self, data_blocks: bool) -> dict:
        """The kernels' format constexprs; ``data_blocks``: the amax of each block comes from the data."""
        return {"FAMILY": int(self.routine), "BOUND": self.bound, "MANT": self.mant, "EMIN": self.emin,
                "EMAX": self.emax, "INT_BLOCK": data_blocks}


class UnsupportedSetting(ValueError):
    """A setting a format deliberately does not take (a documented difference from Model Optimizer): the config
    layer words it with its own table of differences.

    Attributes:
        key: the config key path (``block_sizes.type``).
        value: its value.
        hint: what to do instead.
    """

    def __init__(self, key: str, value, hint: str):
        super().__init__(f"{key}={value!r}: {hint}")
        self.key, self.value, self.hint = key, value, hint


@dataclass(frozen=True)
class Quantized:
    """What :func:`~.formats.fake_quant` rounds ``x`` to, before it multiplies back: the format's values and scales.

    ``fake_quant(x, ...) == dequantize(quantize(x, ...)).to(x.dtype)`` bit for bit (the same fp32 operations), so an
    exporter that stores these values and scales stores exactly what training used.

    Attributes:
        fmt: the format name.
        values: fp32 values on the format's grid (E4M3 / E5M2 values, E2M1 values, integers), shape of ``x``
            (``[..., K // block, block]`` for block formats).
        scale: fp8 and int per tensor / channel: the divisor ``bound / amax`` (``values / scale`` is the output);
            nvfp4: the per-tensor (per-expert) second-level scale ``sg = amax / (6 * 448)``, broadcastable over the
            block view; int blocks: the divisor of each block ``[..., K // block, 1]``.
        block_scale: nvfp4 only: each block's E4M3 scale ``sb`` as fp32, ``[..., K // 16, 1]``.
        block_size: the block length of the last dim (nvfp4: 16; int with blocks), ``(rows, cols)`` for 2-D blocks
            (values ``[..., R // rows, rows, C // cols, cols]``), None per tensor / channel.
        length: padded blocks: the last dim (2-D: the last two dims) before its zero padding to whole blocks.
    """

    fmt: str
    values: torch.Tensor
    scale: torch.Tensor
    block_scale: torch.Tensor | None = None
    block_size: int | tuple[int, int] | None = None
    length: int | tuple[int, int] | None = None


class ExportCodec:
    """How a format's weights (and the inputs quantized with them) are stored in Hugging Face checkpoints.

    Subclasses (in the format's home) say which quantizer settings the files express and write the tensors; the
    exporter (:mod:`modelopt_moe.export.schemes`) walks the registered formats' codecs and never names a format.

    Attributes:
        scheme: the stem of the checkpoint schemes (``FP8``: ``FP8``, ``FP8_A16``, ``FP8_CHANNEL``, ...).
        label: the weights' description in messages.
        expressible: what the files express, for messages.
        weight_text: the weight quantizers it takes, for messages.
        per_channel: whether weights per output channel (axis 0) export too.
        ct_format: the compressed-tensors ``format`` of the weights.
        group_size: the block length written as ``group_size`` (None: none).
    """

    scheme: str
    label: str
    expressible: str
    weight_text: str
    per_channel: bool = False
    ct_format: str
    group_size: int | None = None

    def accepts_weight(self, axis: int | None, block_size: int | None) -> bool:
        """Whether a weight quantizer with this axis and dynamic block size is what the files express."""
        raise NotImplementedError

    def input_problem(self, weight, x) -> str | None:
        """Why the input quantizer ``x`` (fmt, axis, block_size, per_token) cannot go with weight quantizer
        ``weight``; None where it can."""
        raise NotImplementedError

    def schemes(self) -> list[dict]:
        """The checkpoint schemes of the format, each a dict of the fields of
        :class:`~modelopt_moe.export.schemes.Scheme` but ``weight_fmt``. Default: per tensor (and per channel where
        ``per_channel``), with quantized inputs or weight-only (``_A16``)."""
        layouts = [(False, "")] + ([(True, "_CHANNEL")] if self.per_channel else [])
        return [{"name": self.scheme + suffix + ("" if inputs else "_A16"), "per_channel": per_channel,
                 "input_quantized": inputs} for per_channel, suffix in layouts for inputs in (True, False)]

    def scheme_name(self, weight, x) -> str:
        """The name of the scheme (one of :meth:`schemes`) of an accepted weight and input quantizer pair."""
        name = self.scheme + ("_CHANNEL" if self.per_channel and weight.axis is not None else "")
        return name if x is not None else name + "_A16"

    def modelopt_algo(self, scheme) -> str | None:
        """Model Optimizer's ``quant_algo`` for ``scheme``, or None where it has none."""
        raise NotImplementedError

    def ct_args(self, scheme, inputs: bool) -> dict:
        """compressed-tensors' quantization arguments of ``scheme``'s weights (``inputs=False``) or inputs."""
        raise NotImplementedError

    def reads_amax(self, scheme, inputs: bool) -> bool:
        """Whether encoding reads the weight's (``inputs=False``) or the input's calibrated amax. Default: the
        weight's always, the input's where the scheme quantizes inputs with a static scale."""
        return not inputs or (scheme.input_quantized and not scheme.dynamic_input)

    def describe(self, scheme, file_format: str) -> tuple[str, str, list[str]] | None:
        """For the model card: the weights, the inputs (None: weight-only) and the stored tensors of ``scheme``;
        None where the card's own FP8 / NVFP4 text applies."""
        return None

    @staticmethod
    def scalar(t: torch.Tensor, file_format: str) -> torch.Tensor:
        """A per-tensor scale as each file format's producers store it: ``[1]`` (compressed-tensors), ``[]``
        (modelopt)."""
        t = t.float().reshape(())
        return t.reshape(1).contiguous() if file_format == "compressed-tensors" else t.contiguous()

    def encode(self, module: str, weight: torch.Tensor, weight_amax: torch.Tensor | None,
               input_amax: torch.Tensor | None, scheme, file_format: str) -> dict[str, torch.Tensor]:
        """The tensors of one linear of ``scheme`` in ``file_format`` (``compressed-tensors`` or ``modelopt``).

        Raises:
            ValueError: a weight the format cannot hold (naming ``module``).
        """
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class Format:
    """A number format (see the module docstring). Subclasses implement :meth:`_quantize`.

    ``eq=False``: formats compare by identity; there is exactly one object per format (the registry's).
    """

    name: str
    num_bits: int | tuple[int, int]
    element_max: float
    bound: float
    label: str
    scale_layouts: frozenset[ScaleLayout]
    kernel: KernelSpec | None  # None: the reference only (no Triton routine yet)
    element_dtype: torch.dtype | None = None
    aliases: tuple[str, ...] = ()
    block: tuple[int, ...] | None = None
    block_scale: str | None = None
    integer: bool = False
    export: ExportCodec | None = field(default=None, repr=False)
    # A last dim that is not a multiple of the fixed block is zero-padded (MX, as Model Optimizer pads); False: the
    # block must tile it exactly (NVFP4).
    pads: bool = False
    # Model Optimizer's ``block_sizes.scale_bits`` that selects this format among the formats of its ``num_bits``
    # (MX: ``(8, 0)``); None: ``num_bits`` alone names it.
    scale_bits: tuple[int, int] | None = None

    @property
    def block_length(self) -> int | None:
        """The fixed block's length along the last dim (None: no fixed block)."""
        return self.block[-1] if self.block else None

    def needs_amax(self, block_size: int | None) -> bool:
        """Whether quantizing reads an amax (calibrated or given): False where every scale comes from the data.

        Args:
            block_size: the dynamic block size of the last dim the quantizer asks for (None: none).
        """
        return True

    def block_size_problem(self, block_size: int | None) -> str | None:
        """Why this format cannot take dynamic blocks of ``block_size`` (None: it can, or none is asked)."""
        if block_size is None or self.block_length == block_size:
            return None
        if self.block is not None:  # a fixed block, and no other

            return f"{self.name} uses blocks of {self.block_length}, got block_size={block_size}"
        if ScaleLayout.BLOCKS_1D in self.scale_layouts:  # blocks of the data's own amax, of any length
            return None
        return f"format {self.name!r} has no block mode, got block_size={block_size}"

    def check_config(self, block_sizes: dict | None, axis) -> None:
        """Checks a quantizer config's format-specific settings (``block_sizes`` after the config's generic checks).

        Raises:
            ValueError: a setting the format cannot take, naming it and what the format takes.
            UnsupportedSetting: a setting it deliberately does not take.
        """
        if block_sizes is not None and block_sizes.get(-1) is not None:
            raise ValueError(f"format {self.name} has no block mode; remove block_sizes {block_sizes!r}")

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, block_size: int | None = None, *,
                 narrow_range: bool = True, unsigned: bool = False) -> Quantized:
        """The values and scales :meth:`fake_quant` computes (same arguments, same checks); see :class:`Quantized`."""
        self._check_inputs(x, amax, block_size)
        if not self.integer and (unsigned or not narrow_range):
            raise ValueError(f"fake_quant: narrow_range / unsigned apply to int formats only, got format {self.name!r} "
                             f"with narrow_range={narrow_range}, unsigned={unsigned}")
        return self._quantize(x.float(), amax, block_size, narrow_range, unsigned)

    def fake_quant(self, x: torch.Tensor, amax: torch.Tensor | None = None, block_size: int | None = None, *,
                   narrow_range: bool = True, unsigned: bool = False) -> torch.Tensor:
        """Quantizes and dequantizes ``x`` (see :func:`~.formats.fake_quant`); same shape and dtype as ``x``."""
        qx = self.quantize(x, amax, block_size, narrow_range=narrow_range, unsigned=unsigned)
        return self.dequantize(qx).to(x.dtype)

    def _quantize(self, xf: torch.Tensor, amax: torch.Tensor | None, block_size: int | None, narrow_range: bool,
                  unsigned: bool) -> Quantized:
        """The values and scales of fp32 ``xf`` (inputs already checked)."""
        raise NotImplementedError

    def _check_inputs(self, x: torch.Tensor, amax: torch.Tensor | None, block_size: int | None) -> None:
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"fake_quant: input dtype {x.dtype} not supported; expected one of {FLOAT_DTYPES}")
        needs_amax = self.needs_amax(block_size)
        if needs_amax and amax is None:
            raise ValueError(f"fake_quant: format {self.name!r} needs an amax tensor, got None")
        problem = self.block_size_problem(block_size)
        if problem is not None:
            raise ValueError(f"fake_quant: {problem}")
        if block_size is not None and self.block is None and (
                isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"fake_quant: block_size must be a positive int, got {block_size!r}")
        # Data blocks pad the last dim (integer.py); a format's own fixed blocks must tile it exactly unless it pads.
        fixed = self.block_length
        if fixed is not None and (x.dim() == 0 or (x.shape[-1] % fixed != 0 and not self.pads)):
            raise ValueError(f"fake_quant: last dim of shape {tuple(x.shape)} must be a multiple of block size "
                             f"{fixed} ({self.name} blocks are never padded)")
        if block_size is not None and x.dim() == 0:
            raise ValueError(f"fake_quant: block_size={block_size} needs a tensor with a last dim, got a scalar")
        if amax is not None and needs_amax:
            try:
                fits = torch.broadcast_shapes(amax.shape, x.shape) == x.shape
            except RuntimeError:
                fits = False
            if not fits or (fixed is not None and amax.dim() > 0 and amax.shape[-1] != 1):
                raise ValueError(
                    f"fake_quant: amax of shape {tuple(amax.shape)} does not broadcast to input {tuple(x.shape)}"
                    + (f" with size 1 in the last dim ({self.name} blocks run along it)" if fixed is not None else "")
                )

    def dequantize(self, qx: Quantized) -> torch.Tensor:
        """``values`` over their divisor in fp32 (blocks flattened, padding dropped)."""
        out = true_div(qx.values, qx.scale)
        if qx.block_size is None:
            return out
        out = out.flatten(-2)
        return out[..., :qx.length] if qx.length is not None else out


def safe_amax(amax: torch.Tensor, bound: float) -> torch.Tensor:
    """Returns ``amax`` in fp32 with every invalid entry (<= 2**-24, NaN, Inf) replaced by ``bound``."""
    amax = amax.float()
    valid = torch.isfinite(amax) & (amax > TINY_AMAX)
    return torch.where(valid, amax, torch.full_like(amax, bound))


def clip_limit(amax: torch.Tensor) -> torch.Tensor:
    """The bound of the clipped straight-through estimator: ``amax`` in fp32, with every invalid entry (<= 2**-24,
    NaN, Inf) replaced by +Inf, so that an invalid amax clips nothing."""
    a = amax.float()
    return torch.where(torch.isfinite(a) & (a > TINY_AMAX), a, torch.full_like(a, float("inf")))


def true_div(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """IEEE ``num / den`` in fp32. torch turns ``float / tensor`` into ``reciprocal(tensor) * float`` and, on CUDA,
    ``tensor / float`` (or a CPU-scalar divisor) into a multiply by the reciprocal: both round twice and the second
    differs between CPU and GPU. Dividing two tensors on one device is a true division everywhere."""
    ref = num if isinstance(num, torch.Tensor) else den
    num, den = (
        t.to(ref.device) if isinstance(t, torch.Tensor) else torch.full((), t, dtype=torch.float32, device=ref.device)
        for t in (num, den)
    )
    return torch.div(num, den)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in fp32, correctly rounded (a true division): the multiplicative FP8 ``weight_scale`` from the
    training divisor ``s``, and compressed-tensors' ``weight_global_scale`` from ``sg``."""
    scale = scale.float()
    return torch.div(torch.ones_like(scale), scale)


def check_finite_weight(w: torch.Tensor, name: str) -> None:
    """Raises ``ValueError`` naming ``name`` when ``w`` holds NaN (a NaN weight cannot be encoded)."""
    if bool(torch.isnan(w).any()):
        raise ValueError(f"{name}: the weight holds NaN; a NaN weight cannot be exported (was training diverging?)")


def nan_ignoring_block_max(xf: torch.Tensor, block_size: int) -> torch.Tensor:
    """Max of |x| over blocks of the last dim, NaN ignored; shape ``[..., K // block_size, 1]``."""
    blocks = xf.unflatten(-1, (-1, block_size)).abs()
    return torch.where(torch.isnan(blocks), torch.zeros_like(blocks), blocks).amax(dim=-1, keepdim=True)
