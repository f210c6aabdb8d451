"""What the quantizers of a linear say, which checkpoint scheme that is, and how each format stores it.

A framework adapter describes each exported linear's quantizers as a :class:`LinearQuant` (format name, axis, block
size of the weight, input and output quantizers: plain values, no modules). :func:`resolve_scheme` turns the
linears of a model into the ONE :class:`Scheme` of the checkpoint and checks that the chosen format can express it;
:func:`encode_linear` writes one linear's tensors; :func:`quantization_config` and :func:`hf_quant_config` the
config entries. Everything raises :class:`~.errors.ExportError` naming the linear, what it has and what the format
takes, before anything is written.

Schemes (``weight`` / ``input``):

=================  =======================  ==================  ===================
scheme             quantizers               compressed-tensors  Model Optimizer
=================  =======================  ==================  ===================
``FP8``            e4m3 tensor / e4m3       float-quantized     ``FP8``
``FP8_A16``        e4m3 tensor / none       float-quantized     --
``FP8_CHANNEL``    e4m3 axis 0 / e4m3       float-quantized     --
``FP8_CHANNEL_A16``  e4m3 axis 0 / none     float-quantized     --
``NVFP4``          nvfp4 / nvfp4            nvfp4-pack-quantized  ``NVFP4``
``NVFP4_A16``      nvfp4 / none             nvfp4-pack-quantized  ``W4A16_NVFP4``
``NVFP4_4O6``      4/6 nvfp4 / 4/6 nvfp4    nvfp4-pack-quantized  ``NVFP4``
``NVFP4_4O6_A16``  4/6 nvfp4 / none         nvfp4-pack-quantized  ``W4A16_NVFP4``
``NVFP4_4O6_WEIGHTS``  4/6 nvfp4 / nvfp4    nvfp4-pack-quantized  ``NVFP4``
``NVFP4_4O6_INPUTS``   nvfp4 / 4/6 nvfp4    nvfp4-pack-quantized  ``NVFP4``
``FP8_DYNAMIC``    e4m3 axis 0 / per token  float-quantized     ``FP8_PER_CHANNEL_PER_TOKEN``
``FP8_BLOCK``      e4m3 128x128 / 1x128     float-quantized     ``FP8_PB_WO``
``FP8_BLOCK_A16``  e4m3 128x128 / none      float-quantized     ``FP8_PB_WO``
``W4A16_G<g>``     int4 groups 32/64/128    pack-quantized      --
``MXFP4(_A16)``    mxfp4 / mxfp4 or none    mxfp4-pack-quantized  --
``MXFP8(_A16)``    mxfp8 / mxfp8 or none    mxfp8-quantized     ``MXFP8`` (with inputs)
=================  =======================  ==================  ===================

Each format's codec (its home in :mod:`modelopt_moe.numerics`) lists its schemes and writes their tensors. Model
Optimizer's ``FP8_PER_CHANNEL_PER_TOKEN`` quantizes activations per token at run time, which is not what a static
per-tensor input amax trained, so per-channel FP8 with static inputs goes to compressed-tensors only.

Tensors per linear (``<m>`` the Hugging Face module name; scales fp32):

* compressed-tensors FP8: ``<m>.weight`` E4M3, ``<m>.weight_scale`` ``[1]`` (``[C, 1]`` per channel) ``= 1 / s``,
  ``<m>.input_scale`` ``[1]`` ``= 1 / s_in``;
* compressed-tensors NVFP4: ``<m>.weight_packed`` uint8 ``[R, K/2]``, ``<m>.weight_scale`` E4M3 ``[R, K/16]``,
  ``<m>.weight_global_scale`` ``[1]`` ``= 1 / sg`` (= 448 * 6 / amax up to rounding: the reciprocal of ours),
  ``<m>.input_global_scale`` ``[1]`` ``= 1 / sg_in``;
* Model Optimizer FP8: ``<m>.weight`` E4M3, ``<m>.weight_scale`` ``[]`` ``= 1 / s``, ``<m>.input_scale`` ``[]``;
* Model Optimizer NVFP4: ``<m>.weight`` uint8 ``[R, K/2]``, ``<m>.weight_scale`` E4M3 ``[R, K/16]``,
  ``<m>.weight_scale_2`` ``[]`` ``= sg = amax / 2688``, ``<m>.input_scale`` ``[]`` ``= sg_in``.

``s = 448 / amax`` and ``sg = amax / (6 * 448)`` are the training scales of :mod:`modelopt_moe.numerics`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import FORMATS as NUMBER_FORMATS
from ..numerics import ExportCodec, get_format
from .errors import ExportError

__all__ = [
    "FORMATS",
    "QuantSpec",
    "LinearQuant",
    "Scheme",
    "SCHEMES",
    "scheme_of",
    "resolve_scheme",
    "encode_linear",
    "quantization_config",
    "hf_quant_config",
    "PRODUCER",
]

FORMATS = ("compressed-tensors", "modelopt", "hf")
PRODUCER = {"name": "modelopt_moe", "version": "0.1.0"}


@dataclass(frozen=True)
class QuantSpec:
    """One enabled quantizer: its format name (``e4m3``, ``nvfp4``, ``int4``, ...), axis and block size."""

    fmt: str
    axis: int | None = None
    block_size: int | tuple[int, int] | None = None
    per_token: bool = False  # one amax per token, from the data (Model Optimizer's block_sizes {-1: None})
    dynamic: bool = False  # the amax of each tensor (type: dynamic), never calibrated

    def __str__(self) -> str:
        extra = "" if self.axis is None else f" axis={self.axis}"
        extra += " per token" if self.per_token else " dynamic" if self.dynamic else ""
        return self.fmt + extra + ("" if self.block_size is None else f" block={self.block_size}")


@dataclass(frozen=True)
class LinearQuant:
    """The enabled quantizers of one linear (None: disabled)."""

    weight: QuantSpec | None = None
    input: QuantSpec | None = None
    output: QuantSpec | None = None

    @property
    def is_quantized(self) -> bool:
        """Whether any of the linear's quantizers is enabled."""
        return any(q is not None for q in (self.weight, self.input, self.output))

    def __str__(self) -> str:
        return f"weight {self.weight or 'off'}, input {self.input or 'off'}, output {self.output or 'off'}"


