"""The published MXFP4 layout of fused 3-D experts (gpt-oss, ``quant_method: mxfp4``), checked against transformers'
own decoder (``transformers.integrations.mxfp4.convert_moe_packed_tensors``, what ``Mxfp4Config(dequantize=True)``
loads with): our decoder gives its bits for every byte of codes and every E8M0 scale, and what we encode decodes there
to training's MXFP4 fake quant of each expert, bit for bit."""

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from modelopt_moe.export import fused_mxfp4
from modelopt_moe.export.errors import ExportError
from modelopt_moe.numerics import fake_quant

NAME = "model.layers.0.mlp.experts.gate_up_proj"


def _transformers(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 ``[E, in, out]`` weight transformers decodes from the files' tensors."""
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def test_decode_is_transformers_decode_for_every_code_byte_and_scale():
    e, n, groups = 3, 256, 2
    blocks = torch.arange(256, dtype=torch.uint8).repeat(e * n * groups * 16 // 256).reshape(e, n, groups, 16)
    blocks = blocks[:, torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    scales = torch.arange(e * n * groups).remainder(255).to(torch.uint8).reshape(e, n, groups)  # 0..254
    ours = fused_mxfp4.decode_experts(blocks, scales, NAME)
    assert ours.shape == (e, n, groups * 32)
    theirs = _transformers(blocks, scales)
    assert torch.equal(ours.transpose(1, 2).view(torch.int32), theirs.view(torch.int32))  # -0.0 and subnormals too


def test_encoded_experts_decode_in_transformers_to_training_fake_quant():
    g = torch.Generator().manual_seed(1)
    e, n, k = 4, 48, 96
    w = torch.randn(e, n, k, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 2.0**-120]).reshape(e, 1, 1)
    w[1, 3, :32] = 0.0  # an all-zero block
    w[2, 5, 7] = -0.0
    for dtype in (torch.float32, torch.bfloat16):
        x = w.to(dtype)
        blocks, scales = fused_mxfp4.encode_experts(x, NAME)
        assert blocks.dtype == scales.dtype == torch.uint8
        assert (blocks.shape, scales.shape) == fused_mxfp4.packed_shapes((e, k, n))
        trained = torch.stack([fake_quant(x[i], "mxfp4", None, 32) for i in range(e)]).float()
        assert torch.equal(_transformers(blocks, scales), trained.transpose(1, 2))
        assert torch.equal(fused_mxfp4.decode_experts(blocks, scales, NAME), trained)


def test_a_nan_scale_and_unpaired_tensors_are_refused_naming_the_tensor():
    blocks = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    scales = torch.full((2, 4, 1), 127, dtype=torch.uint8)
    scales[1, 2, 0] = 255
    with pytest.raises(ExportError, match=f"{NAME}_scales: holds 255, E8M0's NaN"):
        fused_mxfp4.decode_experts(blocks, scales, NAME)
    with pytest.raises(ExportError, match=f"{NAME}: _blocks of shape .* and _scales of shape .* do not pair"):
        fused_mxfp4.decode_experts(blocks, scales[:, :3], NAME)
    with pytest.raises(ExportError, match=r"\[1\]: the weight holds NaN"):
        fused_mxfp4.encode_experts(torch.tensor([[[0.0] * 32], [[float("nan")] * 32]]), NAME)
