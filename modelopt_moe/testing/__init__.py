"""Test and demo support: NOT part of the library that users' training code imports.

* :mod:`.megatron_cpu`: the patches megatron-core needs to run on a CPU-only machine (gloo). Never used with CUDA.
* :mod:`.megatron_models`: small real Megatron-Core MoE GPT models, text batches and losses for the tests, the demo
  and the benchmarks.

Both import megatron.core; importing this package imports nothing.
"""