@dataclass(frozen=True)
class Scheme:
    """A checkpoint scheme: the weight format (``e4m3`` / ``nvfp4`` / ...), per-channel weights, quantized inputs,
    the weight's block (``(128, 128)``, ``32``: scales from the data), whether the inputs' scales come from the
    data at run time (``dynamic_input``: per token or per block; no input scale is stored) and the inputs' format
    where the codec tells input formats apart (``input_fmt``: NVFP4 inputs, plain or 4-over-6)."""

    name: str
    weight_fmt: str
    per_channel: bool
    input_quantized: bool
    weight_block: int | tuple[int, int] | None = None
    dynamic_input: bool = False
    input_fmt: str | None = None

    @property
    def codec(self) -> ExportCodec:
        """The weight format's export codec (its home in :mod:`modelopt_moe.numerics`)."""
        return get_format(self.weight_fmt).export

    @property
    def modelopt_algo(self) -> str | None:
        """Model Optimizer's ``quant_algo`` for this scheme (``hf_quant_config.json``), or None where it has none."""
        return self.codec.modelopt_algo(self)

    @property
    def ct_format(self) -> str:
        """The compressed-tensors ``format`` of this scheme's weights."""
        return self.codec.ct_format


def _schemes(fmt) -> list[Scheme]:
    """The schemes of one exportable format, as its codec lists them."""
    return [Scheme(weight_fmt=fmt.name, **fields) for fields in fmt.export.schemes()]


_EXPORTABLE = [f for f in NUMBER_FORMATS.values() if f.export is not None]
SCHEMES = {s.name: s for f in _EXPORTABLE for s in _schemes(f)}
_EXPRESSIBLE = "; ".join(f.export.expressible for f in _EXPORTABLE) + "; no output quantizer"


