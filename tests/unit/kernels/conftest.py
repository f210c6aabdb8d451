"""Kernel tests run the Triton kernels on CPU tensors in the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` runs; ``modelopt_moe.kernels`` imports its kernels
lazily, so setting it here, at collection, is early enough. Not on a CUDA machine: there it would turn the GPU
tests of the same process into interpreter runs (these CPU tests then skip).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
