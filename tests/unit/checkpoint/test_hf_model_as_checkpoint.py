"""A Hugging Face model directory given where a distributed checkpoint is expected is named as such, with the call
that reads it (not "incomplete ... a save did not finish")."""

import pytest
from torch import nn

from modelopt_moe.checkpoint import restore_sharded_modelopt_state
from modelopt_moe.checkpoint.errors import IncompleteCheckpointError


def test_restoring_from_a_hugging_face_model_points_to_import_hf(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"]}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(IncompleteCheckpointError) as info:
        restore_sharded_modelopt_state([nn.Linear(4, 4)], tmp_path)
    message = str(info.value)
    assert f"{tmp_path} is a Hugging Face model (config.json, model.safetensors), not a distributed" in message
    assert "modelopt_moe.export.import_hf" in message
    assert "did not finish" not in message