def scheme_of(q: LinearQuant, where: str) -> Scheme | None:
    """The scheme of one linear's quantizers (None: not quantized at all).

    Raises:
        ExportError: a quantization no exported format expresses (INT, E5M2, a weight format with a different input
            format, an output quantizer, ...), naming ``where``.
    """
    if not q.is_quantized:
        return None

    def bad(reason: str) -> ExportError:
        return ExportError(f"{where}: quantization ({q}) cannot be exported: {reason}; the formats express "
                           f"{_EXPRESSIBLE}")

    if q.output is not None:
        raise bad("an output quantizer has no place in compressed-tensors or Model Optimizer checkpoints")
    if q.weight is None:
        raise bad("inputs are quantized but the weight is not")
    w, x = q.weight, q.input
    codec = get_format(w.fmt).export
    if codec is not None and codec.accepts_weight(w.axis, w.block_size):
        problem = codec.input_problem(w, x) if x is not None else None
        if problem is not None:
            raise bad(problem)
        return SCHEMES[codec.scheme_name(w, x)]
    accepted = " or ".join(f.export.weight_text for f in _EXPORTABLE)
    raise bad(f"weight format {w} is not {accepted}")


def resolve_scheme(linears: dict[str, LinearQuant], fmt: str) -> Scheme | None:
    """The one scheme of a model's quantized linears, checked against format ``fmt``.

    Args:
        linears: Hugging Face module name -> its quantizers, for every exported linear.
        fmt: ``compressed-tensors``, ``modelopt`` or ``hf`` (unquantized).

    Returns:
        The scheme; None for ``fmt == "hf"``.

    Raises:
        ExportError: an unknown format; ``hf`` on a quantized model; a quantized format on a model with no
            quantized linear; linears in different schemes; a scheme the format cannot express.
    """
    if fmt not in FORMATS:
        raise ExportError(f"format={fmt!r}: expected one of {FORMATS}")
    schemes = {name: scheme_of(q, name) for name, q in linears.items()}
    quantized = {name: s for name, s in schemes.items() if s is not None}
    if fmt == "hf":
        if quantized:
            first = next(iter(quantized))
            raise ExportError(f"format='hf' writes unquantized weights, but the model is quantized ({first}: "
                              f"{linears[first]}); use format='compressed-tensors' or 'modelopt'")
        return None
    if not quantized:
        raise ExportError(f"format={fmt!r}: the model is not quantized (none of its {len(linears)} exported linears "
                          "has an enabled quantizer); run mtq.quantize first, or use format='hf'")
    kinds: dict[str, list[str]] = {}
    for name, s in quantized.items():
        kinds.setdefault(s.name, []).append(name)
    if len(kinds) > 1:
        detail = "; ".join(f"{k}: {v[0]}" + (f" and {len(v) - 1} more" if len(v) > 1 else "") for k, v in kinds.items())
        raise ExportError(f"format={fmt!r}: one checkpoint holds one quantization scheme, the model mixes "
                          f"{sorted(kinds)} ({detail})")
    scheme = SCHEMES[next(iter(kinds))]
    if fmt == "modelopt" and scheme.modelopt_algo is None:
        first = kinds[scheme.name][0]
        algos = sorted({s.modelopt_algo for s in SCHEMES.values() if s.modelopt_algo is not None})
        raise ExportError(f"format='modelopt': scheme {scheme.name} ({first}: {linears[first]}) has no Model "
                          f"Optimizer quant_algo that an engine reads (those are {', '.join(algos)}); export it "
                          "with format='compressed-tensors'")
    return scheme


