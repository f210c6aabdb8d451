"""MXFP4 and MXFP8 against what NVIDIA Model Optimizer 0.47 itself produced (tests/fixtures/modelopt_0_47/mx.pt.xz,
made by tools/make_modelopt_fixtures.py; Model Optimizer is not needed here): its MX presets as users pass them, the
state of its MX quantizer, and its CPU MX exporters' E8M0 scales and values. Its MX fake quant is a CUDA extension:
tests/gpu/test_mx_gpu.py compares against it on the GPU."""

import copy
import io
import lzma
from pathlib import Path

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant, quantize
from modelopt_moe.quantization.config import to_config

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "modelopt_0_47" / "mx.pt.xz"
MX = [("MXFP4_DEFAULT_CFG", "mxfp4"), ("MXFP8_DEFAULT_CFG", "mxfp8")]


@pytest.fixture(scope="module")
def fixture():
    return torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=True)


def mx_input() -> torch.Tensor:
    """tools/make_modelopt_fixtures.py's ``mx_input``: the same bits from the same seed."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64).unsqueeze(-1)


@pytest.mark.parametrize(("name", "fmt"), MX)
def test_model_optimizers_mx_presets_validate_and_name_the_mx_formats(fixture, name, fmt):
    theirs = fixture["presets"][name]
    cfg = to_config(copy.deepcopy(theirs))
    for kind in ("weight_quantizer", "input_quantizer"):
        q = cfg.resolve(f"fc.{kind}", ("Linear",))
        assert q.format == fmt
        assert q.block_size is None  # the MX block of 32 is implied, as NVFP4's 16
    ours = getattr(mtq, name)
    for kind in ("*weight_quantizer", "*input_quantizer"):
        mine = next(e["cfg"] for e in ours["quant_cfg"] if e["quantizer_name"] == kind)
        their = next(e["cfg"] for e in theirs["quant_cfg"] if e["quantizer_name"] == kind)
        assert (mine["num_bits"], mine["block_sizes"]) == (their["num_bits"], their["block_sizes"])


@pytest.mark.parametrize(("name", "fmt"), MX)
def test_model_optimizers_mx_quantizer_state_loads_and_ours_writes_its_attributes(fixture, name, fmt):
    theirs = fixture["quantizer_state"][name]
    q = mtq.TensorQuantizer()
    q.set_from_modelopt_state(theirs)
    assert q.fmt == fmt
    assert q.amax is None
    mine = q.get_modelopt_state()
    for key in ("_num_bits", "_block_sizes", "_axis", "_dynamic", "_pass_through_bwd", "_disabled"):
        assert mine[key] == theirs[key], key


@pytest.mark.parametrize(("name", "fmt"), MX)
def test_model_optimizers_cpu_exporters_give_our_exponents_and_values(fixture, name, fmt):
    # Continuous data: no E2M1 ties, where its MXFP4 exporter (toward zero) and its fake quant (to even) differ.
    x = mx_input()
    theirs = fixture["exporters"][fmt]
    assert torch.equal((theirs["e8m0"].to(torch.int32) - 127).reshape(-1),
                       (-torch.log2(quantize(x, fmt).scale)).reshape(-1).to(torch.int32))
    assert torch.equal(fake_quant(x, fmt).view(torch.int32), theirs["values"].view(torch.int32))
