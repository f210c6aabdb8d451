"""Quantization state beside a distributed (``torch.distributed.checkpoint`` / Megatron ``torch_dist``) checkpoint,
safe checkpoint directories, and the checkpoint's amax shapes for load-time checks.

Flow (Megatron; ``plugins/megatron_checkpoint.py`` wraps it as ``save_sharded_checkpoint`` /
``load_sharded_checkpoint``)::

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)     # every rank
    save_sharded_modelopt_state([model], ckpt_dir)                     # every rank; rank 0 writes
    ...
    model = build_model()                                              # fresh, unquantized, maybe on "meta"
    restore_sharded_modelopt_state([model], ckpt_dir)                  # converts, BEFORE the weights load
    dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)      # then model.load_state_dict(...)

Safe writes: :func:`begin_checkpoint_dir` gives a temporary sibling directory to write into, and
:func:`commit_checkpoint_dir` (rank 0, after every rank finished) writes the completion marker last and moves the
directory into place, so an interrupted save leaves the previous checkpoint untouched; :func:`check_checkpoint_dir`
names what a partial directory lacks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..quantization.config import ExpertsConfig
from ..quantization.utils import warn_once
from .amax import CheckpointMismatchError
from .state import atomic_torch_save, check_state_header, modelopt_state, restore_modelopt_state

__all__ = [
    "STATE_FILE",
    "COMPLETE_MARKER",
    "IncompleteCheckpointError",
    "save_sharded_modelopt_state",
    "restore_sharded_modelopt_state",
    "load_sharded_modelopt_state",
    "checkpoint_amax_shapes",
    "AmaxCheckpointHint",
    "attach_checkpoint_hint",
    "clear_checkpoint_hint",
    "begin_checkpoint_dir",
    "commit_checkpoint_dir",
    "check_checkpoint_dir",
    "resolve_checkpoint_dir",
]

STATE_FILE = "modelopt_moe_state.pt"
COMPLETE_MARKER = "modelopt_moe_complete.json"
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's global metadata, written when the data is complete
_MEGATRON_METADATA = "metadata.json"  # Megatron writes it after every rank's data (its own completion marker)
_HINT_ATTR = "_modelopt_moe_ckpt_hint"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory that a save did not finish; the message names the directory and what is missing."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _as_list(model_list) -> list[nn.Module]:
    return list(model_list) if isinstance(model_list, (list, tuple)) else [model_list]


# ---------------------------------------------------------------------------------------------------------------
# quantization state


def save_sharded_modelopt_state(model_list, ckpt_dir: str | os.PathLike) -> None:
    """Writes the quantization state of every model chunk to ``ckpt_dir/modelopt_moe_state.pt``.

    Call on every rank after the weights are saved; global rank 0 writes (atomically), no collective is made. The
    state is layout-independent (same on every rank with pipeline parallelism 1).

    Args:
        model_list: a model or a list of model chunks (virtual pipeline stages).
        ckpt_dir: the checkpoint directory (must exist).
    """
    states = [modelopt_state(m) for m in _as_list(model_list)]
    if _rank() != 0:
        return
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"save_sharded_modelopt_state: checkpoint directory {path} does not exist")
    atomic_torch_save({"format": "modelopt_moe.sharded_state", "models": states}, path / STATE_FILE)


def load_sharded_modelopt_state(ckpt_dir: str | os.PathLike) -> list[dict]:
    """The per-chunk quantization states saved in ``ckpt_dir``.

    Raises:
        IncompleteCheckpointError: the directory or its state file is missing or the save did not finish.
    """
    path = check_checkpoint_dir(ckpt_dir, require_state=True)
    payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or not isinstance(payload.get("models"), list):
        raise CheckpointMismatchError(f"{path / STATE_FILE}: not a modelopt_moe sharded quantization state")
    return payload["models"]


def restore_sharded_modelopt_state(model_list, ckpt_dir: str | os.PathLike,
                                   experts: ExpertsConfig | dict | None = None) -> None:
    """Re-creates the saved quantization in freshly built model chunks, before their weights load.

    Converts each (unquantized, possibly meta-device) chunk with the saved config, restores every quantizer's
    format, enablement and STE, checks expert counts, and records the checkpoint's amax shapes on the modules so
    that their ``sharded_state_dict`` checks them (and accepts a legacy checkpoint without the expert axis, with a
    rank-0 warning) when the weights load. No collective.

    Args:
        model_list: a model or a list of model chunks, as saved.
        ckpt_dir: the checkpoint directory.
        experts: restore into these expert amax layouts instead of the saved ones.

    Raises:
        IncompleteCheckpointError: the checkpoint is partial (names the directory and what is missing).
        CheckpointMismatchError: the checkpoint does not fit the model (names the key, expected and found values).
    """
    models = _as_list(model_list)
    path = check_checkpoint_dir(ckpt_dir, require_state=True)
    states = load_sharded_modelopt_state(path)
    if len(states) != len(models):
        raise CheckpointMismatchError(f"{path}: expected {len(models)} model chunks, found {len(states)}")
    for model, state in zip(models, states, strict=True):
        check_state_header(state, str(path / STATE_FILE))
        restore_modelopt_state(model, state, experts, source=str(path))
    attach_checkpoint_hint(models, path)


# ---------------------------------------------------------------------------------------------------------------
# the checkpoint's amax shapes, used by sharded_state_dict at load time


def checkpoint_amax_shapes(ckpt_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shapes of the ``*_amax`` tensors of a ``torch.distributed.checkpoint`` directory (reads its
    ``.metadata`` file; no collective)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(ckpt_dir)).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and k.endswith("_amax")}


class AmaxCheckpointHint:
    """The amax shapes of the checkpoint about to be loaded, for ``sharded_state_dict`` to check (plain data)."""

    def __init__(self, ckpt_dir: str, shapes: dict[str, tuple[int, ...]]):
        self.ckpt_dir, self.shapes = ckpt_dir, shapes

    def warn_legacy(self, key: str, found: tuple[int, ...]) -> None:
        warn_once(f"{key}: checkpoint {self.ckpt_dir} stores one amax per layer (global shape {found}, no expert "
                  "axis; saved by an older version); every expert gets that amax")


def attach_checkpoint_hint(model_list, ckpt_dir: str | os.PathLike) -> None:
    """Records ``ckpt_dir``'s amax shapes on every quantized module (until its amaxes are loaded)."""
    from ..quantization.conversion import is_quantized

    hint = AmaxCheckpointHint(str(ckpt_dir), checkpoint_amax_shapes(ckpt_dir))
    for model in _as_list(model_list):
        for m in model.modules():
            if is_quantized(m):
                setattr(m, _HINT_ATTR, hint)


