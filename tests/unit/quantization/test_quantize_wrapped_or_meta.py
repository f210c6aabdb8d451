"""``mtq.quantize`` of a model that is already wrapped (torch's ``DataParallel`` / ``DistributedDataParallel``;
Megatron's wrappers in tests/distributed/test_checkpoint_safety.py) is refused, naming the wrapper and saying to
quantize before wrapping; on the meta device, calibration is refused naming the tensor, and quantizing without
calibration converts the model, prints, and calibrates once it is materialised (public API only, as a user's script
calls it)."""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def calib(model):
    model(torch.randn(8, 32, generator=torch.Generator().manual_seed(1)))


def test_a_model_wrapped_in_data_parallel_is_refused_naming_the_wrapper():
    model = build()
    wrapped = nn.DataParallel(model)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"already wrapped in DataParallel; quantize it before wrapping") as info:
        mtq.quantize(wrapped, mtq.FP8_DEFAULT_CFG, calib)
    assert "Nothing was changed" in str(info.value)
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, calib)  # the documented order works: quantize, then wrap
    nn.DataParallel(model)


def test_a_model_wrapped_in_torch_ddp_is_refused_naming_the_wrapper():
    script = (
        "import os, torch, torch.distributed as dist\n"
        "import modelopt_moe.quantization as mtq\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8)))\n"
        "try:\n"
        "    mtq.quantize(ddp, mtq.FP8_DEFAULT_CFG, lambda m: m(torch.randn(2, 8)))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mtq.quantize: the model is already wrapped in DistributedDataParallel; quantize it before wrapping" \
        in done.stdout, done.stdout


def test_calibrating_on_the_meta_device_is_refused_naming_the_tensor():
    with torch.device("meta"):
        model = build()
    with pytest.raises(ValueError, match=r"mtq.quantize: 0.weight is on the meta device; calibration needs the real"):
        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, calib)
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())
    print(model)


def test_on_the_meta_device_quantize_without_calibration_prints_and_calibrates_once_materialised(capsys):
    reference = mtq.quantize(build(), mtq.FP8_DEFAULT_CFG, calib)
    with torch.device("meta"):
        model = build()
    mtq.quantize(model, {**mtq.FP8_DEFAULT_CFG, "algorithm": None})
    print(model)
    mtq.print_quant_summary(model)
    assert "QuantLinear" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"mtq.calibrate: 0.weight is on the meta device"):
        mtq.calibrate(model, "max", calib)
    model.to_empty(device="cpu")
    model.load_state_dict(build().state_dict(), strict=False)  # the weights (no amax yet)
    mtq.calibrate(model, "max", calib)
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_amaxes_on_the_meta_device_print():
    model = mtq.quantize(build(), mtq.FP8_DEFAULT_CFG, calib).to("meta")
    assert "amax[()] on meta" in repr(model)
    assert "amax[()] on meta" in mtq.print_quant_summary(model, file=False)
