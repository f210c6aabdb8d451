"""The weight kernel's launch options (``modelopt_moe.kernels.tuning``): every option gives the bits of the reference,
an override reaches the launch, and bad options fail where they are set."""

import pytest
import torch
from test_grouped_fake_quant import (
    FORMATS,
    RAGGED,
    assert_bits_equal,
    distinct_amax,
    make_experts,
    needs_triton,
    reference,
)

from modelopt_moe import kernels as K
from modelopt_moe.kernels import tuning


@pytest.fixture(autouse=True)
def _shipped_options():
    tuning.reset_weight_kernel_config()
    K.clear_table_cache()
    yield
    tuning.reset_weight_kernel_config()
    K.clear_table_cache()


VARIANTS = [
    {"tile": 1024, "warps": 2},
    {"tile": 8192, "warps": 8, "lean": False},
    {"uniform": False, "even": False},
    {"even": False, "hw_cvt": False, "fast_max": False},
]


@needs_triton
@pytest.mark.parametrize("options", VARIANTS, ids=str)
@pytest.mark.parametrize("shapes", [[(8, 64)] * 3, RAGGED[:3]], ids=["uniform", "ragged"])
def test_every_option_gives_the_reference_bits(options, shapes):
    weights = make_experts(shapes, torch.bfloat16)
    amax = distinct_amax(weights)
    tuning.set_weight_kernel_config(**options)
    for fmt, bs in FORMATS:
        outs = K.grouped_weight_fake_quant(weights, amax, fmt, bs)
        for got, want in zip(outs, reference(weights, amax, fmt, bs), strict=True):
            assert_bits_equal(got, want, f"{fmt} {bs} {options}")


def test_a_format_override_replaces_the_shared_one_for_that_format_only():
    tuning.set_weight_kernel_config(tile=1024, warps=8)
    tuning.set_weight_kernel_config("nvfp4", tile=512)
    assert tuning.weight_kernel_config("e4m3")["tile"] == 1024
    assert tuning.weight_kernel_config("e4m3")["warps"] == 8
    assert tuning.weight_kernel_config("nvfp4")["tile"] == 512
    assert tuning.weight_kernel_config("nvfp4")["warps"] == tuning.WEIGHT_KERNEL_DEFAULTS["warps"]
    tuning.reset_weight_kernel_config()
    assert dict(tuning.weight_kernel_config("e4m3")) == dict(tuning.WEIGHT_KERNEL_DEFAULTS)
    assert tuning.weight_kernel_config("nvfp4")["tile"] == 2048  # the shipped NVFP4 tile


@needs_triton
def test_the_tile_option_reaches_the_launch():
    from modelopt_moe.kernels import launch

    weights = make_experts([(8, 64)] * 2, torch.float32)
    amax = distinct_amax(weights)
    tuning.set_weight_kernel_config("e4m3", tile=256)
    K.grouped_weight_fake_quant(weights, amax, "e4m3")
    assert [key[-1] for key in launch._plan_cache] == [256]


@pytest.mark.parametrize(
    ("fmt", "options", "match"),
    [
        ("*", {"tiles": 1024}, "unknown option 'tiles'"),
        ("*", {"tile": 1000}, "tile must be a power of two"),
        ("*", {"warps": True}, "warps must be a power of two"),
        ("*", {"even": 1}, "even must be a bool"),
        ("e9m9", {"tile": 1024}, "e9m9"),
    ],
)
def test_bad_options_are_refused(fmt, options, match):
    with pytest.raises(ValueError, match=match):
        tuning.set_weight_kernel_config(fmt, **options)
    assert dict(tuning.weight_kernel_config("e4m3")) == dict(tuning.WEIGHT_KERNEL_DEFAULTS)
