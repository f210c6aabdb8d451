"""TensorQuantizer: one fake quantizer with a calibrated amax (scalar, per channel, per block or per expert).

Names mirror NVIDIA Model Optimizer (``TensorQuantizer``, ``amax``, ``enable_calib``, ...) so that users switch by
import. A quantizer holds only tensors and plain Python values: no process group, no module references, so a
quantized model deep-copies and pickles. Reductions across ranks are done by :mod:`calibration`, which takes the
group as an argument.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import QuantizerAttributeConfig
from ..numerics import clip_limit, fake_quant, get_format
from .utils import warn_once

__all__ = [
    "TensorQuantizer", "VectorizedQuantizer", "PerExpertQuantizer", "ExpertQuantizerSlot", "FakeQuantSTE",
    "nan_ignoring_abs_max", "clip_mask",
]


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
    shape with size-1 dims except ``axis`` per channel.
    """

    def __init__(self, quant_attribute_cfg: QuantizerAttributeConfig | None = None, amax: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("_amax", None)
        self._if_calib = False
        self._if_quant = True
        self.ste = "pass_through"
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
            self._amax = value.detach().clone().to(device)

    def reset_amax(self) -> None:
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
        return self.forward_expert(None, x)

    # --- the expert-indexed interface (see "Expert layouts" below); a plain quantizer is the `shared` layout ----
    def forward_expert(self, index: int | None, x: torch.Tensor) -> torch.Tensor:
        """Calibrates on and/or fake-quantizes ``x``, which belongs to expert ``index``."""
        if not self._enabled:
            return x
        if self._if_calib:
            self.collect_expert(index, x)
        if not self._if_quant:
            return x
        return self.fake_quant_expert(index, x)

    def collect_expert(self, index: int | None, x: torch.Tensor) -> None:
        self.collect(x)  # shared: every expert feeds the one amax

    def fake_quant_expert(self, index: int | None, x: torch.Tensor) -> torch.Tensor:
        return self.fake_quant(x)

    def expert_amax(self, index: int | None) -> torch.Tensor | None:
        return self._amax

    def expert(self, index: int | None) -> TensorQuantizer:
        """The quantizer whose settings apply to expert ``index``."""
        return self

    def stacked_amax(self, num_experts: int) -> torch.Tensor | None:
        """Amax per expert as ``[N, ...]`` (a view: the shared value for each)."""
        return None if self._amax is None else self._amax.expand(num_experts, *self._amax.shape)

    # --- state ---------------------------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_amax"
        if key in state_dict:
            value = state_dict[key]
            if self._amax is None or self._amax.shape != value.shape:
                device = self._amax.device if self._amax is not None else value.device
                self._amax = torch.empty(value.shape, dtype=torch.float32, device=device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        if not self._enabled:
            return "disabled"
        parts = [self.fmt]
        if self.axis is not None:
            parts.append(f"axis={self.axis}")
        if self.block_size is not None:
            parts.append(f"block={self.block_size}")
        if self._amax is None:
            parts.append("amax=None")
        elif self._amax.numel() == 1:
            parts.append(f"amax={self._amax.item():.4g}")
        else:
            parts.append(f"amax[{tuple(self._amax.shape)}] max={self._amax.max().item():.4g}")
        if self._if_calib:
            parts.append("calibrating")
        if not self._if_quant:
            parts.append("quant off")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Expert layouts. Every layout answers the same expert-indexed calls (forward_expert, collect_expert,
# fake_quant_expert, expert_amax, expert, stacked_amax), so an expert linear never needs to know which it has:
#   shared      -> a plain TensorQuantizer (one scalar amax for all local experts)
#   vectorized  -> VectorizedQuantizer (one amax tensor [N] or [N, C])
#   per_expert  -> PerExpertQuantizer (N child TensorQuantizers, Model Optimizer 0.47's layout)


class VectorizedQuantizer(TensorQuantizer):
    """One quantizer for N experts: amax ``[N]`` (per tensor) or ``[N, C]`` (``axis=0``: per output channel).

    This is the fast path: the ``[N]`` amax goes straight to the one-launch kernel, with no Python loop.
    """

    def __init__(self, num_experts: int, quant_attribute_cfg: QuantizerAttributeConfig | None = None):
        super().__init__(quant_attribute_cfg)
        self.num_experts = num_experts

    @property
    def amax_shape(self) -> tuple[int, ...] | None:
        if self._amax is not None:
            return tuple(self._amax.shape)
        return (self.num_experts,) if self.axis is None else None

    def set_from_attribute_config(self, cfg) -> None:
        super().set_from_attribute_config(cfg)
        if self._cfg.axis not in (None, 0):
            raise ValueError(f"VectorizedQuantizer: axis must be None or 0 (per output channel), got {self._cfg.axis}")

    def expert_amax(self, index: int) -> torch.Tensor | None:
        if self._amax is None:
            return None
        a = self._amax[index]
        return a if self.axis is None else a.unsqueeze(-1)  # [C] -> [C, 1] broadcasts over a [C, K] weight

    def collect_expert(self, index: int, x: torch.Tensor) -> None:
        new = self.amax_of(x).reshape(-1) if self.axis is not None else self.amax_of(x)
        if self._amax is None:
            self._amax = torch.zeros((self.num_experts, *new.shape), dtype=torch.float32, device=new.device)
        with torch.no_grad():
            self._amax[index] = torch.maximum(self._amax[index], new.to(self._amax.device))

    def fake_quant_expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self.fake_quant(x, amax=self.expert_amax(index))

    def stacked_amax(self, num_experts: int | None = None) -> torch.Tensor | None:
        return self._amax


class PerExpertQuantizer(nn.ModuleList):
    """N child quantizers ``{name}.{i}``, each with its own amax (Model Optimizer 0.47's expert layout).

    Patterns such as ``*weight_quantizer`` match the children (rules use the container's name).
    """

    def __init__(self, num_experts: int, quant_attribute_cfg: QuantizerAttributeConfig | None = None):
        super().__init__([TensorQuantizer(quant_attribute_cfg) for _ in range(num_experts)])
        self._stack_key = None
        self._stack = None

    @property
    def num_experts(self) -> int:
        return len(self)

    # Layout-level state is the first child's (rules set all children alike).
    @property
    def is_enabled(self) -> bool:
        return any(q.is_enabled for q in self)

    @property
    def fmt(self) -> str:
        return self[0].fmt

    def expert(self, index: int) -> TensorQuantizer:
        return self[index]

    def forward_expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self[index](x)

    def collect_expert(self, index: int, x: torch.Tensor) -> None:
        self[index].collect(x)

    def fake_quant_expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self[index].fake_quant(x)

    def expert_amax(self, index: int) -> torch.Tensor | None:
        return self[index].amax

    def stacked_amax(self, num_experts: int | None = None) -> torch.Tensor | None:
        """The children's amaxes as one ``[N, ...]`` tensor, cached until any child's amax changes (a new tensor,
        an in-place update, a state-dict load: each changes the key)."""
        amaxes = [q.amax for q in self]
        if any(a is None for a in amaxes):
            return None
        if torch.compiler.is_compiling():  # object ids and version counters are not traceable: stack every call
            return torch.stack([a.float() for a in amaxes])
        key = tuple((id(a), a._version) for a in amaxes)
        if key != self._stack_key:
            self._stack = torch.stack([a.float() for a in amaxes])
            self._stack_key = key
        return self._stack

    def forward(self, x):  # pragma: no cover - a container is never called directly
        raise TypeError("PerExpertQuantizer quantizes one expert at a time: call forward_expert(index, x)")

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["_stack_key"], state["_stack"] = None, None  # ids are process-local: never carry the cache
        return state


class ExpertQuantizerSlot:
    """Expert ``index``'s view of a layer-level expert quantizer: what that expert's own linear calls.

    It holds no amax of its own, so the layer-level layout (shared / vectorized / per_expert) is the single source
    of truth. Not a module: it adds nothing to ``state_dict``.
    """

    def __init__(self, layout: nn.Module, index: int):
        self.layout, self.index = layout, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.forward_expert(self.index, x)

    def collect(self, x: torch.Tensor) -> None:
        self.layout.collect_expert(self.index, x)

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.fake_quant_expert(self.index, x)

    @property
    def amax(self) -> torch.Tensor | None:
        return self.layout.expert_amax(self.index)

    def __getattr__(self, name):
        # is_enabled, _if_quant, ste, fmt, needs_amax, axis, ... of the quantizer that serves this expert
        if name in ("layout", "index") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.layout.expert(self.index), name)
