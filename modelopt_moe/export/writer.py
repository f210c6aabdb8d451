"""A Hugging Face checkpoint directory, written all or nothing: safetensors shards, their index and JSON files.

:class:`CheckpointWriter` refuses an output directory that exists and is not empty before it writes anything, writes
into a temporary sibling ``.<name>.incomplete-<pid>``, and renames it to the output directory only when every shard,
the index and ``config.json`` are complete: an interrupted export never leaves a directory that looks complete (the
temporary one is removed when the writer sees the failure; after a crash it stays, with its telling name).

Shards hold at most ``max_shard_bytes`` (a tensor larger than that gets a shard of its own); they are named
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``),
the layout ``transformers.save_pretrained`` writes and every reader loads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .errors import ExportError

__all__ = ["CheckpointWriter", "check_out_dir", "INDEX_FILE"]

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a Path, if it can be written: it does not exist, or is an empty directory.

    Raises:
        ExportError: it exists and is not empty, or is a file.
    """
    path = Path(out_dir)
    if path.exists():
        if not path.is_dir():
            raise ExportError(f"output {path} exists and is not a directory")
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
            raise ExportError(f"output directory {path} exists and is not empty ({shown}); choose a new directory "
                              "or remove it")
    return path


class CheckpointWriter:
    """Writes tensors into shards of a temporary directory; :meth:`commit` moves it into place.

    Use as a context manager: an exception inside removes the temporary directory and leaves ``out_dir`` absent.

    Args:
        out_dir: the final directory (must not exist, or be empty).
        max_shard_bytes: shard size bound.

    Raises:
        ExportError: ``out_dir`` exists and is not empty (before anything is written).
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out_dir = check_out_dir(out_dir)
        self.max_shard_bytes = int(max_shard_bytes)
        self.tmp_dir = self.out_dir.with_name(f".{self.out_dir.name}.incomplete-{os.getpid()}")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self.total_bytes = 0
        self._done = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Adds one tensor (copied to contiguous CPU memory); flushes a shard when full.

        Raises:
            ExportError: the name was already written.
        """
        if name in self._names:
            raise ExportError(f"tensor {name} written twice")
        self._names.add(name)
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file  # the export extra; imported where used

        index = len(self._shards)
        save_file(self._pending, str(self.tmp_dir / f"shard-{index:05d}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def commit(self, config: dict, extra_json: dict[str, dict] | None = None,
               text_files: dict[str, str] | None = None) -> Path:
        """Writes the last shard, renames the shards, writes the index, the extra JSON files, the text files (the
        model card) and ``config.json`` (last), then renames the temporary directory to ``out_dir``.

        Returns:
            The output directory.
        """
        self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.tmp_dir / f"shard-{i:05d}.safetensors", self.tmp_dir / final)
            weight_map.update({name: final for name in names})
        _write_json(self.tmp_dir / INDEX_FILE, {"metadata": {"total_size": self.total_bytes},
                                                "weight_map": dict(sorted(weight_map.items()))})
        for name, payload in (extra_json or {}).items():
            _write_json(self.tmp_dir / name, payload)
        for name, text in (text_files or {}).items():
            _write_text(self.tmp_dir / name, text)
        _write_json(self.tmp_dir / "config.json", config)
        if self.out_dir.exists():  # an empty directory (check_out_dir allowed it): replace it
            self.out_dir.rmdir()
        os.rename(self.tmp_dir, self.out_dir)
        self._done = True
        return self.out_dir

    def abort(self) -> None:
        """Removes the temporary directory (the output directory was never created)."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def _write_json(path: Path, payload: dict) -> None:
    _write_text(path, json.dumps(payload, indent=2, sort_keys=False) + "\n")


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
