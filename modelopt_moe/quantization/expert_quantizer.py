"""ExpertQuantizer: ONE quantizer for the N local experts of an expert GEMM, with a canonical ``[N, ...]`` amax.

The amax is always one tensor: ``[N]`` per tensor, ``[N, C]`` per output channel (``axis=0`` on ``[C, K]`` expert
weights). It goes to the one-launch kernels as is. The config's layout (``experts.weight_amax`` /
``experts.input_amax``) changes only two things:

* how calibration reduces: ``shared`` keeps one value, the max over every expert (and, after
  :func:`~.calibration.sync_amax`, over every expert-parallel rank), in each entry; ``vectorized`` and
  ``per_expert`` keep each expert's own max;
* how the quantizer presents itself: ``shared`` and ``vectorized`` have one ``_amax`` state-dict entry (the
  ``[N, ...]`` tensor); ``per_expert`` shows N child modules ``{name}.0 .. {name}.{N-1}`` (NVIDIA Model Optimizer's
  names), each an :class:`ExpertView` with its own ``_amax`` entry (shape ``[]`` or ``[C, 1]``), matched by wildcards
  and settable one by one, but holding no state: it reads and writes its row of the one tensor.

An :class:`ExpertView` is also what an expert's own linear calls when its experts are separate modules (Megatron's
``SequentialMLP``): expert ``i``'s quantizer is view ``i`` of the layer-level quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .calib.max import max_over_experts, merge_max
from .config_schema import QuantizerAttributeConfig
from .modelopt_compat import modelopt_quantizer_state, unsupported
from .quant_mode import QuantMode
from .tensor_quantizer import StaticBlocksSTE, TensorQuantizer, nan_ignoring_abs_max
from .utils import warn_once

__all__ = ["EXPERT_LAYOUTS", "ExpertQuantizer", "ExpertView", "ExpertGemm", "ExpertGrid"]

EXPERT_LAYOUTS = ("shared", "vectorized", "per_expert")


@dataclass(frozen=True)
class ExpertGrid:
    """This rank's place in the expert-parallel grid: ranks and sizes of the expert-parallel (EP), expert
    tensor-parallel (ETP) and expert data-parallel (EDP) groups. Plain ints (no process groups); local expert
    ``i`` is global expert ``ep_rank * N_local + i``."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1

    def global_index(self, num_local: int, local: int) -> int:
        """The global index of local expert ``local`` when each rank holds ``num_local`` experts."""
        return self.ep_rank * num_local + local


@dataclass
class ExpertGemm:
    """One expert GEMM of a quantized module: where its expert quantizers live and how its weights are split.

    Attributes:
        name: the state-dict prefix of the quantizers relative to the module (``""`` for a grouped linear, which
            holds them itself; ``"linear_fc1"`` for ``SequentialMLP``'s layer-level quantizers).
        quantizers: the module holding ``input_quantizer`` / ``weight_quantizer`` / ``output_quantizer``.
        num_local: experts on this rank.
        sharded_axis: the weight axis split over expert-tensor-parallel ranks (0 column-, 1 row-parallel).
        weight_shape: one local expert weight's shape.
        weights: the local expert weights, in expert order (for reports and export).
    """

    name: str
    quantizers: nn.Module
    num_local: int
    sharded_axis: int
    weight_shape: tuple[int, ...] | None
    weights: list[torch.Tensor] | None = None


