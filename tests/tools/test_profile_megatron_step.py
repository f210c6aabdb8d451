"""tools/profile_megatron_step.py: the kernel categories, the GPU-busy union and the reports (the profiling itself
needs a GPU; these are the parts that turn a profile into the table)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("profile_megatron_step", ROOT / "tools" / "profile_megatron_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# Kernel names from an H100 profile of the benchmark step (TE 2.20, torch 2.11), each with the category it belongs to.
KERNELS = {
    "_grouped_weight_fake_quant_kernel": "fake quant (ours)",
    "_grouped_weight_amax_kernel": "fake quant (ours)",
    "_grouped_input_fake_quant_kernel": "fake quant (ours)",
    "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT": "GEMM",
    "nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT": "GEMM",
    "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_nt_align1>(...)": "GEMM",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "void transformer_engine::unary_kernel<16, true, float, transformer_engine::Empty, &identity, float, __nv_fp8_e4m3>"
    "(...)": "TE FP8 cast",
    "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, float, long>, ...>": "optimizer",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>": "copy/fill",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ...>>": "elementwise/reduce",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "something_else": "other",
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_fall_in_their_category(tool, name):
    assert tool.category(name) == KERNELS[name]


def test_gpu_busy_is_the_union_of_kernel_intervals(tool):
    # Overlapping (two streams), nested, touching and disjoint intervals.
    assert tool._busy_us([(0, 2), (1, 3), (1.5, 2.5), (3, 4), (10, 11)]) == 5
    assert tool._busy_us([]) == 0


def test_report_has_every_variant_and_the_kernels_that_differ_from_bf16(tool):
    base = {"nvjet_gemm": 5000.0, "_grouped_input_fake_quant_kernel": 0.0}
    quant = {"nvjet_gemm": 5100.0, "_grouped_weight_fake_quant_kernel": 3200.0}
    text = tool.report({"bf16": (140.0, base, 50_000.0), "fp8": (150.0, quant, 54_000.0)}, top=2)
    lines = text.splitlines()
    assert lines[0].split() == ["ms", "per", "step", "bf16", "fp8"]
    assert "GPU busy" in text
    assert "50.00" in text
    assert "54.00" in text
    assert [line.split()[-1] for line in lines if line.startswith("GPU idle")] == ["96.00"]
    assert "fp8 - bf16, ms per step: step +10.00, GPU busy +4.00" in text
    ranked = [line for line in lines if line.startswith("  ")]
    assert ranked[0].split()[0] == "+3.200"
    assert ranked[0].endswith("_grouped_weight_fake_quant_kernel")
    assert ranked[1].split()[0] == "+0.100"
    assert len(ranked) == 2


def test_host_report_ranks_the_functions_that_add_host_time(tool):
    def work(n):
        return sum(i * i for i in range(n))

    def ours():
        work(20_000)

    hosts = {"bf16": tool.host_profile(lambda: work(10), 2), "fp8": tool.host_profile(ours, 2)}
    text = tool.host_report(hosts, top=3)
    assert "fp8 - bf16, host (cProfile) ms per step" in text
    first = next(line for line in text.splitlines() if line.strip().startswith("+"))
    assert "genexpr" in first or "work" in first or "sum" in first, text
