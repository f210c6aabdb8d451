"""What a distributed checkpoint must pass before anything is written or loaded, with one outcome on every rank.

* :func:`sharded_state_dict_problems`: every tensor of a sharded state dict against torch DCP's ``.metadata``: present,
  with the same global shape (Megatron's ``allow_shape_mismatch`` tensors, the vocabulary-padded embedding and output
  layer, may differ along axis 0 only). Megatron's torch strategy zeroes those tensors in place before it compares
  shapes, so a mismatch found by the load itself has already damaged the model.
* :func:`raise_agreed`: every rank learns whether any rank failed, and all raise (no rank is left in a collective).
* :func:`translate_load_error`: torch DCP's ``CheckpointException`` derives from ``BaseException`` (an ``except
  Exception`` does not catch it) and names the key only in a traceback string: it becomes one of our errors.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from modelopt_moe.checkpoint.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

__all__ = ["sharded_state_dict_problems", "mismatch_message", "raise_agreed", "translate_load_error"]

# Errors re-raised with their own class on the ranks that did not fail themselves.
_AGREED = {cls.__name__: cls for cls in (CheckpointMismatchError, IncompleteCheckpointError, CorruptCheckpointError,
                                         FileExistsError)}
_SHOWN = 8  # problems listed in a message


def _sharded_tensors(state):
    for value in nested_values(state):
        if isinstance(value, ShardedTensorFactory):  # ours check the amax shapes when built (CheckpointMismatchError)
            built = value.build()
            yield from _sharded_tensors(built if isinstance(built, dict | list) else [built])
        elif isinstance(value, ShardedTensor):
            yield value


def sharded_state_dict_problems(state: dict, metadata, allow_missing: bool = False) -> list[str]:
    """What does not fit: one line per checkpoint key (the key, the model's and the checkpoint's global shape).

    Args:
        state: a Megatron sharded state dict (factories are built, not applied: ``state`` is unchanged).
        metadata: the checkpoint's torch DCP metadata.
        allow_missing: tensors the checkpoint lacks are not reported.

    Raises:
        CheckpointMismatchError: an amax entry found its shape wrong while being built.
    """
    problems, seen = [], set()
    for st in _sharded_tensors(state):
        if st.key in seen:  # several shards of one tensor (fused GLU halves, per-expert views)
            continue
        seen.add(st.key)
        expected = tuple(st.global_shape)
        entry = metadata.state_dict_metadata.get(st.key)
        if entry is None:
            if not allow_missing:
                problems.append(f"{st.key}: not in the checkpoint (the model expects global shape {expected})")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{st.key}: the checkpoint holds an object, the model a tensor of shape {expected}")
            continue
        found = tuple(entry.size)
        if st.allow_shape_mismatch:  # vocabulary padding: rows may differ, nothing else
            fits = len(found) == len(expected) and found[1:] == expected[1:]
        else:
            fits = found == expected
        if not fits:
            padding = " (axis 0 may differ: vocabulary padding)" if st.allow_shape_mismatch else ""
            problems.append(f"{st.key}: the model expects global shape {expected}{padding}, the checkpoint has "
                            f"{found}")
    return problems


def mismatch_message(path: Path, problems: list[str]) -> str:
    """The CheckpointMismatchError message for :func:`sharded_state_dict_problems`' lines."""
    more = f"; ... ({len(problems)} in all)" if len(problems) > _SHOWN else ""
    return (f"checkpoint {path} does not fit the model: {'; '.join(problems[:_SHOWN])}{more}. Nothing was loaded; "
            "build the model with the checkpoint's sizes")


def raise_agreed(error: Exception | None, what: str) -> None:
    """Every rank calls it with its own outcome; when any rank failed, every rank raises: its own exception, or the
    first failed rank's (with its class when it is one of ours or FileExistsError, else RuntimeError naming the rank).

    Collective: one ``all_gather_object`` over the default group, made by every rank unconditionally (none without
    ``torch.distributed``).
    """
    outcome = None if error is None else (type(error).__name__, str(error))
    outcomes = [outcome]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
    if error is not None:
        raise error
    for r, failed in enumerate(outcomes):
        if failed is not None:
            name, message = failed
            if name in _AGREED:
                raise _AGREED[name](message)
            raise RuntimeError(f"{what}: rank {r} failed: {name}: {message}")


def translate_load_error(error: BaseException, path: Path) -> Exception:
    """Our error for a failed ``dist_checkpointing.load`` of ``path`` (torch DCP's ``CheckpointException``): each
    failed rank's exception, its key among them; a key or shape problem is a CheckpointMismatchError, anything else
    (a data file that cannot be read) a CorruptCheckpointError."""
    failures = getattr(error, "failures", None) or {}
    inner = [(r, f[0] if isinstance(f, tuple) else f) for r, f in sorted(failures.items())]
    detail = "; ".join(f"rank {r}: {type(e).__name__}: {str(e)[:300]}" for r, e in inner[:4]) or \
        str(error).splitlines()[0]
    if any(isinstance(e, KeyError | CheckpointingException) for _, e in inner):
        return CheckpointMismatchError(f"loading checkpoint {path} failed: {detail}")
    return CorruptCheckpointError(f"loading checkpoint {path} failed, a data file could not be read (damaged?): "
                                  f"{detail}")
