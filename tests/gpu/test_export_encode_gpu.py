"""Export encoding of a GPU weight whose amaxes come from the CPU (gathered over ranks): the codes and scales equal
those of the same tensors encoded on the CPU, bit for bit (FP8 and NVFP4, both formats)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from modelopt_moe.export.schemes import SCHEMES, encode_linear  # noqa: E402


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_gpu_weight_with_cpu_amax_encodes_as_on_cpu(scheme, fmt):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 128, generator=g) * 0.05).to(torch.bfloat16)
    w_amax, x_amax = w.float().abs().max(), torch.tensor(3.5)
    on_cpu = encode_linear("m", w, w_amax, x_amax, SCHEMES[scheme], fmt)
    on_gpu = encode_linear("m", w.cuda(), w_amax, x_amax, SCHEMES[scheme], fmt)
    assert on_cpu.keys() == on_gpu.keys()
    for name, t in on_cpu.items():
        got = on_gpu[name].cpu()
        assert got.dtype == t.dtype, name
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           t.view(torch.uint8) if t.element_size() == 1 else t), name