class ExpertQuantizer(TensorQuantizer):
    """Fake-quantizes the tensors of N experts, each with its row of one ``[N, ...]`` amax.

    Args:
        num_experts: N, the local experts.
        layout: ``shared``, ``vectorized`` or ``per_expert`` (see the module docstring).
        quant_attribute_cfg: the format; ``axis`` must be None (per tensor) or 0 (per output channel).
        config_name: the config's name for this layout, shown by summaries where it differs (``input_amax:
            per_expert`` is kept ``vectorized``: inputs get no per-expert child quantizers).
    """

    def __init__(self, num_experts: int, layout: str = "vectorized",
                 quant_attribute_cfg: QuantizerAttributeConfig | None = None, *, config_name: str | None = None):
        if layout not in EXPERT_LAYOUTS:
            raise ValueError(f"ExpertQuantizer: layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")
        if num_experts < 1:
            raise ValueError(f"ExpertQuantizer: num_experts must be >= 1, got {num_experts}")
        super().__init__(quant_attribute_cfg)
        self.num_experts = num_experts
        self.layout = layout
        self.config_name = config_name or layout
        # Rows each expert calibrated on (its tokens, for an input quantizer; not counted for `shared`, which sees
        # every expert's rows at once): reports mark the experts that saw none.
        self.calibrated_rows: torch.Tensor | None = None
        if layout == "per_expert":
            self._non_persistent_buffers_set.add("_amax")  # the views carry it, under their own keys
            for i in range(num_experts):
                self.add_module(str(i), ExpertView(self, i))

    def set_from_attribute_config(self, cfg: QuantizerAttributeConfig | dict) -> None:
        """Applies a config as :meth:`TensorQuantizer.set_from_attribute_config` does, for the settings experts support.

        Raises:
            ValueError: an axis other than None or 0, a static int block size, ``unsigned`` or a per-token amax; the
                quantizer keeps its earlier settings.
        """
        previous = self.__dict__.get("_cfg")
        super().set_from_attribute_config(cfg)
        c = self._cfg
        problem = None
        if c.axis not in (None, 0):
            problem = (f"ExpertQuantizer: axis must be None (per tensor) or 0 (per output channel of an expert "
                       f"weight), got {c.axis}")
        elif c.static_block_size is not None:
            problem = unsupported("expert block_sizes", c.block_sizes, "expert int blocks take their amax from the "
                                  "data: set block_sizes.type: dynamic (the same numbers at calibration)")
        elif c.unsigned:
            problem = unsupported("expert unsigned", True, "the expert kernels quantize signed ranges only")
        elif c.per_token:
            problem = unsupported("expert block_sizes", c.block_sizes, "no per-token amax for experts; use a "
                                  "per-tensor amax (type: dynamic takes it from each expert's tokens)")
        if problem is not None:
            if previous is not None:
                self._cfg, self._enabled = previous, previous.enable
            raise ValueError(problem)

    # --- the canonical amax ----------------------------------------------------------------------------------------
    @property
    def amax_shape(self) -> tuple[int, ...] | None:
        """``(N,)`` per tensor, ``(N, C)`` per channel once known (None: a per-channel amax never calibrated)."""
        if self._amax is not None:
            return tuple(self._amax.shape)
        return (self.num_experts,) if self.axis is None else None

    def _to_canonical(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as ``[N, ...]``: one expert's shape (``[]``, ``[C]``, ``[C, 1]``) is given to every expert."""
        n = self.num_experts
        if self._amax is not None and value.shape == self._amax.shape:
            return value
        if self.axis is None:
            if value.numel() == 1:
                return value.reshape(1).expand(n)
            if value.shape == (n,):
                return value
        else:
            if value.dim() == 2 and value.shape[1] == 1:  # one expert's [C, 1] (a per-channel TensorQuantizer's)
                return value.reshape(1, -1).expand(n, -1)
            if value.dim() == 2 and value.shape[0] == n:
                return value
            if value.dim() == 1:
                return value.reshape(1, -1).expand(n, -1)
        raise ValueError(f"ExpertQuantizer({self.layout}, {n} experts, axis={self.axis}): an amax of shape "
                         f"{tuple(value.shape)} fits neither all experts ({'[N]' if self.axis is None else '[N, C]'})"
                         f" nor one expert ({'[]' if self.axis is None else '[C] or [C, 1]'})")

    def _reduced(self, value: torch.Tensor) -> torch.Tensor:
        """The layout's calibration rule applied to an ``[N, ...]`` value: ``shared`` keeps the max over experts."""
        if self.layout == "shared":
            return max_over_experts(value).expand_as(value)
        return value

    @property
    def amax(self) -> torch.Tensor | None:
        """The ``[N]`` / ``[N, C]`` float32 amax (None before calibration)."""
        return self._amax

    @amax.setter
    def amax(self, value) -> None:
        """Accepts all experts' ``[N, ...]`` or one expert's value (given to every expert). A ``shared`` quantizer
        keeps the max over the experts in every entry."""
        value = torch.as_tensor(value, dtype=torch.float32).detach()
        value = self._reduced(self._to_canonical(value))
        if self._amax is not None and self._amax.shape == value.shape:
            with torch.no_grad():
                self._amax.copy_(value.to(self._amax.device))  # in place: bumps the version the weight reuse checks
        else:
            device = self._amax.device if self._amax is not None else value.device
            self._put_amax(value.to(device).contiguous().clone())

    def expert_amax(self, index: int) -> torch.Tensor | None:
        """Expert ``index``'s amax in the shape :func:`~modelopt_moe.numerics.fake_quant` broadcasts over its
        tensor: ``[]`` per tensor, ``[C, 1]`` per output channel."""
        if self._amax is None:
            return None
        a = self._amax[index]
        return a if self.axis is None else a.unsqueeze(-1)

    def set_expert_amax(self, index: int, value) -> None:
        """Sets expert ``index``'s row (``shared``: the one value of every expert)."""
        value = torch.as_tensor(value, dtype=torch.float32).detach()
        row = value.reshape(()) if self.axis is None else value.reshape(-1)
        if self._amax is None:
            device = value.device
            self._put_amax(torch.zeros((self.num_experts, *row.shape), dtype=torch.float32, device=device))
        with torch.no_grad():
            if self.layout == "shared":
                self._amax.copy_(row.to(self._amax.device).expand_as(self._amax))
            else:
                self._amax[index] = row.to(self._amax.device)

    def amax_of(self, x: torch.Tensor) -> torch.Tensor:
        """One expert's amax of its tensor ``x`` (``[]`` or ``[C]``), NaN ignored."""
        if self.axis is None:
            return nan_ignoring_abs_max(x)
        return nan_ignoring_abs_max(x, (0,)).reshape(-1)

    # --- calibration -----------------------------------------------------------------------------------------------
    def _ensure_amax(self, like: torch.Tensor) -> torch.Tensor:
        if self._amax is None:
            self._put_amax(torch.zeros((self.num_experts, *like.shape), dtype=torch.float32, device=like.device))
        return self._amax

    def reset_amax(self) -> None:
        """Resets the amax (:meth:`TensorQuantizer.reset_amax`) and forgets the rows each expert calibrated on."""
        super().reset_amax()
        self.calibrated_rows = None

    def collect_expert(self, index: int, x: torch.Tensor) -> None:
        """Max calibration of expert ``index`` on its tensor ``x`` (``shared``: every expert takes the max).
        Dynamic quantizers collect nothing."""
        if self.is_dynamic:
            return
        if self.calib_observer is not None:
            self.calib_observer(x, index)
            return
        if self.layout != "shared":
            if self.calibrated_rows is None:
                self.calibrated_rows = torch.zeros(self.num_experts, dtype=torch.int64)
            self.calibrated_rows[index] += x.numel() // max(1, x.shape[-1]) if x.dim() else 1
        self._count_nonfinite(x, fresh=False)  # reset_amax starts the pass
        if self.static_block_scales:
            self._collect_expert_blocks(index, x)
        new = self.amax_of(x)
        amax = self._ensure_amax(new)
        with torch.no_grad():
            new = new.to(amax.device)
            if self.layout == "shared":
                merge_max(amax, new, out=amax)
            else:
                amax[index] = merge_max(amax[index], new)

    def _collect_expert_blocks(self, index: int, x: torch.Tensor) -> None:
        """Static block scales: expert ``index``'s block amaxes (each expert its own, whatever the layout: a block
        belongs to one expert's weight) in the ``[N, ..., K // 16]`` :attr:`block_amax`."""
        blocks = self.block_amax_of(x)
        old = self.block_amax
        if old is None:
            self._put_block_amax(torch.zeros((self.num_experts, *blocks.shape), dtype=torch.float32,
                                             device=blocks.device))
            old = self.block_amax
        if tuple(old.shape[1:]) != tuple(blocks.shape):
            raise ValueError(f"ExpertQuantizer({self.fmt}, static block scales): expert {index}'s tensor of shape "
                             f"{tuple(x.shape)} does not fit the block amaxes {tuple(old.shape)}; static block "
                             "scales need every expert's weight of one shape")
        with torch.no_grad():
            old[index] = merge_max(old[index], blocks.to(old.device))

    def collect(self, x: torch.Tensor) -> None:
        """Max calibration on a tensor that belongs to every expert (e.g. a GEMM output of all experts)."""
        if self.is_dynamic:
            return
        if self.calib_observer is not None:
            self.calib_observer(x, None)
            return
        self._count_nonfinite(x, fresh=False)
        new = self.amax_of(x)
        amax = self._ensure_amax(new)
        with torch.no_grad():
            merge_max(amax, new.to(amax.device), out=amax)

    def fill_unseen_experts(self, groups: dict) -> list[int]:
        """Per-expert per-tensor amax: an expert no rank calibrated (amax 0) takes the max over all experts on all
        EP ranks. Returns the global indices of those experts (the caller warns once on rank 0).

        Every rank calls the same collective (one all_gather over ``groups["ep"]``), whatever its data.
        """
        if self.layout == "shared" or not self.is_enabled or self.axis is not None or self.is_dynamic:
            return []
        local = (self._amax if self._amax is not None else torch.zeros(self.num_experts)).float()
        ep = groups.get("ep")
        if ep is not None and dist.is_initialized() and dist.get_world_size(ep) > 1:
            device = torch.device("cpu") if dist.get_backend(ep) == "gloo" else local.device
            parts = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size(ep))]
            dist.all_gather(parts, local.to(device), group=ep)
            everyone = torch.cat(parts)
        else:
            everyone = local
        unseen = (everyone <= 0).nonzero().flatten().tolist()
        shared = max_over_experts(everyone).reshape(()).to(local.device)
        if unseen and shared > 0:
            self.amax = torch.where(local <= 0, shared, local)
        return unseen

    # --- forward ---------------------------------------------------------------------------------------------------
    def dynamic_amax(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        """The ``[N, ...]`` amax of the experts' current tensors under this layout's rule (no calibrated amax)."""
        warn_once(f"ExpertQuantizer({self.fmt}): quantizing with no calibrated amax; using the amax of the current "
                  "tensors (run mtq.calibrate / a forward_loop to calibrate)")
        return self._reduced(torch.stack([self.amax_of(c) for c in chunks]))

    def forward_expert(self, index: int, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Calibrates on and/or fake-quantizes expert ``index``'s tensor ``x``; ``amax`` overrides its own."""
        mode = self.mode
        if mode is QuantMode.OFF:
            return x
        if mode is QuantMode.CALIBRATING:
            self.collect_expert(index, x)
            if not self._if_quant:
                return x
        return self.fake_quant_expert(index, x, amax)

    def forward_experts(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Expert ``i``'s tensor ``tensors[i]`` through :meth:`forward_expert`, one by one (calibrating, dynamic or
        uncalibrated). Quantizing with no amax yet, every expert takes its row of the current tensors' amax under
        this layout's rule (:meth:`dynamic_amax`)."""
        current = None
        if self.is_quantizing and self._amax is None and self.needs_amax and not self.is_dynamic:
            current = self.dynamic_amax(tensors)
        return [self.forward_expert(i, t, None if current is None else self.row_of(current, i))
                for i, t in enumerate(tensors)]

    def row_of(self, amax: torch.Tensor, index: int) -> torch.Tensor:
        """Expert ``index``'s row of an ``[N, ...]`` amax in the shape ``fake_quant`` broadcasts (``[]``, or
        ``[C, 1]`` per channel)."""
        return amax[index] if self.axis is None else amax[index].unsqueeze(-1)

    def fake_quant_expert(self, index: int, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Fake-quantizes expert ``index``'s tensor ``x`` with its amax (or ``amax``), STE per :attr:`ste`."""
        if amax is None and self.is_dynamic:
            amax = self.dynamic_expert_amax(x)
        if amax is None:
            amax = self.expert_amax(index)
        if amax is None and self.needs_amax:
            amax = self.dynamic_amax([x])[0]
            amax = amax if self.axis is None else amax.unsqueeze(-1)
        if amax is not None:
            amax = amax.to(x.device)
        if self.static_block_scales and self.block_amax is not None:
            return StaticBlocksSTE.apply(x, amax, self.block_amax[index], self.fmt, self._cfg.block_scale_max,
                                         self.ste == "clipped")
        # The dense quantizers' choice: one expert's tensor takes the kernels where a dense tensor would (an expert's
        # own linear in SequentialMLP calls this for its weight and its tokens).
        return self._fake_quant_ste(x, amax if self.needs_amax else None, self.ste == "clipped")

    def dynamic_expert_amax(self, x: torch.Tensor) -> torch.Tensor:
        """``type: dynamic``: the amax of this one expert's tensor ``x`` in the shape ``fake_quant`` broadcasts
        (``[]``, or ``[C, 1]`` per channel), taken at every call."""
        a = self.amax_of(x).detach()
        return a if self.axis is None else a.unsqueeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor of every expert at once (e.g. a grouped GEMM's output): only the ``shared`` layout has the one
        amax that applies to it."""
        if self.layout != "shared" and self._enabled:
            raise TypeError(f"ExpertQuantizer({self.layout}) quantizes one expert at a time: call "
                            "forward_expert(index, x)")
        return self.forward_expert(0, x)

    def fake_quant(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Fake-quantizes ``x`` with expert 0's amax (or ``amax``): the one amax of the ``shared`` layout."""
        return self.fake_quant_expert(0, x, amax)

    # --- views -----------------------------------------------------------------------------------------------------
    def view(self, index: int) -> ExpertView:
        """Expert ``index``'s view (the registered child for ``per_expert``; a new, unregistered one otherwise)."""
        if not 0 <= index < self.num_experts:
            raise IndexError(f"expert {index} out of range for {self.num_experts} experts")
        if self.layout == "per_expert":
            return self._modules[str(index)]
        return ExpertView(self, index)

    def __getitem__(self, index: int) -> ExpertView:
        return self.view(index)

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self):
        return (self.view(i) for i in range(self.num_experts))

    # --- state -----------------------------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        blocks = state_dict.get(prefix + "_block_amax")
        if blocks is not None:  # static block scales: every layout keeps them here, [N, rows, K // 16]
            self.block_amax = blocks.float()
        elif self.block_amax is not None and strict and self.layout == "per_expert":  # the others: nn.Module's
            missing_keys.append(prefix + "_block_amax")
        key = prefix + "_amax"
        if self.layout == "per_expert":
            return  # the views load their rows, under their own keys
        if key in state_dict:
            try:
                value = self._reduced(self._to_canonical(state_dict[key].float()))
            except ValueError as e:
                error_msgs.append(f"{key}: {e}")
                return
            if self._amax is None or self._amax.shape != value.shape:
                self._put_amax(torch.empty(value.shape, dtype=torch.float32,
                                           device=self._amax.device if self._amax is not None else value.device))
            state_dict = {**state_dict, key: value}
        nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                        unexpected_keys, error_msgs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout == "per_expert":  # a learned amax is a parameter (always saved): the views carry it
            destination.pop(prefix + "_amax", None)

    def _repr_head(self) -> list[str]:
        return [self.config_name, f"{self.num_experts} experts"]

    def _amax_repr(self) -> str:
        if self._amax is None:
            return "amax=None"
        if self._amax.is_meta:  # restored into a model on the meta device: values come when it is materialised
            return f"amax[{tuple(self._amax.shape)}] on meta"
        return _amax_range_text(self._amax.min().item(), self._amax.max().item(), tuple(self._amax.shape))

    def describe_experts(self, num_experts: int, amax_range: tuple[float, float] | None) -> str:
        """:meth:`extra_repr` for ``num_experts`` experts in all (e.g. every expert-parallel rank's) whose amaxes
        span ``amax_range`` (None: no expert has one): the line of a summary that gathered every rank's experts."""
        head = [self.config_name, f"{num_experts} experts"]
        if amax_range is None:
            return self._describe(head, "amax=None")
        tail = tuple(self._amax.shape[1:]) if self._amax is not None else ()
        return self._describe(head, _amax_range_text(*amax_range, (num_experts, *tail)))

    def extra_repr(self) -> str:
        """As :meth:`TensorQuantizer.extra_repr`, and the calibration tokens of each local expert where counted
        (``tokens 0..128``, with the local experts that saw none)."""
        text = super().extra_repr()
        rows = self.calibrated_rows
        if rows is None or not self._enabled:
            return text
        text += f", tokens {int(rows.min())}..{int(rows.max())}" if rows.min() != rows.max() else \
            f", tokens {int(rows[0])}"
        cold = (rows == 0).nonzero().flatten().tolist()
        return text + (f" (none: local experts {cold})" if cold else "")


def _amax_range_text(lo: float, hi: float, shape: tuple[int, ...]) -> str:
    return f"amax={hi:.4g}" if lo == hi else f"amax[{shape}] {lo:.4g}..{hi:.4g}"


class ExpertView(nn.Module):
    """Expert ``index``'s view of an :class:`ExpertQuantizer`: its amax is the owner's row ``index``; every
    setting is the owner's. Holds no state of its own.

    Registered as the owner's child ``{index}`` in the ``per_expert`` layout (state-dict key ``{index}._amax``, shape
    ``[]`` or ``[C, 1]``, Model Optimizer's per-expert names); created on demand as what an expert's own linear
    calls in ``SequentialMLP``.
    """

    def __init__(self, owner: ExpertQuantizer, index: int):
        super().__init__()
        self.__dict__["_owner"] = owner  # a reference, not a submodule: no cycle in the module tree
        self.index = index

    @property
    def owner(self) -> ExpertQuantizer:
        """The :class:`ExpertQuantizer` this view reads from."""
        return self.__dict__["_owner"]

    @property
    def amax(self) -> torch.Tensor | None:
        """This expert's amax: the owner's row ``index`` (``[]`` or ``[C, 1]``), or None before calibration."""
        return self.owner.expert_amax(self.index)

    @amax.setter
    def amax(self, value) -> None:
        self.owner.set_expert_amax(self.index, value)

    # Settings are the owner's (read-only here: they apply to every expert).
    fmt = property(lambda self: self.owner.fmt)
    cfg = property(lambda self: self.owner.cfg)
    num_bits = property(lambda self: self.owner.num_bits)
    axis = property(lambda self: self.owner.axis)
    block_size = property(lambda self: self.owner.block_size)
    ste = property(lambda self: self.owner.ste)
    amax_update = property(lambda self: self.owner.amax_update)
    learns_amax = property(lambda self: self.owner.learns_amax)
    needs_amax = property(lambda self: self.owner.needs_amax)
    is_enabled = property(lambda self: self.owner.is_enabled)
    is_quantizing = property(lambda self: self.owner.is_quantizing)
    is_dynamic = property(lambda self: self.owner.is_dynamic)
    narrow_range = property(lambda self: self.owner.narrow_range)
    unsigned = property(lambda self: self.owner.unsigned)
    int_kwargs = property(lambda self: self.owner.int_kwargs)
    block_sizes = property(lambda self: self.owner.block_sizes)
    static_block_size = property(lambda self: self.owner.static_block_size)
    maxbound = property(lambda self: self.owner.maxbound)
    mode = property(lambda self: self.owner.mode)
    is_calibrating = property(lambda self: self.owner.is_calibrating)
    clips = property(lambda self: self.owner.clips)
    refreshes_amax = property(lambda self: self.owner.refreshes_amax)
    _if_quant = property(lambda self: self.owner._if_quant)  # Model Optimizer's names, read-only here
    _if_calib = property(lambda self: self.owner._if_calib)

    def switches(self) -> dict[str, bool]:
        """The owner's switches (they apply to every expert)."""
        return self.owner.switches()

    def get_modelopt_state(self, properties_only: bool = False) -> dict:
        """Model Optimizer's per-expert quantizer state (``weight_quantizer.{i}``): the owner's settings, this
        expert's amax shape."""
        return modelopt_quantizer_state(self, properties_only)

    def collect(self, x: torch.Tensor) -> None:
        """Max calibration of this expert on ``x`` (the owner's :meth:`~ExpertQuantizer.collect_expert`)."""
        self.owner.collect_expert(self.index, x)

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantizes ``x`` with this expert's amax."""
        return self.owner.fake_quant_expert(self.index, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Calibrates on and/or fake-quantizes ``x`` as this expert (:meth:`ExpertQuantizer.forward_expert`)."""
        return self.owner.forward_expert(self.index, x)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        amax = self.amax
        if amax is not None:
            destination[prefix + "_amax"] = amax if keep_vars else amax.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_amax"
        if key in state_dict:
            value = state_dict[key]
            if self.axis is None and value.numel() != 1:
                error_msgs.append(f"{key}: expected expert {self.index}'s per-tensor amax, got shape "
                                  f"{tuple(value.shape)}")
                return
            self.amax = value
        elif strict and self.owner.amax is not None:
            missing_keys.append(key)

    def extra_repr(self) -> str:
        """The expert index and its amax (the maximum of a per-channel one)."""
        amax = self.amax
        if amax is None:
            return f"expert {self.index}, amax=None"
        if amax.is_meta:
            return f"expert {self.index}, amax[{tuple(amax.shape)}] on meta"
        return f"expert {self.index}, amax={amax.item():.4g}" if amax.numel() == 1 else \
            f"expert {self.index}, amax[{tuple(amax.shape)}] max={amax.max().item():.4g}"
