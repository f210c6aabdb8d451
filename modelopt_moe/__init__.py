"""Quantization-aware training for Megatron-Core Mixture-of-Experts models.

The user-facing API is :mod:`modelopt_moe.quantization` (``import modelopt_moe.quantization as mtq``); the framework
plugins are :mod:`modelopt_moe.plugins`.
"""
