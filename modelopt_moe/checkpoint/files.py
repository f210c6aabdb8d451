"""Safe checkpoint directories and files: a save that dies midway never leaves something that looks complete.

:func:`begin_checkpoint_dir` gives a temporary sibling directory to write into, and :func:`commit_checkpoint_dir`
(rank 0, after every rank finished) writes the completion marker last and moves the directory into place, so an
interrupted save leaves the previous checkpoint untouched; :func:`check_checkpoint_dir` names what a partial
directory lacks. :func:`atomic_torch_save` does the same for one file.

A save only ever replaces a checkpoint of ours: :func:`check_save_target` refuses a non-empty directory that is not
one (a Hugging Face model passed as the save directory stays as it is). Reads translate torch's errors into ours:
:func:`read_torch_file` names a truncated or damaged file (and never advises unsafe unpickling),
:func:`check_dcp_file_sizes` compares every ``.distcp`` file with what torch DCP's ``.metadata`` needs from it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..quantization.utils import rank, warn_once
from .errors import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError

__all__ = [
    "STATE_FILE",
    "COMPLETE_MARKER",
    "atomic_torch_save",
    "read_torch_file",
    "read_dcp_metadata",
    "check_dcp_file_sizes",
    "is_our_checkpoint",
    "check_save_target",
    "begin_checkpoint_dir",
    "commit_checkpoint_dir",
    "check_checkpoint_dir",
    "checkpoint_iteration",
    "discard_unfinished_save",
    "resolve_checkpoint_dir",
    "megatron_lm_iteration_dir",
]

STATE_FILE = "modelopt_moe_state.pt"
# Megatron-LM's checkpoint root names its latest iteration in this file (its checkpointing.py).
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "modelopt_moe_complete.json"
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's global metadata, written when the data is complete
_MEGATRON_METADATA = "metadata.json"  # Megatron writes it after every rank's data (its own completion marker)
# Every name a save writes into its staging directory (Megatron / torch DCP, then ours): a stale ``<dir>.tmp`` is
# removed only when it holds nothing else.
_STAGING_NAME = re.compile(r"^(__\d+_\d+\.distcp|\.metadata(\.tmp)?|metadata\.json|common\.pt"
                           r"|modelopt_moe_\w+\.(pt|json|part)|\.modelopt_moe_state\.pt\.\w+\.tmp)$")


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


def read_torch_file(path, allowed_globals: tuple = ()):
    """``torch.load(path, weights_only=True)`` onto the CPU, with errors that name the file.

    Args:
        path: the file (or an open binary file object).
        allowed_globals: Python objects to admit besides tensors and plain data (``torch.serialization.safe_globals``).

    Raises:
        FileNotFoundError / PermissionError / IsADirectoryError: as ``open`` raises them.
        CorruptCheckpointError: the file is truncated or damaged (names it).
        CheckpointMismatchError: the file holds a Python object that is never unpickled here (names its class).
    """
    if isinstance(path, str | os.PathLike):
        path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allowed_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, OSError, EOFError, UnpicklingError, ...
        # torch's own message advises weights_only=False (arbitrary code execution): never pass it on.
        detail = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()
        detail = detail[0].strip() if detail else ""
        unsupported = re.match(r"Unsupported global: GLOBAL (\S+)", detail)
        reason = type(e).__name__ + (f": {detail[:120]}" if detail and "weights_only" not in detail else "")
    if unsupported:
        raise CheckpointMismatchError(f"{path}: not a checkpoint this package reads: it holds a Python object "
                                      f"({unsupported.group(1)}), and only tensors and plain data are loaded")
    raise CorruptCheckpointError(f"{path}: the file is truncated or corrupt and cannot be read ({reason}); it was not "
                                 "written completely or was damaged since: save it again, or use an intact copy")


def read_dcp_metadata(ckpt_dir: str | os.PathLike):
    """The global torch DCP ``.metadata`` of a checkpoint directory (tensor keys, global shapes, where each chunk lies).

    Raises:
        IncompleteCheckpointError: there is no ``.metadata`` (names the directory).
        CorruptCheckpointError: it cannot be read (names the file).
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(ckpt_dir)
    if not (path / _DCP_METADATA).is_file():
        raise IncompleteCheckpointError(f"checkpoint directory {path} is incomplete: missing {_DCP_METADATA}")
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind
        raise CorruptCheckpointError(f"{path / _DCP_METADATA}: the file is truncated or corrupt and cannot be read "
                                     f"({type(e).__name__})") from None


