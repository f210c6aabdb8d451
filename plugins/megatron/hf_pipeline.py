"""Hugging Face export and import across pipeline stages: each stage holds some of the layers (numbered from 0 on
every stage), the embedding lives on the first stage, the final norm and output layer on the last.

:class:`Stage` addresses this rank's stage of a ``GPTModel`` by GLOBAL layer index, so the family tables
(:mod:`modelopt_moe.export.mapping`) are walked with the layer numbers of the checkpoint at any pipeline layout;
import reads only the groups its stage owns (no collective). Export (:class:`PipelineExport`) needs everything on the
writer rank (global rank 0, on the first stage): each group's records are made on the stage that owns the group (its
tensor- and expert-parallel gathers stay inside the stage) and travel to the first stage one record at a time, one
``broadcast_object_list`` over the pipeline group per record, made by every rank of the group; the number of
broadcasts is agreed through them (an end marker), never by a rank's own data. Only the pipeline group of the writer
carries the tensors; the others carry a placeholder. With virtual pipeline stages a stage is a list of model chunks,
each holding its own (not contiguous) layers; :class:`Stage` finds the chunk that holds each path, for export and
import alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from modelopt_moe.export.errors import ExportError

from .pipeline_state import layer_place

__all__ = ["Stage", "PipelineExport", "dotted_get"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)(?=\.|$)")


def pipeline_world() -> int:
    """The pipeline-parallel size (1 without Megatron's parallel state)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


class Stage:
    """This rank's pipeline stage of a ``GPTModel`` (all of it at pipeline size 1), addressed by global layer index.

    Args:
        model: the unwrapped ``GPTModel`` of this stage, or the list of its model chunks (virtual pipeline stages).
    """

    def __init__(self, model):
        self.chunks = list(model) if isinstance(model, list | tuple) else [model]
        self.model = self.chunks[0]
        pipelined = pipeline_world() > 1
        self.places = [layer_place(c) if pipelined else (0, len(c.decoder.layers)) for c in self.chunks]
        self.offset, self.num_layers = self.places[0]
        self.first = any(bool(getattr(c, "pre_process", True)) for c in self.chunks)
        self.last = any(bool(getattr(c, "post_process", True)) for c in self.chunks)

    def locate(self, path: str) -> tuple[object, str]:
        """The chunk that holds ``path`` and the path inside it: ``decoder.layers.{global}...`` -> the chunk of that
        layer and its local index; another path -> the first chunk that has it (the embedding's, the output
        layer's)."""
        m = _LAYER.match(path)
        if m is None:
            return next((c for c in self.chunks if dotted_get(c, path) is not None), self.model), path
        layer = int(m.group(1))
        for chunk, (offset, n) in zip(self.chunks, self.places, strict=True):
            if offset <= layer < offset + n:
                return chunk, f"decoder.layers.{layer - offset}{path[m.end():]}"
        return self.model, f"decoder.layers.{layer - self.offset}{path[m.end():]}"

    def local_path(self, path: str) -> str:
        """``decoder.layers.{global}...`` -> this stage's ``decoder.layers.{local}...`` (other paths unchanged)."""
        return self.locate(path)[1]

    def owns(self, key) -> bool:
        """Whether this stage holds group ``key``: ``"embedding"``, a global layer index, or ``"final"``."""
        if key == "embedding":
            return self.first
        if key == "final":
            return self.last
        return any(offset <= key < offset + n for offset, n in self.places)

    def describe(self) -> tuple[bool, bool, list[tuple[int, int]]]:
        """(first, last, [(offset, number of layers) per chunk]): what the other stages need to know of this one."""
        return self.first, self.last, self.places


def dotted_get(root, path: str):
    """The attribute at a dotted ``path`` under ``root`` (``weight3`` / ``local_experts.3`` alike), None where
    absent."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() and isinstance(obj, torch.nn.ModuleList) else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _move(obj, device: torch.device | None):
    """``obj`` (a record, a quantizer description, a list or tuple of them) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device) if device is not None else obj.detach()
    if isinstance(obj, list | tuple):
        return type(obj)(_move(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        changed = {f.name: _move(getattr(obj, f.name), device) for f in fields(obj)
                   if isinstance(getattr(obj, f.name), torch.Tensor)}
        return replace(obj, **changed) if changed else obj
    return obj


class PipelineExport:
    """The pipeline group's view of an export: which stage owns each group, and the records' way to the writer.

    Construction is a collective over the pipeline group (one ``all_gather_object``): every rank makes it.

    Args:
        stage: this rank's stage.
        num_layers: the model's global layer count.

    Raises:
        ExportError: (on every rank) stages that do not hold every layer exactly once.
    """

    def __init__(self, stage: Stage, num_layers: int):
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.group)
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.carries = 0 in self.ranks  # this group holds the writer: the tensors travel in it
        self.device = next(stage.model.parameters()).device
        stages: list = [None] * len(self.ranks)
        dist.all_gather_object(stages, stage.describe(), group=self.group)
        self.owner: dict = {}
        for p, (first, last, places) in enumerate(stages):
            layers = [L for offset, n in places for L in range(offset, offset + n)]
            for key in [*(["embedding"] if first else []), *layers, *(["final"] if last else [])]:
                if key in self.owner:
                    raise ExportError(f"Hugging Face export: pipeline stages {self.owner[key]} and {p} both hold "
                                      f"{'layer ' if isinstance(key, int) else ''}{key}")
                self.owner[key] = p
        missing = [k for k in ["embedding", *range(num_layers), "final"] if k not in self.owner]
        if missing:
            raise ExportError(f"Hugging Face export: no pipeline stage holds {missing} (stages as first, last, "
                              f"[(layer offset, layers) per chunk]: {stages}); expected every layer on exactly one "
                              "stage")

    def agree(self, local: dict, error: str | None) -> list[dict]:
        """Every stage's ``local`` (tensors on the CPU for the journey), after every stage's check: one
        ``all_gather_object`` over the pipeline group, made by every rank.

        Raises:
            ExportError: on every rank, the first stage's error when any stage had one.
        """
        parts: list = [None] * len(self.ranks)
        dist.all_gather_object(parts, (_move(local, torch.device("cpu")), error), group=self.group)
        errors = [(p, e) for p, (_, e) in enumerate(parts) if e is not None]
        if errors:
            p, e = errors[0]
            raise ExportError(e if len(self.ranks) == 1 else f"pipeline stage {p}: {e}")
        return [_move(part, self.device) for part, _ in parts]

    def records(self, key, make: Callable[[], Iterator]) -> Iterator:
        """Group ``key``'s records, made by ``make()`` on its owning stage, yielded on every rank of the pipeline
        group (the writer's group: the records; the others: None). Every rank iterates to the end."""
        owner = self.owner[key]
        mine = make() if owner == self.rank else None  # every rank of the owning stage: its TP / EP gathers run here
        src = self.ranks[owner]
        while True:
            item = None
            if mine is not None:
                try:
                    rec = next(mine, None)
                except Exception as e:  # noqa: BLE001  (every rank of the group must learn of it, whatever it is)
                    item = ("error", str(e) if isinstance(e, ExportError) else f"{type(e).__name__}: {e}")
                else:
                    item = ("end",) if rec is None else \
                        ("record", _move(rec, torch.device("cpu")) if self.carries else None)
            box = [item]
            dist.broadcast_object_list(box, src=src, group=self.group)
            item = box[0]
            if item[0] == "end":
                return
            if item[0] == "error":
                raise ExportError(f"pipeline stage {owner}: {item[1]}")
            yield _move(item[1], self.device)
