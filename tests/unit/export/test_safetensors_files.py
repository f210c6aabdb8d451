"""A checkpoint's files checked from their headers (modelopt_moe/export/safetensors_files.py): every way a shard can
be broken is named (file, tensor, expected, found) without reading tensor data; a sound file reads back the same
shapes, dtypes and byte ranges as the safetensors library."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_moe.export import ExportError
from modelopt_moe.export.safetensors_files import check_tensors, read_header, read_weight_map

TENSORS = {"a.weight": torch.zeros(4, 8, dtype=torch.bfloat16), "b.weight": torch.ones(3, dtype=torch.float32)}


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "model-00001-of-00002.safetensors"
    save_file(TENSORS, path, metadata={"format": "pt"})
    return path


def test_a_sound_header_matches_the_library(shard):
    header = read_header(shard)
    assert {k: (v.dtype, v.shape) for k, v in header.items()} == {"a.weight": ("BF16", (4, 8)),
                                                                  "b.weight": ("F32", (3,))}
    with safe_open(str(shard), "pt") as f:
        for name, t in header.items():
            assert tuple(f.get_slice(name).get_shape()) == t.shape
    assert max(t.end for t in header.values()) == shard.stat().st_size


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[:-1], r"truncated: 243 bytes, but its header places tensor a.weight up to byte 244"),
    (lambda b: b[:5], "5 bytes, too short for a safetensors file"),
    (lambda b: struct.pack("<Q", 10**6) + b[8:], "a header of 1000000 bytes does not fit the file's"),
    (lambda b: b[:8] + b"X" + b[9:], "the safetensors header is not valid JSON"),
    (lambda b: b.replace(b'"shape":[4,8]', b'"shape":[4,9]'),
     r"tensor a.weight: 64 bytes for BF16 \[4, 9\], expected 72"),
])
def test_a_damaged_file_is_named_with_what_is_wrong(shard, damage, message):
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(ExportError, match=message) as info:
        read_header(shard)
    assert str(shard) in str(info.value)


def test_check_tensors_names_every_problem(shard, tmp_path):
    weight_map = {"a.weight": shard.name, "b.weight": shard.name, "c.weight": "model-00002-of-00002.safetensors",
                  "d.weight": shard.name}
    expected = {"a.weight": (4, 8), "b.weight": (2,), "c.weight": (1,), "d.weight": (1,)}
    with pytest.raises(ExportError) as info:
        check_tensors(tmp_path, weight_map, expected, dtypes=("BF16",))
    message = str(info.value)
    for part in (f"{tmp_path}/model-00002-of-00002.safetensors is missing (model.safetensors.index.json places 1 "
                 "tensors there, e.g. c.weight)",
                 f"{shard}: tensor b.weight has shape [3], expected [2]",
                 f"{shard}: tensor b.weight has dtype F32, expected one of BF16",
                 f"{shard} has no tensor d.weight"):
        assert part in message, (part, message)
    found = check_tensors(tmp_path, {"a.weight": shard.name}, {"a.weight": (4, 8)})
    assert found["a.weight"].shape == (4, 8)


def test_weight_map_from_the_index_or_a_lone_file(tmp_path, shard):
    with pytest.raises(ExportError, match="no model.safetensors or model.safetensors.index.json"):
        read_weight_map(tmp_path)
    shard.rename(tmp_path / "model.safetensors")
    assert read_weight_map(tmp_path) == {"a.weight": "model.safetensors", "b.weight": "model.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ExportError, match="model.safetensors.index.json: cannot be read as JSON"):
        read_weight_map(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ExportError, match="no 'weight_map'"):
        read_weight_map(tmp_path)
