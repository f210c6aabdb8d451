"""Test and demo support: NOT part of the library that users' training code imports.

* :mod:`.megatron_cpu`: the patches megatron-core needs to run on a CPU-only machine (gloo). Never used with CUDA.
* :mod:`.megatron_models`: small real Megatron-Core MoE GPT models (SequentialMLP or grouped experts), text batches
  and losses for the tests, the demo and the benchmarks.
* :mod:`.megatron_training`: Megatron's training machinery around such a model (``Float16Module``, DDP,
  ``get_megatron_optimizer``, ``get_forward_backward_func``), on CPU through ``megatron_cpu.megatron_training_shims``.

Each imports megatron.core (``megatron_cpu`` only torch); importing this package imports nothing.
"""
