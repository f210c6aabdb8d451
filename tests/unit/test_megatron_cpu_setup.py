"""``enable_cpu_megatron()``: what Megatron finds on a machine without CUDA once it ran (in a fresh interpreter: it
changes the process for good). Megatron itself training, saving and loading under it: tests/distributed/test_readme.py
runs the README's Megatron snippet, which calls it."""

import subprocess
import sys

import pytest
import torch


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a no-op where CUDA is available")
def test_cuda_calls_land_on_the_cpu_and_gpu_only_packages_look_uninstalled():
    done = subprocess.run([sys.executable, "-c", """
import importlib.util, sys, types
import torch
from modelopt_moe.plugins.megatron_cpu import enable_cpu_megatron

# A GPU-only package imported first is refused, saying what to do (a module object stands in for an Apex imported
# before the setup: Apex is not installed here).
sys.modules["apex"] = types.ModuleType("apex")
try:
    enable_cpu_megatron()
    raise SystemExit("not refused")
except RuntimeError as e:
    assert "apex was imported before the CPU setup" in str(e) and "enable_cpu_megatron() first" in str(e), e
del sys.modules["apex"]

assert enable_cpu_megatron() is True and enable_cpu_megatron() is True  # idempotent
for name in ("transformer_engine", "apex"):  # as if not installed: Megatron takes its torch code
    assert importlib.util.find_spec(name) is None, name
    try:
        __import__(name)
        raise SystemExit(f"{name} imported")
    except ModuleNotFoundError:
        pass
assert str(torch.cuda.current_device()) == "cpu"
x = torch.ones(2, device="cuda")  # Megatron's optimizers allocate with a literal device="cuda"
assert x.device.type == "cpu" and x.cuda() is x and x.type() == "torch.cuda.FloatTensor"
torch.cuda.synchronize()
torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
print("ok")
"""], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok", done.stderr[-3000:]
