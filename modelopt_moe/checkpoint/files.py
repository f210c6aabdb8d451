"""Safe checkpoint directories and files: a save that dies midway never leaves something that looks complete.

:func:`begin_checkpoint_dir` gives a temporary sibling directory to write into, and :func:`commit_checkpoint_dir`
(rank 0, after every rank finished) writes the completion marker last and moves the directory into place, so an
interrupted save leaves the previous checkpoint untouched; :func:`check_checkpoint_dir` names what a partial
directory lacks. :func:`atomic_torch_save` does the same for one file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..quantization.utils import rank, warn_once
from .errors import IncompleteCheckpointError

__all__ = [
    "STATE_FILE",
    "COMPLETE_MARKER",
    "atomic_torch_save",
    "begin_checkpoint_dir",
    "commit_checkpoint_dir",
    "check_checkpoint_dir",
    "resolve_checkpoint_dir",
    "megatron_lm_iteration_dir",
]

STATE_FILE = "modelopt_moe_state.pt"
# Megatron-LM's checkpoint root names its latest iteration in this file (its checkpointing.py).
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "modelopt_moe_complete.json"
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's global metadata, written when the data is complete
_MEGATRON_METADATA = "metadata.json"  # Megatron writes it after every rank's data (its own completion marker)


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename: a crash leaves the old file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def _old_dir(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def begin_checkpoint_dir(ckpt_dir: str | os.PathLike) -> Path:
    """Rank 0: creates an empty temporary sibling ``<ckpt_dir>.tmp`` to save into (removing a stale one); every
    rank gets its path. Call it on every rank, then barrier before writing."""
    final = Path(ckpt_dir)
    tmp = _tmp_dir(final)
    if rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint_dir(tmp_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> None:
    """Rank 0, once every rank finished writing into ``tmp_dir``: writes the completion marker (the list of files)
    last, then moves ``tmp_dir`` to ``ckpt_dir``. A previous ``ckpt_dir`` is moved aside first and deleted after;
    should the process die between the two renames, :func:`resolve_checkpoint_dir` finds it as ``<ckpt_dir>.old``.
    """
    if rank() != 0:
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

    A Megatron-LM ``--save`` directory (``latest_checkpointed_iteration.txt`` beside ``iter_0000100/``) stands for
    its latest iteration's directory (:func:`megatron_lm_iteration_dir`).

    Returns:
        The directory as a Path.

    Raises:
        IncompleteCheckpointError: naming the directory and what is missing.
    """
    path = megatron_lm_iteration_dir(ckpt_dir)
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


def megatron_lm_iteration_dir(ckpt_dir: str | os.PathLike) -> Path:
    """``ckpt_dir``, or, when it is a Megatron-LM ``--save`` / ``--load`` directory, the checkpoint of the iteration its
    ``latest_checkpointed_iteration.txt`` names (``iter_0000100`` for ``100``, ``release`` for ``release``).

    Raises:
        IncompleteCheckpointError: the tracker file names no iteration (names the file and its text).
    """
    path = Path(ckpt_dir)
    tracker = path / MEGATRON_LM_TRACKER
    if not tracker.is_file() or (path / _DCP_METADATA).is_file():
        return path
    text = tracker.read_text().strip()
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise IncompleteCheckpointError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
    return path / f"iter_{int(text):07d}"


def resolve_checkpoint_dir(ckpt_dir: str | os.PathLike) -> Path:
    """``ckpt_dir``, or the previous checkpoint ``<ckpt_dir>.old`` (rank-0 warning) when a commit died between its
    two renames."""
    path = megatron_lm_iteration_dir(ckpt_dir)
    old = _old_dir(path)
    if not path.exists() and old.is_dir():
        check_checkpoint_dir(old)
        warn_once(f"checkpoint directory {path} is missing but {old} is complete (a save died while replacing "
                  f"it); loading {old}")
        return old
    return path
