"""Session-wide test setup.

Without CUDA, the Triton kernels can only run in Triton's interpreter, and ``TRITON_INTERPRET=1`` must be set before
``import triton`` anywhere (Triton binds its own ``@jit`` library functions at import, and megatron.core imports
Triton): so it is set here, before any test module is collected. The wrappers still pick the torch reference on CPU
unless a config asks for ``kernel: triton``; only the kernel tests launch the interpreter. Spawned ranks inherit it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