def check_dcp_file_sizes(ckpt_dir: str | os.PathLike, metadata=None) -> None:
    """Checks that every data file named in torch DCP's ``.metadata`` exists and reaches the end of the last chunk
    recorded in it (offset + length), so that no read fails midway through a load. No collective.

    Args:
        ckpt_dir: the checkpoint directory.
        metadata: its ``.metadata`` if already read (:func:`read_dcp_metadata`).

    Raises:
        IncompleteCheckpointError: a file is missing or shorter than needed (names it, its size and the size needed).
    """
    path = Path(ckpt_dir)
    metadata = read_dcp_metadata(path) if metadata is None else metadata
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    problems = []
    for name, need in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing ({_DCP_METADATA} needs {need} bytes of it)")
        elif f.stat().st_size < need:
            problems.append(f"{name} is truncated: {f.stat().st_size} bytes, {_DCP_METADATA} needs {need}")
    if problems:
        raise IncompleteCheckpointError(f"checkpoint directory {path} is incomplete (a save did not finish or a file "
                                        f"was cut short): {'; '.join(problems)}")


def is_our_checkpoint(ckpt_dir: str | os.PathLike) -> bool:
    """Whether ``ckpt_dir`` is a checkpoint written by this package (its completion marker or quantization state is
    there): only such a directory may be replaced by a save."""
    path = Path(ckpt_dir)
    return (path / COMPLETE_MARKER).is_file() or (path / STATE_FILE).is_file()


def _listing(path: Path) -> str:
    names = sorted(p.name for p in path.iterdir())
    shown = ", ".join(names[:5])
    return shown + (f", ... ({len(names)} entries)" if len(names) > 5 else "")


def _replace_problem(path: Path, ours, what: str = "a modelopt_moe checkpoint") -> str | None:
    """Why a save must not remove ``path`` (None: absent, empty, or ``ours(path)``)."""
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_dir():
        return f"{path} exists and is not a directory"
    if next(path.iterdir(), None) is None or ours(path):
        return None
    return f"{path} is not empty and is not {what} (it holds {_listing(path)})"


def _staging_problem(path: Path) -> str | None:
    return _replace_problem(path, _is_staging, "the staging directory of a save")


def _is_staging(path: Path) -> bool:
    """A stale staging directory of ours: nothing in it but what a save writes."""
    return all(p.is_file() and _STAGING_NAME.match(p.name) for p in path.iterdir())


def check_save_target(ckpt_dir: str | os.PathLike, caller: str = "save") -> None:
    """Checks, before anything is written, that a save into ``ckpt_dir`` removes nothing but checkpoints of ours.

    A save replaces ``ckpt_dir`` and removes its siblings ``<ckpt_dir>.tmp`` (a previous save's staging directory)
    and ``<ckpt_dir>.old`` (the previous checkpoint, kept while it is being replaced). Each must be absent, empty, or
    ours: ``ckpt_dir`` and ``.old`` a checkpoint of this package (:func:`is_our_checkpoint`), ``.tmp`` nothing but
    files a save writes. No collective; call it on one rank and share the outcome.

    Args:
        ckpt_dir: the checkpoint directory to save into.
        caller: the function named in the message.

    Raises:
        FileExistsError: names the directory and what it holds, e.g. a Hugging Face model given as the save directory.
    """
    final = Path(ckpt_dir)
    problems = [p for p in (_replace_problem(final, is_our_checkpoint),
                            _staging_problem(_tmp_dir(final)),
                            _replace_problem(_old_dir(final), is_our_checkpoint)) if p]
    if problems:
        raise FileExistsError(f"{caller}: refusing to save into {final}: {'; '.join(problems)}. A save replaces "
                              "the directory; choose another one, or remove it first")


