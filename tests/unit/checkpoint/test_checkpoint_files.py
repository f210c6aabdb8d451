"""Damaged checkpoint files and wrong paths, the way a user meets them: plain ``save`` / ``restore`` and a torch DCP
checkpoint. Each error names the file and changes nothing; none advises unsafe unpickling."""

import hashlib
import traceback

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    check_dcp_file_sizes,
    restore,
    save,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__name__};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _refused(fn, model, path):
    """The formatted error (what the user reads) and whether the model and the file are as before."""
    before = (_digest(model), path.read_bytes() if path.is_file() else None)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the callers assert the class and message
        fn()
    after = (_digest(model), path.read_bytes() if path.is_file() else None)
    return info.value, "".join(traceback.format_exception(info.value)), before == after


@pytest.fixture
def saved(tmp_path):
    model = mtq.quantize(_model(), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 16)))
    save(model, tmp_path / "model.pt")
    return (tmp_path / "model.pt").read_bytes()


@pytest.mark.parametrize("cut", [0.5, 0.995])  # torch raises a RuntimeError, then an OSError (Errno 22)
def test_restore_of_a_truncated_file_names_it(tmp_path, saved, cut):
    path = tmp_path / "truncated.pt"
    path.write_bytes(saved[: int(len(saved) * cut)])
    fresh = _model()
    error, shown, unchanged = _refused(lambda: restore(fresh, path), fresh, path)
    assert isinstance(error, CorruptCheckpointError), shown
    assert str(path) in str(error), shown
    assert "truncated or corrupt" in str(error), shown
    assert "weights_only" not in shown, shown
    assert unchanged


def test_restore_of_a_damaged_file_names_it_and_never_advises_unsafe_loading(tmp_path, saved):
    path = tmp_path / "damaged.pt"
    path.write_bytes(b"\x80\x02" + bytes(range(256)) * (len(saved) // 256))
    fresh = _model()
    error, shown, unchanged = _refused(lambda: restore(fresh, path), fresh, path)
    assert isinstance(error, CorruptCheckpointError), shown
    assert str(path) in str(error), shown
    assert "weights_only" not in shown, shown
    assert "arbitrary code" not in shown, shown
    assert unchanged


def test_restore_of_a_pickled_module_names_its_class(tmp_path):
    path = tmp_path / "pickled.pt"
    torch.save(_model(), path)
    fresh = _model()
    error, shown, unchanged = _refused(lambda: restore(fresh, path), fresh, path)
    assert isinstance(error, CheckpointMismatchError), shown
    assert str(path) in str(error), shown
    assert "torch.nn.modules.container.Sequential" in str(error), shown
    assert "weights_only" not in shown, shown
    assert unchanged


def test_save_into_a_directory_writes_nothing(tmp_path):
    target = tmp_path / "hf_model"
    target.mkdir()
    (target / "config.json").write_text("{}")
    model = mtq.quantize(_model(), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 16)))
    with pytest.raises(IsADirectoryError, match=r"hf_model is a directory; give the path of the file"):
        save(model, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
    assert [p.name for p in target.iterdir()] == ["config.json"]


def test_dcp_data_file_shorter_than_its_metadata_needs_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, checkpoint_id=str(tmp_path))
    check_dcp_file_sizes(tmp_path)  # complete
    (data,) = tmp_path.glob("*.distcp")
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size - 100])
    with pytest.raises(IncompleteCheckpointError, match=rf"{data.name} is truncated: {size - 100} bytes, "
                                                        rf"\.metadata needs {size}"):
        check_dcp_file_sizes(tmp_path)
    data.unlink()
    with pytest.raises(IncompleteCheckpointError, match=rf"{data.name} is missing"):
        check_dcp_file_sizes(tmp_path)
