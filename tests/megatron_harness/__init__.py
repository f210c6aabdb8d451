"""Test harness for Megatron-Core: small real MoE GPT models and quantization configs the tests and the tools' CPU
runs share. Not part of the installed package.

* :mod:`.models`: ``build_moe_gpt`` (SequentialMLP, grouped or TE experts, layout-independent weights),
  ``build_moe_layer``, the grouped expert linear that runs without Transformer Engine, and the product's parallel
  setup, text batches and measurements re-exported for the test ranks;
* :mod:`.configs`: quantization configs of the experts alone.
* :mod:`.ranks`: the ranks' returned tensors merged (equal where they overlap), the errors of a list of calls.
* :mod:`.hf_families`: what the end-to-end tests of a Hugging Face family share (the tiny config, a rank's
  inputs, the model imported and exported at one TP x EP layout, transformers' logits, a checkpoint's tensors).

Found as ``megatron_harness``: pytest puts ``tests/`` on ``sys.path`` (the directory of ``tests/conftest.py``), and
the ranks that ``modelopt_moe.launch.spawn`` starts inherit that path. The tools put ``tests/`` there themselves.
Importing this package imports nothing.
"""