def _tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def _old_dir(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def begin_checkpoint_dir(ckpt_dir: str | os.PathLike) -> Path:
    """Rank 0: creates an empty temporary sibling ``<ckpt_dir>.tmp`` to save into (removing a stale one of ours); every
    rank gets its path. Call :func:`check_save_target` first, then this on every rank, then barrier before writing.

    Raises:
        FileExistsError: (rank 0) ``<ckpt_dir>.tmp`` holds files a save does not write.
    """
    final = Path(ckpt_dir)
    tmp = _tmp_dir(final)
    if rank() == 0:
        if tmp.exists():
            problem = _staging_problem(tmp)
            if problem:
                raise FileExistsError(f"begin_checkpoint_dir: refusing to remove {problem}")
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint_dir(tmp_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, iteration: int | None = None
                          ) -> None:
    """Rank 0, once every rank finished writing into ``tmp_dir``: writes the completion marker (the list of files
    and the training ``iteration``, :func:`checkpoint_iteration`) last, then moves ``tmp_dir`` to ``ckpt_dir``. A
    previous ``ckpt_dir`` is moved aside first and deleted after; should the process die between the two renames,
    :func:`resolve_checkpoint_dir` finds it as ``<ckpt_dir>.old``.

    Raises:
        FileExistsError: (rank 0) ``ckpt_dir`` or ``<ckpt_dir>.old`` is no longer a checkpoint of ours (nothing moved).
    """
    if rank() != 0:
        return
    tmp, final = Path(tmp_dir), Path(ckpt_dir)
    problems = [p for p in (_replace_problem(final, is_our_checkpoint),
                            _replace_problem(_old_dir(final), is_our_checkpoint)) if p]
    if problems:  # check_save_target passed before the save: something else wrote there since
        raise FileExistsError(f"commit_checkpoint_dir: refusing to replace {'; '.join(problems)}; the new "
                              f"checkpoint stays in {tmp}")
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    marker = tmp / COMPLETE_MARKER
    with open(marker.with_suffix(".part"), "w") as f:
        json.dump({"files": files, "iteration": iteration}, f)
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


def checkpoint_iteration(ckpt_dir: str | os.PathLike) -> int | None:
    """The training iteration a complete checkpoint of ours was saved at, read from its completion marker without
    loading anything (None: not recorded). Call :func:`check_checkpoint_dir` first."""
    try:
        iteration = json.loads((Path(ckpt_dir) / COMPLETE_MARKER).read_text()).get("iteration")
    except (OSError, ValueError, AttributeError):
        return None
    return iteration if isinstance(iteration, int) else None


def discard_unfinished_save(ckpt_dir: str | os.PathLike) -> Path | None:
    """Removes ``<ckpt_dir>.tmp``, the staging directory of a save into ``ckpt_dir`` that did not finish, when it
    holds nothing but what a save writes; returns its path if removed. For after an interrupted save, once no process
    writes into it any more (the next save would remove it too)."""
    tmp = _tmp_dir(Path(ckpt_dir))
    if not tmp.is_dir() or _staging_problem(tmp):
        return None
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def check_checkpoint_dir(ckpt_dir: str | os.PathLike, require_state: bool = True) -> Path:
    """Checks that ``ckpt_dir`` holds a complete checkpoint.

    Complete means: the directory exists, torch DCP's ``.metadata`` and Megatron's ``metadata.json`` (each written
    after all data) are present, the quantization state file is present (if ``require_state``), where a completion
    marker exists every file it lists is present with its size, and every data file is as long as ``.metadata``
    needs (:func:`check_dcp_file_sizes`; checkpoints without our marker too).

    A Megatron-LM ``--save`` directory (``latest_checkpointed_iteration.txt`` beside ``iter_0000100/``) stands for
    its latest iteration's directory (:func:`megatron_lm_iteration_dir`).

    Returns:
        The directory as a Path.

    Raises:
        IncompleteCheckpointError: naming the directory and what is missing or too short.
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
    resized = []  # present, but not the size the save wrote
    if marker.is_file():
        for name, size in json.loads(marker.read_text())["files"].items():
            p = path / name
            if not p.is_file():
                missing.append(name)
            elif p.stat().st_size != size:
                cut = "truncated" if p.stat().st_size < size else "changed"
                resized.append(f"{name} is {cut}: {p.stat().st_size} bytes, the save wrote {size}")
    elif path.name.endswith(".tmp"):  # our own save's staging directory: complete only once the marker is written
        missing.append(COMPLETE_MARKER)
    missing = list(dict.fromkeys(missing))
    weights = [n for n in ("model.safetensors", "model.safetensors.index.json") if (path / n).is_file()]
    if missing and weights and (path / "config.json").is_file() and not (path / _DCP_METADATA).is_file():
        raise IncompleteCheckpointError(
            f"{path} is a Hugging Face model (config.json, {weights[0]}), not a distributed checkpoint: read its "
            "weights into a Megatron model with modelopt_moe.export.import_hf (modelopt-moe qat: --hf)")
    if missing or resized:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + resized
        raise IncompleteCheckpointError(
            f"checkpoint directory {path} is incomplete (a save did not finish, or files were removed or cut short): "
            f"{'; '.join(problems)}")
    check_dcp_file_sizes(path)
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
