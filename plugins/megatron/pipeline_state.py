"""The quantization state of a pipeline-parallel model under global layer names.

Each pipeline stage numbers its transformer layers from 0 (``decoder.layers.0`` is the stage's first layer, global
layer ``offset``), while a checkpoint must name every layer once, whatever the layout. The quantization state
(:func:`modelopt_moe.checkpoint.state.modelopt_state`) and the calibration token counts are therefore saved under
global layer indices, merged over the stages, and each stage restores the entries of its own layers under its local
names. Weights and amaxes need nothing of this: Megatron's sharded state dicts name layers globally already.
:func:`stage_naming` gives the core the same mapping (:mod:`modelopt_moe.quantization.chunk_names`): gathered
summaries, calibration token counts and ``restore_sharded_modelopt_state`` name layers globally at any pipeline size.
"""

from __future__ import annotations

import re

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import nn

from modelopt_moe.quantization.conversion import unwrap_model

__all__ = ["pipeline_size", "refuse_virtual_pipeline", "global_layer_name", "global_state", "stage_state",
           "merge_stage_states", "stage_naming"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)(?=\.|$)")


def pipeline_size() -> int:
    """The pipeline-parallel size (1 without model-parallel groups)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def refuse_virtual_pipeline(what: str) -> None:
    """Refuses virtual pipeline stages (Megatron's interleaved schedule: model chunks that each hold part of a
    stage's layers), which the training, checkpoint and export paths here do not support. Local state only.

    Raises:
        ValueError: ``virtual_pipeline_model_parallel_size`` above 1 (names it, and what to use instead).
    """
    if not parallel_state.model_parallel_is_initialized():
        return
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and vpp > 1:
        raise ValueError(f"{what}: virtual pipeline stages ({vpp}) are not supported "
                         f"(virtual_pipeline_model_parallel_size={vpp}, expected None or 1): Megatron's interleaved "
                         "schedule takes no adjust_tensor_shapes_fn to carry a teacher's hidden states, and model "
                         "chunks are not named globally here; initialise with virtual_pipeline_model_parallel_size="
                         "None and train with the non-interleaved schedule")


def _offset(model: nn.Module) -> tuple[int, int]:
    """(global index of the stage's first layer, number of layers on the stage)."""
    return get_transformer_layer_offset(model.config), len(model.decoder.layers)


def global_layer_name(name: str, offset: int) -> str:
    """``decoder.layers.{i}...`` -> ``decoder.layers.{i + offset}...``; other names unchanged."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}", name)


def _rename_state(state: dict, rename) -> dict:
    """``state`` with every module / quantizer name passed through ``rename`` (None: the entry is dropped)."""
    out = dict(state)
    out["quantized_modules"] = [n for n in (rename(x) for x in state["quantized_modules"]) if n is not None]
    for key in ("quantizers", "expert_quantizers", "calibration_tokens"):
        if state.get(key):
            out[key] = {rename(n): v for n, v in state[key].items() if rename(n) is not None}
    return out


def global_state(state: dict, model: nn.Module) -> dict:
    """A stage's quantization state under global layer names."""
    offset, _ = _offset(model)
    return _rename_state(state, lambda n: global_layer_name(n, offset))


def stage_state(state: dict, model: nn.Module) -> dict:
    """The entries of a (global) state that belong to this stage's model, under its local names: its layers, and
    the modules outside the layers that it holds (the embedding on the first stage, the output layer on the
    last)."""
    offset, n_local = _offset(model)
    modules = {name for name, _ in model.named_modules()}

    def rename(name: str) -> str | None:
        m = _LAYER.match(name)
        if m is None:
            head = name.split(".")
            return name if any(".".join(head[:i]) in modules for i in range(1, len(head) + 1)) else None
        local = int(m.group(1)) - offset
        return f"decoder.layers.{local}{name[m.end():]}" if 0 <= local < n_local else None

    return _rename_state(state, rename)


def merge_stage_states(states: list[dict]) -> list[dict]:
    """Every stage's global-named states (one per model chunk), merged over the pipeline group: the union of their
    entries. A collective over the pipeline group (one ``all_gather_object``): every rank calls it."""
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, states, group=group)
    merged = []
    for chunk in range(len(states)):
        stage_parts = [p[chunk] for p in parts]
        out = dict(stage_parts[0])
        out["quantized_modules"] = list(dict.fromkeys(n for p in stage_parts for n in p["quantized_modules"]))
        for key in ("quantizers", "expert_quantizers", "calibration_tokens"):
            if any(p.get(key) for p in stage_parts):
                out[key] = {n: v for p in stage_parts for n, v in (p.get(key) or {}).items()}
        merged.append(out)
    return merged


class _StageNaming:
    """A pipeline stage's :class:`~modelopt_moe.quantization.chunk_names.ChunkNaming`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.offset = _offset(model)[0]

    def global_name(self, name: str) -> str:
        return global_layer_name(name, self.offset)

    def chunk_state(self, state: dict) -> dict:
        return stage_state(state, self.model)


def stage_naming(model: nn.Module) -> _StageNaming | None:
    """The naming of a Megatron GPT model's pipeline stage (registered with the core by the plugin); None at pipeline
    size 1 or for another model. Local state only: no collective.

    Raises:
        ValueError: virtual pipeline stages (:func:`refuse_virtual_pipeline`).
    """
    m = unwrap_model(model)
    if pipeline_size() == 1 or not hasattr(m, "decoder") or not hasattr(m, "config"):
        return None
    refuse_virtual_pipeline("the global layer names of a pipeline stage")
    return _StageNaming(m)
