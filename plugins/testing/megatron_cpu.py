"""Moved to :mod:`modelopt_moe.plugins.megatron_cpu` (public: ``enable_cpu_megatron()``); this name re-exports it."""

from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims, cpu_shims_applied, megatron_training_shims

__all__ = ["apply_cpu_shims", "cpu_shims_applied", "megatron_training_shims"]