def clear_checkpoint_hint(model_list) -> None:
    """Forgets a recorded checkpoint (a later save must not be shaped after the loaded checkpoint)."""
    for model in _as_list(model_list):
        for m in model.modules():
            m.__dict__.pop(_HINT_ATTR, None)


def checkpoint_hint(module: nn.Module) -> AmaxCheckpointHint | None:
    return module.__dict__.get(_HINT_ATTR)


# ---------------------------------------------------------------------------------------------------------------
# safe checkpoint directories


def _tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def _old_dir(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def begin_checkpoint_dir(ckpt_dir: str | os.PathLike) -> Path:
    """Rank 0: creates an empty temporary sibling ``<ckpt_dir>.tmp`` to save into (removing a stale one); every
    rank gets its path. Call it on every rank, then barrier before writing."""
    final = Path(ckpt_dir)
    tmp = _tmp_dir(final)
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint_dir(tmp_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> None:
    """Rank 0, once every rank finished writing into ``tmp_dir``: writes the completion marker (the list of files)
    last, then moves ``tmp_dir`` to ``ckpt_dir``. A previous ``ckpt_dir`` is moved aside first and deleted after;
    should the process die between the two renames, :func:`resolve_checkpoint_dir` finds it as ``<ckpt_dir>.old``.
    """
    if _rank() != 0:
        return
    tmp, final = Path(tmp_dir), Path(ckpt_dir)
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    marker = tmp / COMPLETE_MARKER
    with open(marker.with_suffix(".part"), "w") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker.with_suffix(".part"), marker)
    old = _old_dir(final)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def check_checkpoint_dir(ckpt_dir: str | os.PathLike, require_state: bool = True) -> Path:
    """Checks that ``ckpt_dir`` holds a complete checkpoint.

    Complete means: the directory exists, torch DCP's ``.metadata`` and Megatron's ``metadata.json`` (each written
    after all data) are present, the quantization state file is present (if ``require_state``), and, where a
    completion marker exists, every file it lists is present with its size.

    Returns:
        The directory as a Path.

    Raises:
        IncompleteCheckpointError: naming the directory and what is missing.
    """
    path = Path(ckpt_dir)
    if not path.is_dir():
        hint = ""
        if _tmp_dir(path).is_dir():
            hint = f"; {_tmp_dir(path)} exists: a save into it did not finish"
        raise IncompleteCheckpointError(f"checkpoint directory {path} does not exist{hint}")
    marker = path / COMPLETE_MARKER
    required = [_DCP_METADATA, _MEGATRON_METADATA] + ([STATE_FILE] if require_state else [])
    missing = [name for name in required if not (path / name).is_file()]
    if marker.is_file():
        for name, size in json.loads(marker.read_text())["files"].items():
            p = path / name
            if not p.is_file():
                missing.append(name)
            elif p.stat().st_size != size:
                missing.append(f"{name} (size {p.stat().st_size}, expected {size})")
    elif path.name.endswith(".tmp"):  # our own save's staging directory: complete only once the marker is written
        missing.append(COMPLETE_MARKER)
    missing = list(dict.fromkeys(missing))
    if missing:
        raise IncompleteCheckpointError(
            f"checkpoint directory {path} is incomplete (a save did not finish or files were removed): missing "
            f"{', '.join(missing)}")
    return path


def resolve_checkpoint_dir(ckpt_dir: str | os.PathLike) -> Path:
    """``ckpt_dir``, or the previous checkpoint ``<ckpt_dir>.old`` (rank-0 warning) when a commit died between its
    two renames."""
    path = Path(ckpt_dir)
    old = _old_dir(path)
    if not path.exists() and old.is_dir():
        check_checkpoint_dir(old)
        warn_once(f"checkpoint directory {path} is missing but {old} is complete (a save died while replacing "
                  f"it); loading {old}")
        return old
    return path