def encode_linear(module: str, weight: torch.Tensor, weight_amax: torch.Tensor | None,
                  input_amax: torch.Tensor | None, scheme: Scheme, fmt: str,
                  weight_blocks: tuple[torch.Tensor, float] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear in format ``fmt`` (see the module docstring for names and values).

    Args:
        module: the Hugging Face module name (``model.layers.0.mlp.experts.3.gate_proj``).
        weight: the 2-D weight ``[out, in]``.
        weight_amax: per tensor ``[]``; per channel ``[out]`` or ``[out, 1]``.
        input_amax: the per-tensor input amax ``[]`` (required when the scheme quantizes inputs with a static
            scale).
        scheme: the checkpoint's scheme.
        fmt: ``compressed-tensors`` or ``modelopt``.
        weight_blocks: static two-level block scales: the ``[out, in // 16]`` block amaxes the training used and
            their normalization (448, or 256 for 4-over-6); the block scales written are exactly the training's.

    Raises:
        ExportError: a missing amax, a NaN weight, or a weight shape the format cannot hold.
    """
    if weight.dim() != 2:
        raise ExportError(f"{module}.weight: expected a 2-D weight, got shape {tuple(weight.shape)}")
    codec = scheme.codec
    if weight_amax is None and codec.reads_amax(scheme, False):
        raise ExportError(f"{module}: the weight quantizer has no amax (calibrate the model before exporting)")
    if codec.reads_amax(scheme, True) and input_amax is None:
        raise ExportError(f"{module}: the input quantizer has no amax (calibrate with a forward_loop before "
                          "exporting)")
    # Encode on the CPU, where the writer stores the result anyway: amaxes gathered over ranks arrive there while the
    # weight may be on its GPU, and the codecs' lookup tables live there (the numerics are device-independent).
    weight = weight.detach().cpu()
    weight_amax = weight_amax.detach().cpu() if codec.reads_amax(scheme, False) else None
    input_amax = input_amax.detach().cpu() if codec.reads_amax(scheme, True) else None
    try:
        extra = {} if weight_blocks is None else {"static_blocks": (weight_blocks[0].detach().cpu(), weight_blocks[1])}
        tensors = codec.encode(module, weight, weight_amax, input_amax, scheme, fmt, **extra)
    except ValueError as e:
        if isinstance(e, ExportError):
            raise
        raise ExportError(str(e)) from None
    for name, t in tensors.items():
        _check_scale(name, t)
    return tensors


def _check_scale(name: str, t: torch.Tensor) -> None:
    """Engines turn a zero, non-finite or subnormal per-tensor / per-channel scale into NaN: none is ever written
    (the codecs apply the numeric contract's rule to invalid amaxes, so this guards that contract). Block scales
    (stored in the element's scale format, e.g. E4M3 for NVFP4) may be zero: a block of zeros."""
    is_scale = name.endswith(("scale", "scale_2"))
    if not is_scale or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return
    bad = ~torch.isfinite(t) | (t.abs() < torch.finfo(t.dtype).tiny)
    if bad.any():
        raise ExportError(f"{name}: would write {int(bad.sum())} scale(s) that are zero, non-finite or subnormal "
                          f"(e.g. {t[bad].flatten()[0].item()!r}); engines read them as NaN")


def quantization_config(scheme: Scheme, fmt: str, ignore: list[str]) -> dict:
    """The ``quantization_config`` entry of ``config.json``.

    compressed-tensors: one config group targeting ``Linear`` (experts included), ``ignore`` the unquantized linears
    (their exact Hugging Face names). Model Optimizer: ``quant_method: modelopt`` with ``quant_algo``,
    ``group_size`` (NVFP4), ``kv_cache_quant_algo`` and the excluded modules under both names readers use
    (``exclude_modules``; ``ignore``, which vLLM reads from ``config.json``).
    """
    if fmt == "compressed-tensors":
        args = scheme.codec.ct_args
        group = {"targets": ["Linear"], "weights": args(scheme, False),
                 "input_activations": args(scheme, True) if scheme.input_quantized else None,
                 "output_activations": None, "format": scheme.ct_format}
        return {"quant_method": "compressed-tensors", "format": scheme.ct_format, "quantization_status": "compressed",
                "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}, "producer": dict(PRODUCER)}
    if fmt == "modelopt":
        cfg = {"quant_method": "modelopt", "quant_algo": scheme.modelopt_algo, "kv_cache_quant_algo": None,
               "exclude_modules": list(ignore), "ignore": list(ignore), "producer": dict(PRODUCER)}
        if scheme.codec.group_size is not None:
            cfg["group_size"] = scheme.codec.group_size
        return cfg
    raise ExportError(f"format={fmt!r}: no quantization_config for it (expected 'compressed-tensors' or 'modelopt')")


def hf_quant_config(scheme: Scheme, ignore: list[str]) -> dict:
    """Model Optimizer's ``hf_quant_config.json`` (read by SGLang, TensorRT-LLM and vLLM when ``config.json`` has no
    ``quantization_config``): ``{"producer", "quantization": {quant_algo, kv_cache_quant_algo, group_size,
    exclude_modules}}``."""
    quant = {"quant_algo": scheme.modelopt_algo, "kv_cache_quant_algo": None, "exclude_modules": list(ignore)}
    if scheme.codec.group_size is not None:
        quant["group_size"] = scheme.codec.group_size
    return {"producer": dict(PRODUCER), "quantization": quant}
