"""The presets shipped in ``configs/`` (package data ``modelopt_moe.configs``) and how a bare name finds one."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["PRESET_FILES", "preset_path", "find_preset", "preset_names"]

PRESET_FILES = {
    "FP8_DEFAULT_CFG": "fp8_default.yaml",
    "NVFP4_DEFAULT_CFG": "nvfp4_default.yaml",
    "MXFP4_DEFAULT_CFG": "mxfp4_default.yaml",
    "MXFP8_DEFAULT_CFG": "mxfp8_default.yaml",
    "INT8_DEFAULT_CFG": "int8_default.yaml",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": "int4_blockwise_weight_only.yaml",
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": "fp8_block_weight_only.yaml",
    "FP8_BLOCKWISE_W8A8_CFG": "fp8_block_w8a8.yaml",
    "NVFP4_EXPERTS_FP8_CFG": "nvfp4_experts_fp8.yaml",
    "NVFP4_EXPERTS_FP8_ATTN_FP8_KV_CFG": "nvfp4_experts_fp8_attn_fp8_kv.yaml",
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG": "nvfp4_w4a4_weight_mse_fp8_sweep.yaml",
    "NVFP4_FOUR_OVER_SIX_CFG": "nvfp4_four_over_six.yaml",
    "NVFP4_4OVER6_CFG": "nvfp4_4over6.yaml",
    "FP8_KV_CFG": "fp8_kv.yaml",
    "NVFP4_KV_CFG": "nvfp4_kv.yaml",
}


def preset_path(name: str) -> Path:
    """Path of a YAML file shipped in ``configs/`` (package data ``modelopt_moe.configs``)."""
    return Path(str(resources.files("modelopt_moe.configs").joinpath(name)))


def find_preset(name: str | Path) -> Path | None:
    """The shipped preset a bare ``name`` stands for: ``"nvfp4_default.yaml"``, ``"nvfp4_default"`` or the
    constant's name ``"NVFP4_DEFAULT_CFG"``; None for a path with directories or an unknown name."""
    name = str(name)
    if not name or Path(name).name != name:
        return None
    for candidate in (PRESET_FILES.get(name), name, f"{name}.yaml"):
        if candidate and preset_path(candidate).is_file():
            return preset_path(candidate)
    return None


def preset_names() -> list[str]:
    """The shipped presets' names (files starting with ``_`` are pieces other presets import)."""
    return sorted(p.stem for p in Path(str(resources.files("modelopt_moe.configs"))).glob("[!_]*.yaml"))
