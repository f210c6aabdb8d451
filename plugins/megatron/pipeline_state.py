"""The quantization state of a pipeline-parallel model under global layer names.

Each pipeline stage numbers its transformer layers from 0 (``decoder.layers.0`` is the stage's first layer, global
layer ``offset``), while a checkpoint must name every layer once, whatever the layout. The quantization state
(:func:`modelopt_moe.checkpoint.state.modelopt_state`) and the calibration token counts are therefore saved under
global layer indices, merged over the stages, and each stage restores the entries of its own layers under its local
names. Weights and amaxes need nothing of this: Megatron's sharded state dicts name layers globally already.
With virtual pipeline stages each model chunk (its ``vp_stage``) is placed the same way: the chunks of a stage hold
layers that are not contiguous, and each has its own offset.
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

__all__ = ["pipeline_size", "virtual_pipeline_size", "refuse_virtual_pipeline", "stage_chunks", "layer_place",
           "global_layer_name", "global_state", "stage_state", "merge_chunk_states", "merge_stage_states",
           "stage_naming"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)(?=\.|$)")


def pipeline_size() -> int:
    """The pipeline-parallel size (1 without model-parallel groups)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def virtual_pipeline_size() -> int:
    """The number of model chunks per pipeline stage (virtual pipeline stages; 1 without them)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1


def refuse_virtual_pipeline(what: str, reason: str, instead: str) -> None:
    """Refuses virtual pipeline stages (Megatron's interleaved schedule: model chunks that each hold part of a
    stage's layers) where ``what`` does not support them. Local state only.

    Args:
        what: the call or setting that refuses.
        reason: why it cannot work with model chunks.
        instead: what to do instead.

    Raises:
        ValueError: ``virtual_pipeline_model_parallel_size`` above 1 (names it, the reason and what to use instead).
    """
    vpp = virtual_pipeline_size()
    if vpp > 1:
        raise ValueError(f"{what}: virtual pipeline stages ({vpp}) are not supported "
                         f"(virtual_pipeline_model_parallel_size={vpp}, expected None or 1): {reason}; {instead}")


def stage_chunks(model, what: str) -> list[nn.Module]:
    """The model chunks of this pipeline stage that ``what`` was given: ``[model]`` without virtual pipeline stages,
    the list of the stage's chunks with them. Local state only.

    Args:
        model: one model, or the list of this stage's model chunks (chunk ``i`` built with ``vp_stage=i``).
        what: the call that takes them, for the errors.

    Raises:
        ValueError: one model at virtual pipeline stages, or a list that is not this stage's chunks in ``vp_stage``
            order (names the entry, what it is and what was expected).
    """
    vpp = virtual_pipeline_size()
    if not isinstance(model, list | tuple):
        refuse_virtual_pipeline(what, "got one model, not the list of this stage's model chunks",
                                f"pass the list of the {vpp} chunks built with vp_stage=0..{vpp - 1}")
        return [model]
    for i, chunk in enumerate(model):
        if not isinstance(chunk, nn.Module):
            raise ValueError(f"{what}: model chunk {i} is a {type(chunk).__name__}, expected a torch.nn.Module "
                             "(the GPTModel built for that virtual pipeline stage)")
    if len(model) != vpp:
        raise ValueError(f"{what}: got {len(model)} model chunks, expected {vpp} (one per virtual pipeline "
                         f"stage: virtual_pipeline_model_parallel_size={vpp if vpp > 1 else None})")
    if vpp > 1:
        for i, chunk in enumerate(model):
            stage = getattr(chunk, "vp_stage", None)
            if stage != i:
                raise ValueError(f"{what}: model chunk {i} has vp_stage={stage}, expected {i} (the chunks "
                                 "in the order of their virtual pipeline stages)")
    return list(model)


def layer_place(model: nn.Module) -> tuple[int, int]:
    """(global index of the chunk's first layer, number of layers in the chunk): a pipeline stage's, or with virtual
    pipeline stages one model chunk's (Megatron's ``vp_stage`` of the chunk places its layers). Megatron's parallel
    state must be initialised."""
    vp_stage = getattr(model, "vp_stage", None) if virtual_pipeline_size() > 1 else None
    return get_transformer_layer_offset(model.config, vp_stage=vp_stage), len(model.decoder.layers)


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
    offset, _ = layer_place(model)
    return _rename_state(state, lambda n: global_layer_name(n, offset))


def stage_state(state: dict, model: nn.Module) -> dict:
    """The entries of a (global) state that belong to this stage's model, under its local names: its layers, and
    the modules outside the layers that it holds (the embedding on the first stage, the output layer on the
    last)."""
    offset, n_local = layer_place(model)
    modules = {name for name, _ in model.named_modules()}

    def rename(name: str) -> str | None:
        m = _LAYER.match(name)
        if m is None:
            head = name.split(".")
            return name if any(".".join(head[:i]) in modules for i in range(1, len(head) + 1)) else None
        local = int(m.group(1)) - offset
        return f"decoder.layers.{local}{name[m.end():]}" if 0 <= local < n_local else None

    return _rename_state(state, rename)


def merge_chunk_states(states: list[dict]) -> dict:
    """Global-named states of several chunks (of one model) as one: the union of their entries (each chunk names
    other layers; the modules outside the layers appear once)."""
    out = dict(states[0])
    out["quantized_modules"] = list(dict.fromkeys(n for p in states for n in p["quantized_modules"]))
    for key in ("quantizers", "expert_quantizers", "calibration_tokens"):
        if any(p.get(key) for p in states):
            out[key] = {n: v for p in states for n, v in (p.get(key) or {}).items()}
    return out


def merge_stage_states(states: list[dict]) -> list[dict]:
    """Every stage's global-named states (one per model chunk), merged over the pipeline group: the union of their
    entries, one state per chunk index. A collective over the pipeline group (one ``all_gather_object``): every rank
    calls it."""
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, states, group=group)
    return [merge_chunk_states([p[chunk] for p in parts]) for chunk in range(len(states))]


class _StageNaming:
    """A pipeline stage's :class:`~modelopt_moe.quantization.chunk_names.ChunkNaming`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.offset = layer_place(model)[0]

    def global_name(self, name: str) -> str:
        return global_layer_name(name, self.offset)

    def chunk_state(self, state: dict) -> dict:
        return stage_state(state, self.model)


def stage_naming(model: nn.Module) -> _StageNaming | None:
    """The naming of a Megatron GPT model's pipeline stage, or of one model chunk with virtual pipeline stages
    (registered with the core by the plugin); None at pipeline size 1 or for another model. Local state only: no
    collective."""
    m = unwrap_model(model)
    if pipeline_size() == 1 or not hasattr(m, "decoder") or not hasattr(m, "config"):
        return None
    return _StageNaming(m)
