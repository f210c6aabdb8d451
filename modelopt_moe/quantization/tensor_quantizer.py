"""TensorQuantizer: one fake quantizer with a calibrated amax (scalar, per channel or per block).

The quantizer of N experts is :class:`~.expert_quantizer.ExpertQuantizer`, a subclass with an ``[N, ...]`` amax.

Names mirror NVIDIA Model Optimizer (``TensorQuantizer``, ``amax``, ``enable_calib``, ...) so that users switch by
import. A quantizer holds only tensors and plain Python values: no process group, no module references, so a
quantized model deep-copies and pickles. Reductions across ranks are done by :mod:`calibration`, which takes the
group as an argument.
"""

from __future__ import annotations

import torch
from torch import nn

from ..numerics import clip_limit, fake_quant, get_format
from .config import QuantizerAttributeConfig
from .utils import warn_once

__all__ = ["TensorQuantizer", "FakeQuantSTE", "nan_ignoring_abs_max", "clip_mask"]


def nan_ignoring_abs_max(x: torch.Tensor, keep_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """``max |x|`` over every dim not in ``keep_dims`` (kept as size-1 dims when any are kept); NaN ignored."""
    a = x.detach().abs().float()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if not keep_dims:
        return a.amax() if a.numel() else torch.zeros((), device=a.device)
    keep = {d % a.dim() for d in keep_dims}
    reduce = [d for d in range(a.dim()) if d not in keep]
    return a.amax(dim=reduce, keepdim=True) if reduce else a


def clip_mask(x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor | None:
    """Where the clipped STE passes the gradient: ``|x| <= amax``. Invalid amax entries (see formats.py) clip
    nothing. None means "no clipping" (no static amax)."""
    if amax is None:
        return None
    return x.abs() <= clip_limit(amax)


class FakeQuantSTE(torch.autograd.Function):
    """Reference fake quant with a straight-through estimator (pass-through, or clipped by a mask)."""

    @staticmethod
    def forward(ctx, x, amax, fmt, block_size, clipped):
        mask = clip_mask(x, amax) if clipped else None
        ctx.save_for_backward(mask if mask is not None else torch.empty(0))
        ctx.has_mask = mask is not None
        return fake_quant(x, fmt, amax, block_size)

    @staticmethod
    def backward(ctx, grad):
        if ctx.has_mask:
            (mask,) = ctx.saved_tensors
            grad = grad * mask
        return grad, None, None, None, None


class TensorQuantizer(nn.Module):
    """Fake-quantizes tensors in one format with a max-calibrated amax.

    Args:
        quant_attribute_cfg: the format, axis and blocks; defaults to 8-bit per tensor.
        amax: an initial amax (optional).

    The amax lives in the buffer ``_amax`` (in ``state_dict`` once set). Its shape is ``[]`` per tensor, the input
    shape with size-1 dims except ``axis`` per channel. :attr:`amax_update` says how a weight quantizer's amax follows
    the weights while training (``static``, ``dynamic``, ``learned``: :meth:`set_amax_update`); a learned amax is
    the parameter ``_amax`` instead of the buffer (same state-dict key).
    """

    def __init__(self, quant_attribute_cfg: QuantizerAttributeConfig | None = None, amax: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("_amax", None)
        self._if_calib = False
        self._if_quant = True
        self.ste = "pass_through"
        self.amax_update = "static"
        self.set_from_attribute_config(quant_attribute_cfg or QuantizerAttributeConfig())
        if amax is not None:
            self.amax = amax

    # --- configuration -------------------------------------------------------------------------------------------
    def set_from_attribute_config(self, cfg: QuantizerAttributeConfig | dict) -> None:
        """Applies a :class:`QuantizerAttributeConfig` (or a dict of its fields)."""
        if isinstance(cfg, dict):
            cfg = QuantizerAttributeConfig(**cfg)
        self._cfg = cfg
        self._enabled = cfg.enable

    @property
    def cfg(self) -> QuantizerAttributeConfig:
        return self._cfg

    @property
    def fmt(self) -> str:
        """Format name (``e4m3``, ``nvfp4``, ...)."""
        return self._cfg.format

    @property
    def num_bits(self):
        return self._cfg.num_bits

    @property
    def axis(self) -> int | None:
        return self._cfg.axis

    @property
    def block_size(self) -> int | None:
        return self._cfg.block_size

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_quantizing(self) -> bool:
        """Whether a forward call changes its input (enabled, with quantization on)."""
        return self._enabled and self._if_quant

    @property
    def needs_amax(self) -> bool:
        """False for int formats with dynamic block scales (their amax is only informative)."""
        return not (get_format(self.fmt).kind == "int" and self.block_size is not None)

    def enable(self):
        self._enabled = True

    def disable(self):
        self._enabled = False

    def enable_calib(self):
        self._if_calib = True

    def disable_calib(self):
        self._if_calib = False

    def enable_quant(self):
        self._if_quant = True

    def disable_quant(self):
        self._if_quant = False

    # --- amax ----------------------------------------------------------------------------------------------------
    @property
    def amax(self) -> torch.Tensor | None:
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
            return
        old = self._parameters["_amax"]
        if old is not None and old.shape == value.shape:
            with torch.no_grad():
                old.copy_(value.to(old.device))
            return
        new = nn.Parameter(value.float(), requires_grad=True)
        if old is not None:
            new.__dict__.update(old.__dict__)  # Megatron's parameter attributes (e.g. ``allreduce``)
        self._parameters["_amax"] = new

    @property
    def learns_amax(self) -> bool:
        """Whether the amax is a trained parameter (``weight_amax_update: learned``)."""
        return self._parameters.get("_amax") is not None

    def set_amax_update(self, mode: str) -> None:
        """How the amax follows the tensor while training: ``static`` (calibrated once), ``dynamic`` (recomputed from
        the current weights at every re-quantization) or ``learned`` (the amax becomes the parameter ``_amax``,
        trained with an LSQ-style gradient; per-tensor amax only). Set by ``mtq.quantize`` for weight quantizers.

        Raises:
            ValueError: an unknown mode, or ``learned`` for a per-channel amax.
        """
        from .config import WEIGHT_AMAX_UPDATES

        if mode not in WEIGHT_AMAX_UPDATES:
            raise ValueError(f"{type(self).__name__}: amax update {mode!r}; expected one of {WEIGHT_AMAX_UPDATES}")
        learn = mode == "learned" and self._enabled and self.needs_amax
        if learn and self.axis is not None:
            raise ValueError(f"{type(self).__name__}: weight_amax_update=learned trains a per-tensor (per-expert) "
                             f"amax; this quantizer has a per-channel amax (axis={self.axis})")
        if learn and not self.learns_amax:
            shape = self.amax_shape
            value = self._amax.detach().float() if self._amax is not None else torch.zeros(shape)
            self._buffers.pop("_amax", None)
            self._parameters["_amax"] = nn.Parameter(value.clone(), requires_grad=True)
        elif not learn and "_amax" in self._parameters:
            value = self._parameters.pop("_amax")
            self._buffers["_amax"] = None if value is None else value.detach().clone()
        self.amax_update = mode

    @property
    def amax_shape(self) -> tuple[int, ...] | None:
        """The amax's shape: ``()`` per tensor; per channel only once calibrated (None before)."""
        if self._amax is not None:
            return tuple(self._amax.shape)
        return () if self.axis is None else None

    def reset_amax(self) -> None:
        if self.learns_amax:  # keep the parameter object (an optimizer may hold it); max calibration starts at 0
            with torch.no_grad():
                self._amax.zero_()
            return
        self._amax = None

    def amax_of(self, x: torch.Tensor) -> torch.Tensor:
        """The amax this quantizer's layout takes of ``x`` (NaN ignored), without storing it."""
        return nan_ignoring_abs_max(x, () if self.axis is None else (self.axis,))

    def collect(self, x: torch.Tensor) -> None:
        """Max calibration: ``amax = max(amax, amax_of(x))``."""
        new = self.amax_of(x)
        self.amax = new if self._amax is None else torch.maximum(self._amax, new.to(self._amax.device))

    # --- forward -------------------------------------------------------------------------------------------------
    def fake_quant(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Fake-quantizes ``x`` with this quantizer's amax (or ``amax``), STE per :attr:`ste`."""
        amax = self._amax if amax is None else amax
        if amax is None and self.needs_amax:
            warn_once(f"TensorQuantizer({self.fmt}): quantizing with no calibrated amax; using the amax of the "
                      "current tensor (run mtq.calibrate / a forward_loop to calibrate)")
            amax = self.amax_of(x)
        if amax is not None:
            amax = amax.to(x.device)
        block = self.block_size
        return FakeQuantSTE.apply(x, amax if self.needs_amax else None, self.fmt, block, self.ste == "clipped")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Calibrates on (while calibrating) and fake-quantizes (while quantizing) ``x``; identity when disabled."""
        if not self._enabled:
            return x
        if self._if_calib:
            self.collect(x)
        if not self._if_quant:
            return x
        return self.fake_quant(x)

    # --- state ---------------------------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Moves the amax with the module but keeps it fp32: ``model.bfloat16()`` (Megatron's ``Float16Module``
        does it) would otherwise round every calibrated amax to bf16."""
        amax = self._amax.data if self._amax is not None else None  # .data: a parameter is converted in place
        super()._apply(fn, recurse)
        if amax is not None and self._amax is not None and self._amax.dtype != torch.float32:
            kept = self._amax.float() if amax.is_meta else amax.to(self._amax.device)
            if self.learns_amax:
                self._amax.data = kept
            else:
                self._buffers["_amax"] = kept
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
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
        if self._amax.numel() == 1:
            return f"amax={self._amax.item():.4g}"
        return f"amax[{tuple(self._amax.shape)}] max={self._amax.max().item():.4g}"

    def _repr_head(self) -> list[str]:
        return []

    def extra_repr(self) -> str:
        if not self._enabled:
            return ", ".join([*self._repr_head(), "disabled"])
        parts = [*self._repr_head(), self.fmt]
        if self.axis is not None:
            parts.append(f"axis={self.axis}")
        if self.block_size is not None:
            parts.append(f"block={self.block_size}")
        parts.append(self._amax_repr())
        if self._if_calib:
            parts.append("calibrating")
        if not self._if_quant:
            parts.append("quant off")
        return ", ".join(parts)
