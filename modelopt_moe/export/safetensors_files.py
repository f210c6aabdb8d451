"""A Hugging Face checkpoint's files checked from their headers alone: the index, every shard it names, and each
tensor's name, dtype, shape and byte range. No tensor data is read.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets counted from the end of the header), then the data.
Those few bytes per shard are enough to refuse a missing or truncated shard, a tensor the index names but its shard
lacks, and a tensor of the wrong shape or dtype, before an import writes anything into a model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ExportError
from .writer import INDEX_FILE

__all__ = ["TensorHeader", "read_header", "read_weight_map", "check_tensors", "FLOAT_DTYPES"]

FLOAT_DTYPES = ("BF16", "F16", "F32")  # what an unquantized checkpoint holds
# Bytes per element of the safetensors dtype names (to check each tensor's byte range).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's header entry: dtype name (``BF16``), shape, and absolute byte range in its file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | os.PathLike) -> dict[str, TensorHeader]:
    """The tensors a safetensors file declares, from its header (the data is not read).

    Raises:
        ExportError: the file is missing, unreadable, truncated (shorter than its header says), or its header is
            not a safetensors header (names the file and what is wrong).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ExportError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise ExportError(f"{path}: a header of {n} bytes does not fit the file's {size} bytes (truncated, "
                                  "or not a safetensors file)")
            raw = f.read(n)
    except FileNotFoundError:
        raise ExportError(f"{path}: no such file") from None
    except OSError as e:
        raise ExportError(f"{path}: cannot be read: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: the safetensors header is not valid JSON ({e}): the file is corrupt") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path}: the safetensors header is not a JSON object: the file is corrupt")
    start, out = 8 + n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(x) for x in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ExportError(f"{path}: tensor {name}: malformed header entry {entry!r}: the file is corrupt") from None
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise ExportError(f"{path}: tensor {name}: {end - begin} bytes for {dtype} {list(shape)}, expected "
                              f"{math.prod(shape) * itemsize}: the file is corrupt")
        out[name] = TensorHeader(dtype, shape, start + begin, start + end)
    needed = max((t.end for t in out.values()), default=start)
    if needed > size:
        last = max(out.items(), key=lambda kv: kv[1].end)[0]
        raise ExportError(f"{path}: truncated: {size} bytes, but its header places tensor {last} up to byte "
                          f"{needed}")
    return out


def read_weight_map(hf_dir: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> shard file name: the index's ``weight_map``, or every tensor of a lone ``model.safetensors``.

    Raises:
        ExportError: neither file exists, or the index is not valid (names the file).
    """
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ExportError(f"{index}: cannot be read as JSON: {e}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ExportError(f"{index}: no 'weight_map' of tensor name -> file name")
        return dict(weight_map)
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return {name: single.name for name in read_header(single)}
    raise ExportError(f"{hf_dir}: no model.safetensors or {INDEX_FILE}")


def check_tensors(hf_dir: str | os.PathLike, weight_map: dict[str, str], expected: dict[str, tuple[int, ...]],
                  dtypes: tuple[str, ...] = FLOAT_DTYPES) -> dict[str, TensorHeader]:
    """Checks, from the headers of every shard ``weight_map`` names, that each tensor of ``expected`` is in the
    shard the map places it in, with the expected shape and one of ``dtypes``.

    Args:
        hf_dir: the checkpoint directory.
        weight_map: tensor name -> file name (:func:`read_weight_map`); must hold every name of ``expected``.
        expected: tensor name -> shape.
        dtypes: the allowed safetensors dtype names.

    Returns:
        The header entry of every tensor of ``expected``.

    Raises:
        ExportError: every problem found (up to a few named): a missing, unreadable or truncated shard, a tensor its
            shard lacks, a wrong shape or dtype (names the file, the tensor, what was expected and what was found).
    """
    hf_dir = Path(hf_dir)
    problems, headers, found = [], {}, {}
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    for file, names in sorted(files.items()):
        path = hf_dir / file
        if not path.is_file():
            problems.append(f"{path} is missing ({INDEX_FILE} places {len(names)} tensors there, e.g. {names[0]})")
            continue
        try:
            headers[file] = read_header(path)
        except ExportError as e:
            problems.append(str(e))
    for name, shape in expected.items():
        header = headers.get(weight_map[name])
        if header is None:
            continue  # the file's own problem is listed
        path = hf_dir / weight_map[name]
        t = header.get(name)
        if t is None:
            problems.append(f"{path} has no tensor {name} ({INDEX_FILE} places it there)")
            continue
        if t.shape != tuple(shape):
            problems.append(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} (from "
                            "config.json)")
        if t.dtype not in dtypes:
            problems.append(f"{path}: tensor {name} has dtype {t.dtype}, expected one of {', '.join(dtypes)}")
        found[name] = t
    if problems:
        shown = "; ".join(problems[:6]) + (f"; ... ({len(problems)} problems)" if len(problems) > 6 else "")
        raise ExportError(f"{hf_dir}: the checkpoint's files do not hold the tensors its config needs: {shown}")
    return found
