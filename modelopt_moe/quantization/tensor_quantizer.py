"""TensorQuantizer: one fake quantizer with a calibrated amax (scalar, per channel or per block).

The quantizer of N experts is :class:`~.expert_quantizer.ExpertQuantizer`, a subclass with an ``[N, ...]`` amax.

Names mirror NVIDIA Model Optimizer 0.47 (``TensorQuantizer(cfg, if_quant, if_calib, amax)``, ``amax``,
``enable_calib``, ``load_calib_amax``, ``step_size``, ``num_bits`` / ``unsigned`` / ``narrow_range`` setters,
``get_modelopt_state`` / ``set_from_modelopt_state`` with Model Optimizer's attribute names) so that users switch by
import. A quantizer holds only tensors and plain Python values: no process group, no module references, so a
quantized model deep-copies and pickles. Reductions across ranks are done by :mod:`calibration`, which takes the
group as an argument.

Amax layouts (the same shapes as Model Optimizer's): ``[]`` per tensor; the input shape with size-1 dims except the
kept ``axis`` (per channel, e.g. ``[C, 1]``); ``[num_blocks, 1]`` for static int blocks (the input, its last dim
zero-padded to a multiple of the block, viewed as ``[-1, block]``); none for dynamic quantizers (``type: dynamic``,
per-token ``block_sizes: {-1: None}``, dynamic int blocks), whose amax comes from each tensor.

Static two-level block scales (NVFP4 with ``block_sizes.type: static``): ``amax`` stays the per-tensor (second-level)
amax and the buffer ``_block_amax`` holds one amax per block of 16, ``[..., K // 16]`` (the weight's shape with its
last dim divided by 16): max calibration sets it to each block's max (the same fake quantization as dynamic block
scales), a calibration algorithm may choose others (``calib/nvfp4_blocks.py``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from ..kernels import dense_fake_quant_ste, dense_layout, use_kernels
from ..numerics import clip_limit, fake_quant, get_format
from ..numerics.format import nan_ignoring_block_max
from ..numerics.nvfp4 import within_block_amax
from .calib.max import merge_max
from .config_schema import WEIGHT_AMAX_UPDATES, QuantizerAttributeConfig
from .modelopt_compat import modelopt_quantizer_state, parse_modelopt_quantizer_state, unsupported
from .quant_mode import QuantMode, derive_mode
from .utils import warn_once

__all__ = ["TensorQuantizer", "FakeQuantSTE", "StaticBlocksSTE", "learned_block_amax_grad", "nan_ignoring_abs_max",
           "nonfinite_counts", "clip_mask"]


def nan_ignoring_abs_max(x: torch.Tensor, keep_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """``max |x|`` over every dim not in ``keep_dims`` (kept as size-1 dims when any are kept); NaN ignored."""
    a = x.detach().abs().float()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if not keep_dims:
        return a.amax() if a.numel() else torch.zeros((), device=a.device)
    keep = {d % a.dim() for d in keep_dims}
    reduce = [d for d in range(a.dim()) if d not in keep]
    return a.amax(dim=reduce, keepdim=True) if reduce else a


def nonfinite_counts(x: torch.Tensor) -> torch.Tensor:
    """``[NaN count, Inf count]`` of ``x`` as an int64 tensor on its device (no host synchronisation): what a
    calibration pass reports after it ends, since the amax ignores NaN and an Inf amax calibrates nothing."""
    x = x.detach()
    return torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()])


def clip_mask(x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor | None:
    """Where the clipped STE passes the gradient: ``|x| <= amax``. Invalid amax entries (see formats.py) clip
    nothing. None means "no clipping" (no static amax)."""
    if amax is None:
        return None
    return x.abs() <= clip_limit(amax)


class FakeQuantSTE(torch.autograd.Function):
    """Reference fake quant with a straight-through estimator (pass-through, or clipped by a mask).

    ``apply(x, amax, fmt, block_size, clipped, int_kwargs=None)``; ``int_kwargs``: ``narrow_range`` / ``unsigned``
    of int formats (``QuantizerAttributeConfig.int_kwargs``).
    """

    @staticmethod
    def forward(ctx, x, amax, fmt, block_size, clipped, int_kwargs=None):
        """Fake-quantizes ``x`` (:func:`~modelopt_moe.numerics.fake_quant`), saving the clip mask when ``clipped``."""
        mask = clip_mask(x, amax) if clipped else None
        ctx.save_for_backward(mask if mask is not None else torch.empty(0))
        ctx.has_mask = mask is not None
        return fake_quant(x, fmt, amax, block_size, **(int_kwargs or {}))

    @staticmethod
    def backward(ctx, grad):
        """The gradient of ``x``: unchanged, or zeroed where ``|x| > amax`` when ``clipped``; the amax gets none."""
        if ctx.has_mask:
            (mask,) = ctx.saved_tensors
            grad = grad * mask
        return grad, None, None, None, None, None


def learned_block_amax_grad(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor, blocks: torch.Tensor, block: int,
                            bound: float) -> torch.Tensor:
    """The gradient of learned static block amaxes (:class:`StaticBlocksSTE`'s docstring): ``grad`` of the fake
    quantized ``out`` of ``x`` with the block amaxes ``blocks`` (``[..., K // block]``), ``bound`` E2M1's max."""
    xb, qb = x.float().unflatten(-1, (-1, block)), out.float().unflatten(-1, (-1, block))
    a = blocks.float().unsqueeze(-1)
    d = torch.where(xb.abs() <= a, qb - xb, qb)
    valid = torch.isfinite(a) & (a > 0)
    g = (grad.float().unflatten(-1, (-1, block)) * d / torch.where(valid, a, torch.ones_like(a)))
    g = torch.where(valid, g, torch.zeros_like(g)).sum(-1) / math.sqrt(block * bound)
    return g.reshape(blocks.shape)


class StaticBlocksSTE(torch.autograd.Function):
    """Fake quant with static two-level block scales (:meth:`~modelopt_moe.numerics.nvfp4.NVFP4Format.quantize_static`)
    and a straight-through estimator: pass-through, or clipped (zero gradient where ``|x|`` exceeds its block's
    amax). ``apply(x, amax, block_amax, fmt, scale_max, clipped)``; the per-tensor amax gets no gradient.

    A block amax that requires a gradient (``weight_amax_update: learned``) gets the LSQ-style one of learned amaxes
    (:mod:`~modelopt_moe.quantization.weight_amax`) per block, straight through the E4M3 rounding of the block scale:
    ``d q / d a = (q - x * [|x| <= a]) / a`` summed over the block, scaled by ``1 / sqrt(16 * 6)`` (the block's
    elements times E2M1's bound); zero where ``a`` is 0 or not finite."""

    @staticmethod
    def forward(ctx, x, amax, block_amax, fmt, scale_max, clipped):
        """Fake-quantizes ``x`` with its per-tensor and per-block amaxes."""
        spec = get_format(fmt)
        b = spec.block_length
        blocks = block_amax.detach().to(x.device)
        out = spec.fake_quant_static(x, amax, blocks, scale_max)
        mask = within_block_amax(x, blocks, b) if clipped else None
        ctx.learn = ctx.needs_input_grad[2]
        saved = (x, out, blocks) if ctx.learn else ()
        ctx.save_for_backward(mask if mask is not None else torch.empty(0), *saved)
        ctx.has_mask, ctx.block, ctx.bound = mask is not None, b, spec.element_max
        return out

    @staticmethod
    def backward(ctx, grad):
        """The gradient of ``x`` (unchanged, or zeroed where clipped) and of a learned block amax."""
        mask, *saved = ctx.saved_tensors
        grad_blocks = None
        if ctx.learn:
            x, out, blocks = saved
            grad_blocks = learned_block_amax_grad(grad, x, out, blocks, ctx.block, ctx.bound)
        if ctx.has_mask:
            grad = grad * mask
        return grad, None, grad_blocks, None, None, None


class TensorQuantizer(nn.Module):
    """Fake-quantizes tensors in one format with a max-calibrated amax.

    Args:
        quant_attribute_cfg: the format, axis and blocks (a :class:`QuantizerAttributeConfig` or a dict of its
            fields); defaults to 8-bit per tensor.
        if_quant: quantize in ``forward`` (Model Optimizer's argument).
        if_calib: calibrate in ``forward``.
        amax: an initial amax (a tensor, number or nested list).

    The amax lives in the buffer ``_amax`` (in ``state_dict`` once set); its shapes are in the module docstring.
    :attr:`amax_update` says how a weight quantizer's amax follows the weights while training (``static``,
    ``dynamic``, ``learned``: :meth:`set_amax_update`); a learned amax is the parameter ``_amax`` instead of the
    buffer (same state-dict key).

    What a forward does is the quantizer's :attr:`mode`, recomputed whenever one of its inputs changes (the switches
    ``_enabled`` / ``_if_calib`` / ``_if_quant`` (Model Optimizer's names), the config, the amax being set or
    dropped, the amax update), never re-decided at a call.

    With its amax settled (static, refreshed, learned, or none needed) a tensor of a layout the experts' one-launch
    kernels take goes through them (:mod:`modelopt_moe.kernels.dense_fake_quant`) where :attr:`kernel` says so
    (``kernels.use_kernels``: ``auto`` on CUDA), with the same bits and gradients as the reference
    (:class:`FakeQuantSTE`), which runs everywhere else.
    """

    # How fake quant is computed (``config.kernel``: auto | triton | torch), set with the config as ``ste`` is; a class
    # default so that quantizers pickled before it existed read ``auto``.
    kernel = "auto"

    # Attributes the mode derives from: assigning one recomputes it (writes that bypass __setattr__, into the
    # buffer and parameter dicts, call _update_mode themselves).
    _MODE_INPUTS = frozenset({"_enabled", "_if_calib", "_if_quant", "_cfg", "_amax", "amax_update"})

    def __init__(self, quant_attribute_cfg: QuantizerAttributeConfig | dict | None = None, if_quant: bool = True,
                 if_calib: bool = False, amax: Any = None):
        super().__init__()
        self.register_buffer("_amax", None)
        self.register_buffer("_block_amax", None)
        self._if_calib = bool(if_calib)
        self._if_quant = bool(if_quant)
        self._calib_seen = False
        # Set by a calibrator that collects its own statistics of the activations (calib/histogram.py): while
        # set, calibration hands each tensor to it instead of merging its max.
        self.calib_observer = None
        self._calib_nonfinite: torch.Tensor | None = None  # [NaN, Inf] counts of this calibration pass
        self.ste = "pass_through"
        self.amax_update = "static"
        cfg = quant_attribute_cfg if quant_attribute_cfg is not None else QuantizerAttributeConfig()
        self.set_from_attribute_config(QuantizerAttributeConfig(**cfg) if isinstance(cfg, dict) else cfg)
        self._update_mode()
        if amax is not None:
            self.amax = amax

    # --- the mode ------------------------------------------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in self._MODE_INPUTS and "_mode" in self.__dict__:
            self._update_mode()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._update_mode()  # a quantizer pickled by an older version has no mode yet

    def _update_mode(self) -> None:
        self.__dict__["_mode"] = derive_mode(
            enabled=self._enabled, if_calib=self._if_calib, if_quant=self._if_quant, dynamic=self._cfg.is_dynamic,
            needs_amax=self.needs_amax, has_amax=self._amax is not None, amax_update=self.amax_update,
            learns_amax=self.learns_amax)

    @property
    def mode(self) -> QuantMode:
        """What a forward call does (see :class:`~.quant_mode.QuantMode`)."""
        return self._mode

    @property
    def is_calibrating(self) -> bool:
        """Whether a forward call collects the amax (enabled, with calibration on)."""
        return self._mode is QuantMode.CALIBRATING

    @property
    def clips(self) -> bool:
        """Whether the straight-through gradient is clipped (zero where ``|x| > amax``): a quantizing quantizer with
        ``ste: clipped`` and an amax to clip at."""
        return self.is_quantizing and self.ste == "clipped" and self.needs_amax and self._amax is not None

    @property
    def refreshes_amax(self) -> bool:
        """Whether the amax follows the current weights (``weight_amax_update: dynamic`` on an enabled quantizer
        with an amax of its own), whatever the switches say now: what :func:`~.weight_amax.update_weight_amax`
        recomputes."""
        return self._enabled and self.amax_update == "dynamic" and self.needs_amax and not self._cfg.is_dynamic

    def switches(self) -> dict[str, bool]:
        """Model Optimizer's three switches: ``{"enabled", "if_quant", "if_calib"}``."""
        return {"enabled": self._enabled, "if_quant": self._if_quant, "if_calib": self._if_calib}

    def set_switches(self, *, enabled: bool | None = None, if_quant: bool | None = None,
                     if_calib: bool | None = None) -> None:
        """Sets the given switches (the others kept), e.g. from a saved state."""
        if enabled is not None:
            self._enabled = bool(enabled)
        if if_quant is not None:
            self._if_quant = bool(if_quant)
        if if_calib is not None:
            self._if_calib = bool(if_calib)

    def calibration_snapshot(self) -> tuple:
        """What a calibration pass changes (the amax tensor, the switches, its progress), for
        :meth:`restore_calibration_snapshot` after a pass that failed."""
        blocks = self.block_amax  # a learned one is trained in place: keep its values
        blocks = (blocks, blocks.detach().clone()) if isinstance(blocks, nn.Parameter) else (blocks, None)
        return ((self._amax, blocks), self.switches(), self._calib_seen, self.__dict__.get("_calib_nonfinite"))

    def restore_calibration_snapshot(self, snapshot: tuple) -> None:
        """Puts back what :meth:`calibration_snapshot` took (the amax tensor, the switches, the pass's progress)."""
        (amax, (block_amax, values)), switches, seen, nonfinite = snapshot
        self._amax = amax
        if values is not None:
            with torch.no_grad():
                block_amax.copy_(values)
            self._parameters["_block_amax"] = block_amax
        else:
            self._buffers["_block_amax"] = block_amax
        self.set_switches(**switches)
        self._calib_seen = seen
        self._calib_nonfinite = nonfinite

    @property
    def calib_nonfinite(self) -> tuple[int, int]:
        """``(NaN, Inf)``: how many non-finite values the current calibration pass saw (the amax ignores NaN; an Inf
        makes the amax infinite). Reading it synchronises with the device."""
        counts = self.__dict__.get("_calib_nonfinite")  # absent in quantizers pickled by older versions
        if counts is None:
            return 0, 0
        nan, inf = counts.tolist()
        return nan, inf

    def _count_nonfinite(self, x: torch.Tensor, fresh: bool) -> None:
        counts = nonfinite_counts(x)
        old = self.__dict__.get("_calib_nonfinite")
        self._calib_nonfinite = counts if fresh or old is None else old + counts.to(old.device)

    # --- configuration -------------------------------------------------------------------------------------------
    def set_from_attribute_config(self, cfg: QuantizerAttributeConfig | dict) -> None:
        """Applies a :class:`QuantizerAttributeConfig` (every attribute), or a dict of some of its fields (those
        only, the others kept: Model Optimizer's partial update). The merged attributes are validated.

        Raises:
            ValueError: the resulting attributes are invalid (naming the field and value).
        """
        if isinstance(cfg, dict):
            current = self._cfg.model_dump(exclude_unset=True) if "_cfg" in self.__dict__ else {}
            if cfg.get("block_sizes") is not None:
                current.pop("axis", None)  # Model Optimizer: setting block_sizes clears axis
            cfg = QuantizerAttributeConfig(**{**current, **cfg})
        self._cfg = cfg
        self._enabled = cfg.enable

    def _update_cfg(self, **fields) -> None:
        self._cfg = QuantizerAttributeConfig(**{**self._cfg.model_dump(exclude_unset=True), **fields})

    @property
    def cfg(self) -> QuantizerAttributeConfig:
        """The quantizer's attributes (a validated :class:`QuantizerAttributeConfig`)."""
        return self._cfg

    @property
    def fmt(self) -> str:
        """Format name (``e4m3``, ``nvfp4``, ...)."""
        return self._cfg.format

    @property
    def num_bits(self):
        """Model Optimizer's ``num_bits``: an int, an ``(exponent, mantissa)`` pair or a format name; settable."""
        return self._cfg.num_bits

    @num_bits.setter
    def num_bits(self, value) -> None:
        self._update_cfg(num_bits=value)

    @property
    def unsigned(self) -> bool:
        """Int formats: levels ``[0, 2**b - 1]`` instead of signed ones; settable."""
        return self._cfg.unsigned

    @unsigned.setter
    def unsigned(self, value: bool) -> None:
        self._update_cfg(unsigned=bool(value))

    @property
    def narrow_range(self) -> bool:
        """Int formats: levels ``[-B, B]`` (True) or ``[-B-1, B]`` (False)."""
        return self._cfg.narrow_range

    @narrow_range.setter
    def narrow_range(self, value: bool) -> None:
        self._update_cfg(narrow_range=bool(value))

    @property
    def axis(self) -> int | tuple[int, ...] | None:
        """The axis kept by the amax (None: per tensor; 0: per output channel of a weight); settable."""
        return self._cfg.axis

    @axis.setter
    def axis(self, value) -> None:
        self._update_cfg(axis=value)

    @property
    def block_sizes(self) -> dict | None:
        """Model Optimizer's ``block_sizes`` dict, or None; setting it clears ``axis``, as Model Optimizer does."""
        return self._cfg.block_sizes

    @block_sizes.setter
    def block_sizes(self, value) -> None:
        self.set_from_attribute_config({"block_sizes": value})

    @property
    def block_size(self) -> int | None:
        """Dynamic int block size (the kernels' ``block_size``); None otherwise."""
        return self._cfg.block_size

    @property
    def static_block_size(self) -> int | None:
        """Static int block size (calibrated ``[num_blocks, 1]`` amax); None otherwise."""
        return self._cfg.static_block_size

    @property
    def static_block_scales(self) -> bool:
        """Two-level block scales (NVFP4) with a calibrated amax per block (:attr:`block_amax`)."""
        return self._cfg.static_block_scales

    @property
    def block_amax(self) -> torch.Tensor | None:
        """Static block scales: the ``[..., K // 16]`` amax of every block (None before calibration, or without
        static block scales); setting it copies in place where the shape fits."""
        learned = self._parameters.get("_block_amax")
        return learned if learned is not None else self._buffers.get("_block_amax")

    @block_amax.setter
    def block_amax(self, value) -> None:
        old = self.block_amax
        if value is None:
            self._buffers["_block_amax"] = None
            return
        value = torch.as_tensor(value, dtype=torch.float32)
        if old is not None and old.shape == value.shape:
            with torch.no_grad():
                old.copy_(value.to(old.device))  # in place: bumps the version caches watch; an optimizer keeps it
        else:
            device = old.device if old is not None else value.device
            self._put_block_amax(value.detach().clone().to(device))

    @property
    def learns_block_amax(self) -> bool:
        """Whether the block amaxes are a trained parameter (static block scales, ``weight_amax_update: learned``)."""
        return self._parameters.get("_block_amax") is not None

    def _put_block_amax(self, value: torch.Tensor) -> None:
        """Stores new block amaxes: the buffer, or the learned parameter (Megatron's attributes kept)."""
        old = self._parameters.get("_block_amax")
        if old is None:
            self._buffers["_block_amax"] = value
            return
        new = nn.Parameter(value.float(), requires_grad=True)
        new.__dict__.update(old.__dict__)
        self._parameters["_block_amax"] = new

    def block_amax_of(self, x: torch.Tensor) -> torch.Tensor:
        """Static block scales: the max of ``|x|`` over each block of the last dim, ``[..., K // 16]`` (NaN
        ignored)."""
        return nan_ignoring_block_max(x.detach().float(), get_format(self.fmt).block_length).squeeze(-1)

    @property
    def is_dynamic(self) -> bool:
        """The amax comes from each tensor (``type: dynamic`` or per token): nothing to calibrate or store."""
        return self._cfg.is_dynamic

    @property
    def maxbound(self) -> float:
        """The largest quantized magnitude: the format's largest element (448 for e4m3, 57344 for e5m2, 6 for NVFP4's
        E2M1), ``2**(b-1+unsigned)-1`` for int formats."""
        spec = get_format(self.fmt)
        if spec.integer:
            return float(2 ** (spec.num_bits - 1 + int(self.unsigned)) - 1)
        return spec.element_max

    @property
    def step_size(self) -> torch.Tensor | None:
        """Int formats: ``amax / (2**(b-1+unsigned) - 1)``, the value of one integer step (None without an amax).

        Raises:
            ValueError: a floating-point format (no uniform step).
        """
        if not get_format(self.fmt).integer:
            raise ValueError(f"step_size is defined for integer formats only, this quantizer is {self.fmt}")
        if self._amax is None:
            warnings.warn("step_size is undefined without an amax (dynamic or uncalibrated quantizer)", stacklevel=2)
            return None
        return self._amax / self.maxbound

    @property
    def is_enabled(self) -> bool:
        """Whether the quantizer is on (a disabled one neither calibrates nor quantizes)."""
        return self._enabled

    @property
    def is_quantizing(self) -> bool:
        """Whether a forward call changes its input (enabled, with quantization on)."""
        return self._enabled and self._if_quant

    @property
    def per_token(self) -> bool:
        """One amax per token, from the data (``block_sizes: {-1: None}``, Model Optimizer's per-token spelling)."""
        return self._cfg.per_token

    @property
    def needs_amax(self) -> bool:
        """Whether ``formats.fake_quant`` takes an amax: False where the format takes every scale from the data
        (int formats with dynamic block scales)."""
        return get_format(self.fmt).needs_amax(self.block_size)

    @property
    def int_kwargs(self) -> dict:
        """``narrow_range`` / ``unsigned`` for ``formats.fake_quant`` (empty for float formats)."""
        return self._cfg.int_kwargs

    def enable(self):
        """Turns the quantizer on."""
        self._enabled = True

    def disable(self):
        """Turns the quantizer off: forward returns its input."""
        self._enabled = False

    def enable_calib(self):
        """Starts a calibration pass: forward collects the amax, the first tensor replacing any earlier one."""
        self._if_calib = True
        self._calib_seen = False  # a new calibration pass: its first tensor replaces the amax

    def disable_calib(self):
        """Ends calibration: forward collects no more amax."""
        self._if_calib = False

    def enable_quant(self):
        """Turns fake quantization on in forward."""
        self._if_quant = True

    def disable_quant(self):
        """Turns fake quantization off in forward (calibration, when on, still collects)."""
        self._if_quant = False

    # --- amax ----------------------------------------------------------------------------------------------------
    @property
    def amax(self) -> torch.Tensor | None:
        """The calibrated (or learned) amax tensor, or None; setting it copies in place where the shape fits."""
        return self._amax

    @amax.setter
    def amax(self, value) -> None:
        value = torch.as_tensor(value, dtype=torch.float32)
        if self._amax is not None and self._amax.shape == value.shape:
            with torch.no_grad():
                self._amax.copy_(value.to(self._amax.device))  # in place: bumps the version caches watch
        else:
            device = self._amax.device if self._amax is not None else value.device
            self._put_amax(value.detach().clone().to(device))

    def _put_amax(self, value: torch.Tensor) -> None:
        """Stores ``value`` as the amax tensor: the buffer, or the learned amax's parameter (written in place when
        the shape fits, so an optimizer holding it keeps training the same tensor)."""
        if "_amax" not in self._parameters:
            self._buffers["_amax"] = value
        else:
            old = self._parameters["_amax"]
            if old is not None and old.shape == value.shape:
                with torch.no_grad():
                    old.copy_(value.to(old.device))
                return
            new = nn.Parameter(value.float(), requires_grad=True)
            if old is not None:
                new.__dict__.update(old.__dict__)  # Megatron's parameter attributes (e.g. ``allreduce``)
            self._parameters["_amax"] = new
        self._update_mode()

    @property
    def learns_amax(self) -> bool:
        """Whether the amax is a trained parameter (``weight_amax_update: learned``)."""
        return self._parameters.get("_amax") is not None

    def set_amax_update(self, mode: str, block_shape: tuple[int, ...] | None = None,
                        device: torch.device | None = None) -> None:
        """How the amax follows the tensor while training: ``static`` (calibrated once), ``dynamic`` (recomputed from
        the current weights at every re-quantization) or ``learned`` (the amax becomes the parameter ``_amax``,
        trained with an LSQ-style gradient; per-tensor amax only). Set by ``mtq.quantize`` for weight quantizers.

        With static block scales, ``learned`` trains the block amaxes (the parameter ``_block_amax``, of shape
        ``block_shape`` until calibrated) and keeps the per-tensor amax static, as Model Optimizer's LSQ does. A
        learned amax made before calibration is made on ``device`` (the quantized module's): calibration then fills
        it in place there, and training finds it beside the data.

        Raises:
            ValueError: an unknown mode, or ``learned`` for a per-channel amax.
        """
        if mode not in WEIGHT_AMAX_UPDATES:
            raise ValueError(f"{type(self).__name__}: amax update {mode!r}; expected one of {WEIGHT_AMAX_UPDATES}")
        learn = mode == "learned" and self._enabled and self.needs_amax
        self._set_block_learning(learn and self.static_block_scales, block_shape, device)
        learn = learn and not self.static_block_scales
        if learn and self.axis is not None:
            raise ValueError(f"{type(self).__name__}: a learned amax (weight_amax_update / input_amax_update) is per "
                             f"tensor (per expert); this quantizer has a per-channel amax (axis={self.axis})")
        if learn and self.static_block_size is not None:
            raise ValueError(f"{type(self).__name__}: a learned amax (weight_amax_update / input_amax_update) is per "
                             f"tensor (per expert); this quantizer has static blocks of {self.static_block_size}")
        if learn and not self.learns_amax:
            shape = self.amax_shape
            value = self._amax.detach().float() if self._amax is not None else torch.zeros(shape, device=device)
            self._buffers.pop("_amax", None)
            self._parameters["_amax"] = nn.Parameter(value.clone(), requires_grad=True)
        elif not learn and "_amax" in self._parameters:
            value = self._parameters.pop("_amax")
            self._buffers["_amax"] = None if value is None else value.detach().clone()
        self.amax_update = mode

    def _set_block_learning(self, learn: bool, block_shape: tuple[int, ...] | None,
                            device: torch.device | None = None) -> None:
        if learn and not self.learns_block_amax:
            value = self.block_amax
            if value is None and block_shape is None:
                raise ValueError(f"{type(self).__name__}: learned static block scales need the block amaxes' shape "
                                 "(calibrate first, or give block_shape)")
            value = value.detach().float().clone() if value is not None else torch.zeros(block_shape, device=device)
            self._buffers.pop("_block_amax", None)
            self._parameters["_block_amax"] = nn.Parameter(value, requires_grad=True)
        elif not learn and self.learns_block_amax:
            value = self._parameters.pop("_block_amax")
            self._buffers["_block_amax"] = value.detach().clone()

    @property
    def amax_shape(self) -> tuple[int, ...] | None:
        """The amax's shape: ``()`` per tensor; per channel only once calibrated (None before)."""
        if self._amax is not None:
            return tuple(self._amax.shape)
        return () if self.axis is None else None

    def reset_amax(self) -> None:
        """Forgets the amax before a new calibration; a learned amax is zeroed in place (an optimizer may hold it)."""
        self._calib_nonfinite = None
        if self.learns_block_amax:  # keep the parameter (an optimizer may hold it); calibration fills it in place
            with torch.no_grad():
                self._parameters["_block_amax"].zero_()
        else:
            self._buffers["_block_amax"] = None
        if self.learns_amax:  # keep the parameter object (an optimizer may hold it); max calibration starts at 0
            with torch.no_grad():
                self._amax.zero_()
            return
        self._amax = None
        self._calib_seen = False

    def _blocks_view(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with its last dim zero-padded to a multiple of the static block, as ``[-1, block]``."""
        bs = self.static_block_size
        pad = -x.shape[-1] % bs
        xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
        return xp.reshape(-1, bs)

    def _kept_dims(self, x: torch.Tensor) -> tuple[int, ...]:
        if self._cfg.per_token:
            return tuple(range(x.dim() - 1))
        if self.axis is None:
            return ()
        return tuple(self.axis) if isinstance(self.axis, tuple) else (self.axis,)

    def amax_of(self, x: torch.Tensor) -> torch.Tensor:
        """The amax this quantizer's layout takes of ``x`` (NaN ignored), without storing it: scalar, per kept
        axis / token (size-1 dims elsewhere), or ``[num_blocks, 1]`` for static int blocks."""
        if self.static_block_size is not None:
            return nan_ignoring_abs_max(self._blocks_view(x), (0,))
        return nan_ignoring_abs_max(x, self._kept_dims(x))

    def collect(self, x: torch.Tensor) -> None:
        """Max calibration: ``amax = max(amax, amax_of(x))``; the first tensor of a calibration pass (after
        :meth:`enable_calib` or :meth:`reset_amax`) replaces any earlier amax. Dynamic quantizers collect nothing."""
        if self.is_dynamic:
            return
        if self.calib_observer is not None:
            self.calib_observer(x, None)
            return
        new = self.amax_of(x)
        fresh = self._amax is None or not self._calib_seen
        if self.static_block_scales:
            self._collect_blocks(x, fresh)
        self._count_nonfinite(x, fresh)
        self.amax = new if fresh else merge_max(self._amax, new.to(self._amax.device))
        self._calib_seen = True

    def _collect_blocks(self, x: torch.Tensor, fresh: bool) -> None:
        blocks = self.block_amax_of(x)
        old = self.block_amax
        if not fresh and old is not None and old.shape != blocks.shape:
            raise ValueError(f"TensorQuantizer({self.fmt}, static block scales): a tensor of shape {tuple(x.shape)} "
                             f"after one with {tuple(old.shape)} blocks; static block scales need one tensor shape "
                             "(a weight's): use block_sizes.type: dynamic for activations")
        self.block_amax = blocks if fresh or old is None else merge_max(old, blocks.to(old.device))

    def load_calib_amax(self, *args, strict: bool = True, **kwargs) -> None:
        """Model Optimizer's step after calibration. Max calibration writes the amax as it collects, so this only
        checks that the pass saw a tensor (extra arguments are those of Model Optimizer's per-quantizer histogram
        calibrator; here histogram calibration is the model's ``algorithm: {"method": "histogram", ...}``).

        Raises:
            RuntimeError: nothing was collected and ``strict`` (``strict=False`` warns and sets the amax to NaN).
            ValueError: a dynamic quantizer, or arguments for another calibrator.
        """
        if self.is_dynamic:
            raise ValueError("load_calib_amax: a dynamic quantizer (type: dynamic or per token) has no calibrated "
                             "amax")
        if args or kwargs:
            raise ValueError(unsupported("load_calib_amax arguments", (args, kwargs), "max calibration takes none"))
        if self._calib_seen and self._amax is not None:
            return
        message = ("load_calib_amax: the calibrator has not seen any tensor (enable_calib(), then run data through "
                   "the quantizer)")
        if strict:
            raise RuntimeError(message + "; pass strict=False to set a NaN amax instead")
        warnings.warn(message + "; setting the amax to NaN", stacklevel=2)
        self.amax = torch.tensor(float("nan"))

    # --- forward -------------------------------------------------------------------------------------------------
    def fake_quant(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Fake-quantizes ``x`` with this quantizer's amax (or ``amax``), STE per :attr:`ste`."""
        if amax is None and self.is_dynamic and self.needs_amax:  # (an amax no scale reads is not taken)
            amax = self.amax_of(x).detach()
        amax = self._amax if amax is None else amax
        if amax is None and self.needs_amax:
            warn_once(f"TensorQuantizer({self.fmt}): quantizing with no calibrated amax; using the amax of the "
                      "current tensor (run mtq.calibrate / a forward_loop to calibrate)")
            amax = self.amax_of(x)
        if amax is not None:
            amax = amax.to(x.device)
        clipped = self.ste == "clipped"
        if self.static_block_scales and self.block_amax is not None:
            return StaticBlocksSTE.apply(x, amax, self.block_amax, self.fmt, self._cfg.block_scale_max, clipped)
        if self.static_block_size is not None:
            view = self._blocks_view(x)
            if amax.shape != (view.shape[0], 1):
                raise ValueError(f"TensorQuantizer(int{get_format(self.fmt).num_bits}, static blocks of "
                                 f"{self.static_block_size}): amax of shape {tuple(amax.shape)} does not fit input "
                                 f"{tuple(x.shape)} ({view.shape[0]} blocks); static block quantization needs the "
                                 "input shape it was calibrated on")
            out = FakeQuantSTE.apply(view, amax, self.fmt, None, clipped, self.int_kwargs)
            padded = (*x.shape[:-1], x.shape[-1] + (-x.shape[-1] % self.static_block_size))
            return out.reshape(padded)[..., : x.shape[-1]]
        return self._fake_quant_ste(x, amax if self.needs_amax else None, clipped)

    def _fake_quant_ste(self, x: torch.Tensor, amax: torch.Tensor | None, clipped: bool) -> torch.Tensor:
        """The one choice between the experts' kernels and the reference for a dense tensor: the kernels where the
        experts take them (a settled amax, ``kernels.use_kernels`` for :attr:`kernel` and the device) and the layout
        is one of theirs (:func:`~modelopt_moe.kernels.dense_layout`; signed int ranges only, as for experts). A
        format that reads no amax (every scale from the data: FP8 1x128 groups, MX, int blocks) has nothing to
        settle, so a ``type: dynamic`` one takes the kernels too."""
        kw = self.int_kwargs
        settled = self._mode.settled or amax is None  # no amax read: every scale from the data (1x128, MX, ...)
        if (settled and not kw.get("unsigned", False) and use_kernels(self.kernel, x.device)
                and dense_layout(x, amax, self.fmt, self.block_size) is not None):
            return dense_fake_quant_ste(x, amax, self.fmt, self.block_size, self.ste, kw.get("narrow_range", True))
        return FakeQuantSTE.apply(x, amax, self.fmt, self.block_size, clipped, kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Calibrates on (while calibrating) and fake-quantizes (while quantizing) ``x``; identity when off."""
        mode = self._mode
        if mode is QuantMode.OFF:
            return x
        if mode is QuantMode.CALIBRATING:
            self.collect(x)
            if not self._if_quant:
                return x
        return self.fake_quant(x)

    # --- Model Optimizer's quantizer state --------------------------------------------------------------------------
    def get_modelopt_state(self, properties_only: bool = False) -> dict[str, Any]:
        """This quantizer's settings under Model Optimizer's attribute names (``_num_bits``, ``_axis``,
        ``_block_sizes``, ``_narrow_range``, ``_disabled``, ...), plus ``_pytorch_state_metadata`` (the amax buffer's
        shape) unless ``properties_only``. Plain data; :meth:`set_from_modelopt_state` reads it back, and reads the
        states Model Optimizer 0.47 writes."""
        return modelopt_quantizer_state(self, properties_only)

    def set_from_modelopt_state(self, modelopt_state: dict[str, Any], properties_only: bool = False) -> None:
        """Applies a quantizer state written by :meth:`get_modelopt_state` or by Model Optimizer 0.47: the format,
        axis, blocks, range, enablement, calibration/quantization switches and STE; unless ``properties_only``, an
        empty amax of the saved shape (to be filled by ``load_state_dict``), or none.

        Raises:
            ValueError: a Model Optimizer feature this package does not have (naming the attribute and value).
        """
        cfg, flags, amax_shape = parse_modelopt_quantizer_state(modelopt_state)
        self.set_from_attribute_config(cfg)
        self.set_switches(**flags)
        self.ste = "pass_through" if cfg.pass_through_bwd else "clipped"
        if not properties_only:
            if amax_shape is None:
                self._amax = None
            elif self._amax is None or tuple(self._amax.shape) != amax_shape:
                device = self._amax.device if self._amax is not None else torch.device("cpu")
                self._amax = torch.empty(amax_shape, dtype=torch.float32, device=device)

    # --- state ---------------------------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Moves the amax with the module but keeps it fp32: ``model.bfloat16()`` (Megatron's ``Float16Module``
        does it) would otherwise round every calibrated amax to bf16."""
        amax = self._amax.data if self._amax is not None else None  # .data: a parameter is converted in place
        block_amax = self.block_amax.data if self.block_amax is not None else None
        super()._apply(fn, recurse)
        new_blocks = self.block_amax
        if block_amax is not None and new_blocks is not None and new_blocks.dtype != torch.float32:
            kept = new_blocks.float() if block_amax.is_meta else block_amax.to(new_blocks.device)
            if self.learns_block_amax:
                new_blocks.data = kept
            else:
                self._buffers["_block_amax"] = kept
        if amax is not None and self._amax is not None and self._amax.dtype != torch.float32:
            kept = self._amax.float() if amax.is_meta else amax.to(self._amax.device)
            if self.learns_amax:
                self._amax.data = kept
            else:
                self._buffers["_amax"] = kept
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        blocks = state_dict.get(prefix + "_block_amax")
        if blocks is not None and (self.block_amax is None or self.block_amax.shape != blocks.shape):
            device = self.block_amax.device if self.block_amax is not None else blocks.device
            self._put_block_amax(torch.empty(blocks.shape, dtype=torch.float32, device=device))
        key = prefix + "_amax"
        if key in state_dict:
            value = state_dict[key]
            if self._amax is None or self._amax.shape != value.shape:
                device = self._amax.device if self._amax is not None else value.device
                self._put_amax(torch.empty(value.shape, dtype=torch.float32, device=device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _amax_repr(self) -> str:
        if self._amax is None:
            return "amax=None"
        if self._amax.is_meta:  # restored into a model on the meta device: values come when it is materialised
            return f"amax[{tuple(self._amax.shape)}] on meta"
        if self._amax.numel() == 1:
            return f"amax={self._amax.item():.4g}"
        return f"amax[{tuple(self._amax.shape)}] max={self._amax.max().item():.4g}"

    def _repr_head(self) -> list[str]:
        return []

    def extra_repr(self) -> str:
        """The format and its settings, the amax (or ``dynamic``) and the switches that are not the default."""
        return self._describe(self._repr_head(), self._amax_repr())

    def _describe(self, head: list[str], amax_text: str) -> str:
        if not self._enabled:
            return ", ".join([*head, "disabled"])
        parts = [*head, self.fmt]
        if self.axis is not None:
            parts.append(f"axis={self.axis}")
        if self.block_size is not None:
            parts.append(f"block={self.block_size}")
        if self.static_block_size is not None:
            parts.append(f"static block={self.static_block_size}")
        if self.static_block_scales:
            parts.append("static block scales" + (" (4-over-6)" if (self.block_sizes or {}).get("four_over_six")
                                                  else ""))
        spec = get_format(self.fmt)
        if not self.needs_amax and self.block_size is None:  # a fixed block whose every scale comes from the data: MX
            parts.append(f"{spec.block_scale.upper()} scales per {spec.block_length} from the data")
        if self._cfg.per_token:
            parts.append("per token")
        if get_format(self.fmt).integer and (self.narrow_range or self.unsigned):
            parts.append("unsigned" if self.unsigned else "narrow")
        parts.append("dynamic" if self.is_dynamic else amax_text)
        if self._if_calib:
            parts.append("calibrating")
        if not self._if_quant:
            parts.append("quant off")
        return ", ".join(parts)
