"""Session-wide test setup: the Triton interpreter on CPU, how ranks start, and the suite's tiers and time limits.

Without CUDA, the Triton kernels can only run in Triton's interpreter, and ``TRITON_INTERPRET=1`` must be set before
``import triton`` anywhere (Triton binds its own ``@jit`` library functions at import, and megatron.core imports
Triton): so it is set here, before any test module is collected. The wrappers still pick the torch reference on CPU
unless a config asks for ``kernel: triton``; only the kernel tests launch the interpreter. Spawned ranks inherit it.

On CPU, ranks start from a fork server that imported torch and megatron-core once (``modelopt_moe.launch``'s
``forkserver`` start method): a multi-process test then starts its ranks in a fraction of a second instead of
importing megatron-core again in every rank (several seconds each on two cores). ``test_launch.py`` checks both start
methods.

Tiers: ``tests/unit`` (CPU, single process unless marked ``slow``), ``tests/distributed`` (several processes, real
Megatron-Core; all ``slow``), ``tests/gpu`` (marker ``gpu``, deselected unless asked for). ``make test-fast`` runs
what is not ``slow``. Time limits (pytest-timeout) are per tier, about ten times what a test takes on two idle cores,
so a loaded machine is no failure while a hang still is; ``MODELOPT_MOE_TEST_TIME_SCALE`` multiplies them (and the
spawn timeouts of :func:`limits.seconds`) on a machine slower still.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("MODELOPT_MOE_START_METHOD", "forkserver")
    os.environ.setdefault("MODELOPT_MOE_FORKSERVER_PRELOAD", "megatron.core,megatron.core.models.gpt")
else:
    # With CUDA, importing megatron-core (Transformer Engine) creates a CUDA context, which a forked rank cannot use:
    # GPU ranks start as fresh interpreters.
    os.environ.setdefault("MODELOPT_MOE_START_METHOD", "spawn")

from limits import seconds  # noqa: E402  (this directory is on sys.path: pytest inserts a conftest's directory)


def pytest_sessionstart(session):
    """Starts the fork server now, its output discarded: what its imports print (Megatron's notices about packages
    a CPU machine lacks) would otherwise land in the output of whichever test happened to start it. Ranks write to
    their launcher's output, not the server's (modelopt_moe.launch)."""
    import multiprocessing.forkserver

    from modelopt_moe.launch import _context

    if os.environ["MODELOPT_MOE_START_METHOD"] != "forkserver":
        return
    _context("forkserver")
    saved = [os.dup(fd) for fd in (1, 2)]
    with open(os.devnull, "w") as devnull:
        for fd in (1, 2):
            os.dup2(devnull.fileno(), fd)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)

TIER_LIMITS = {"unit": 300, "distributed": 1500, "gpu": 1500, "tools": 900}  # seconds per test, before scaling
ROOT = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.fspath).relative_to(ROOT).parts[0]
        if tier == "distributed":
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("timeout") is None and tier in TIER_LIMITS:
            item.add_marker(pytest.mark.timeout(seconds(TIER_LIMITS[tier])))
