"""The expert quantizers of a model as checkpoints see them, and what their saved amaxes were calibrated on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from ..quantization.conversion import is_quantized, unwrap_model
from ..quantization.expert_quantizer import ExpertGemm, ExpertQuantizer
from ..quantization.nn.experts import QUANTIZER_KINDS
from ..quantization.nn.row_scale import DOWN_PROJ_INPUT
from ..quantization.utils import warn_once

__all__ = ["ExpertQuantizerEntry", "iter_expert_quantizers", "warn_if_down_proj_input_calibrated_otherwise"]


@dataclass
class ExpertQuantizerEntry:
    """One expert quantizer of a model: its full name, kind, the quantizer, its GEMM and the owning module."""

    name: str
    kind: str
    quantizer: ExpertQuantizer
    gemm: ExpertGemm
    owner: nn.Module

    @property
    def num_global_experts(self) -> int:
        """``E``: the experts over all expert-parallel ranks (this rank's local count times the EP size)."""
        return self.owner.expert_grid().ep_size * self.gemm.num_local


def iter_expert_quantizers(model: nn.Module) -> Iterator[ExpertQuantizerEntry]:
    """Every expert quantizer of ``model`` (inside any wrappers), in module order."""
    for mod_name, module in unwrap_model(model).named_modules():
        if not is_quantized(module):
            continue
        for gemm in module.expert_gemms():
            base = ".".join(p for p in (mod_name, gemm.name) if p)
            for kind in QUANTIZER_KINDS:
                q = getattr(gemm.quantizers, kind)
                yield ExpertQuantizerEntry(f"{base}.{kind}" if base else kind, kind, q, gemm, module)


def warn_if_down_proj_input_calibrated_otherwise(model: nn.Module, saved: str | None, source: str) -> list[str]:
    """Warns once (rank 0), naming them, when the model's enabled expert down-projection input quantizers load an
    amax calibrated on something else than what they now quantize: a checkpoint whose state does not record
    ``expert_down_proj_input`` (``saved`` None: modelopt_moe before it quantized that input ahead of the router
    probability, or Model Optimizer) holds amaxes of ``prob * act``. Returns the quantizers' names."""
    if saved == DOWN_PROJ_INPUT:
        return []
    names = [e.name for e in iter_expert_quantizers(model)
             if e.kind == "input_quantizer" and e.gemm.sharded_axis == 1 and e.quantizer.is_enabled]
    if names:
        warn_once(
            f"{source}: this checkpoint's expert down-projection (linear_fc2) input amaxes were calibrated on the "
            "activation times the router probability (Megatron's order, what checkpoints without "
            "'expert_down_proj_input' in their quantization state hold); the quantizers now see the activation "
            "itself, as serving engines do, so these amaxes are too small and clip. Recalibrate after loading: "
            "mtq.calibrate(model, forward_loop=...) (weights and the other amaxes are unaffected). Quantizers:\n  "
            + "\n  ".join(names))
    return names
