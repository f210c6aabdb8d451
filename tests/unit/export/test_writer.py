"""The checkpoint writer (modelopt_moe/export/writer.py, hf_checkpoint.py): all or nothing.

A non-empty output directory is refused before anything is written; an export interrupted at any point (an exception
from the model's tensors, a weight that cannot be encoded, a failing disk) leaves neither the output directory nor
its temporary sibling; a complete one has shards, an index and ``config.json`` that ``transformers`` loads.
"""

import json

import pytest
import torch

from modelopt_moe.export import ExportError, get_family
from modelopt_moe.export.families import MoEArch, canonical_names
from modelopt_moe.export.hf_checkpoint import HfCheckpointReader, LinearRecord, TensorRecord, write_hf_checkpoint
from modelopt_moe.export.schemes import LinearQuant, QuantSpec
from modelopt_moe.export.writer import INDEX_FILE, CheckpointWriter

ARCH = MoEArch(family="qwen3_moe", vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=2,
               num_kv_heads=1, head_dim=16, moe_ffn_hidden_size=16, num_experts=2, top_k=1, norm_eps=1e-6,
               rope_theta=1e4, max_position_embeddings=32, qk_norm=True)
SHAPES = {"q_proj": (32, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 32), "router": (2, 32),
          "gate": (16, 32), "up": (16, 32), "down": (32, 16), "embed_tokens": (32, 32), "lm_head": (32, 32)}


def _leftovers(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def _shape(canonical):
    kind = canonical.rsplit(".", 1)[-1]
    return SHAPES.get(kind, (16,) if kind in ("q_norm", "k_norm") else (32,))


def _records(quant: LinearQuant, nan_at: str | None = None, fail_at: int | None = None):
    """The tiny model's tensors as canonical records, one group per layer (as an adapter yields them)."""
    g = torch.Generator().manual_seed(0)
    groups: dict[str, list] = {}
    for name in canonical_names(ARCH):
        label = "layer " + name.split(".")[1] if name.startswith("layers.") else name
        t = torch.randn(_shape(name), generator=g) * 0.1
        if name == nan_at:
            t[0, 0] = float("nan")
        if t.dim() == 1 or name == "embed_tokens":
            rec = TensorRecord(name, t)
        else:
            q = quant if name.rsplit(".", 1)[-1] not in ("router", "lm_head") else LinearQuant()
            rec = LinearRecord(name, t, q, t.abs().amax(), torch.tensor(1.0))
        groups.setdefault(label, []).append(rec)

    def gen():
        for i, (label, recs) in enumerate(groups.items()):
            if i == fail_at:
                raise RuntimeError("the adapter failed while gathering")
            yield label, iter(recs)
    return gen(), len(groups)


NVFP4 = LinearQuant(QuantSpec("nvfp4"), QuantSpec("nvfp4"))


def _write(out, fmt="compressed-tensors", quant=NVFP4, **kw):
    groups, n = _records(quant, **kw)
    return write_hf_checkpoint(out, arch=ARCH, family=get_family("qwen3_moe"), fmt=fmt,
                               linear_quants={c: (quant if not c.endswith(("router", "lm_head")) else LinearQuant())
                                              for c in canonical_names(ARCH) if c != "embed_tokens"
                                              and not c.endswith(("norm", "norm"))}, groups=groups, num_groups=n,
                               progress=False)


def test_non_empty_output_is_refused_before_writing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"output directory .*out exists and is not empty \(keep.txt\)"):
        _write(out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert _leftovers(out) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="exists and is not a directory"):
        CheckpointWriter(tmp_path / "file")


def test_empty_existing_directory_is_used(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _write(out)
    assert {"config.json", INDEX_FILE, "README.md"} <= {p.name for p in out.iterdir()}  # the model card too
    assert _leftovers(out) == []


@pytest.mark.parametrize("fail_at", [0, 2])
def test_interrupted_export_leaves_nothing_that_looks_complete(tmp_path, fail_at):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="failed while gathering"):
        _write(out, fail_at=fail_at)
    assert not out.exists()
    assert _leftovers(out) == []


def test_a_weight_that_cannot_be_encoded_aborts_the_export(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"layer 1: model.layers.1.mlp.experts.0.up_proj.weight: the weight holds "
                                          "NaN"):
        _write(out, nan_at="layers.1.experts.0.up")
    assert not out.exists()
    assert _leftovers(out) == []


def test_a_failing_disk_aborts_the_export(tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls = {"n": 0}
    real_add = CheckpointWriter.add

    def add(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError(28, "No space left on device")
        real_add(self, name, tensor)

    monkeypatch.setattr(CheckpointWriter, "add", add)
    with pytest.raises(ExportError, match="OSError: .*No space left on device"):
        _write(out)
    assert not out.exists()
    assert _leftovers(out) == []


def test_missing_tensors_are_an_adapter_error(tmp_path):
    out = tmp_path / "out"
    groups, n = _records(NVFP4)
    truncated = ((label, recs) for label, recs in groups if label != "norm")
    with pytest.raises(ExportError, match=r"gave no tensor for 1 names .*\['norm'\]"):
        write_hf_checkpoint(out, arch=ARCH, family=get_family("qwen3_moe"), fmt="hf", linear_quants={},
                            groups=truncated, num_groups=n, progress=False)
    assert not out.exists()
    assert _leftovers(out) == []


def test_shards_index_and_reader(tmp_path):
    out = tmp_path / "out"
    groups, n = _records(LinearQuant())
    with CheckpointWriter(out, max_shard_bytes=4096) as w:
        for _, recs in groups:
            for r in recs:
                w.add(get_family("qwen3_moe").hf_module(r.canonical) + ".weight",
                      r.tensor if isinstance(r, TensorRecord) else r.weight)
        w.commit(get_family("qwen3_moe").hf_config(ARCH))
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted({v for v in index["weight_map"].values()})
    assert len(shards) > 3
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {p.name for p in out.iterdir()} == {*shards, INDEX_FILE, "config.json"}
    reader = HfCheckpointReader(out)
    assert reader.shape("layers.1.experts.1.down") == (32, 16)
    assert torch.equal(reader.get_rows("lm_head", 3, 5), reader.get("lm_head")[3:5])
    assert torch.equal(reader.get_cols("layers.0.o_proj", 8, 24), reader.get("layers.0.o_proj")[:, 8:24])


def test_reader_refuses_quantized_and_mismatched_checkpoints(tmp_path):
    out = tmp_path / "q"
    _write(out)
    with pytest.raises(ExportError, match="a quantized checkpoint .*compressed-tensors"):
        HfCheckpointReader(out)
    plain = tmp_path / "plain"
    groups, n = _records(LinearQuant())
    write_hf_checkpoint(plain, arch=ARCH, family=get_family("qwen3_moe"), fmt="hf", linear_quants={},
                        groups=groups, num_groups=n, progress=False)
    cfg = json.loads((plain / "config.json").read_text())
    for experts, match in ((3, r"missing \['model.layers.0.mlp.experts.2.down_proj.weight'"),
                           (1, r"missing \[\], unexpected \['model.layers.0.mlp.experts.1")):
        (plain / "config.json").write_text(json.dumps({**cfg, "num_experts": experts}))
        with pytest.raises(ExportError, match=match):
            HfCheckpointReader(plain)
