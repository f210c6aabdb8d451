"""``modelopt_moe.checkpoint.restore`` is all or nothing: a file that does not fit the model leaves the model exactly
as it was (not converted, no weight overwritten), for this package's files and Model Optimizer's (public API only, as
a user's script calls it)."""

import hashlib

import pytest
import torch
from torch import nn

import modelopt_moe.checkpoint as mto
import modelopt_moe.quantization as mtq
from modelopt_moe.checkpoint import CheckpointMismatchError


def fingerprint(model: nn.Module) -> tuple:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), [(n, type(m).__name__, sorted(m._modules)) for n, m in model.named_modules()]


def saved(tmp_path, widths):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, widths[0]), nn.ReLU(), nn.Linear(widths[0], widths[1]))
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 32)))
    path = tmp_path / "model.pt"
    mto.save(model, path)
    return path


@pytest.mark.parametrize("widths", [(48, 16), (32, 24)], ids=["another-hidden-size", "another-output-size"])
def test_a_file_of_another_shape_names_the_tensor_and_changes_nothing(tmp_path, widths):
    path = saved(tmp_path, widths)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    before = fingerprint(model)
    with pytest.raises(CheckpointMismatchError, match=r"weight: the model has \(\d+, \d+\), the checkpoint"):
        mto.restore(model, path)
    assert fingerprint(model) == before


def test_a_file_of_another_architecture_leaves_the_model_unconverted(tmp_path):
    path = saved(tmp_path, (32, 16))
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    before = fingerprint(model)
    with pytest.raises(CheckpointMismatchError, match="quantizers do not fit the model"):
        mto.restore(model, path)
    assert fingerprint(model) == before
    assert not list(mtq.named_quantizers(model))
    # The model is still a plain model that can be quantized.
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 32)))
