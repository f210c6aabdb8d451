"""How every ``modelopt-moe`` subcommand runs its ranks, and keeps their output readable.

* Started by a cluster launcher (``torchrun``, or SLURM's ``srun``: :func:`modelopt_moe.launch.launched_environment`),
  every process IS a rank: :func:`run_ranks` joins the launcher's process group and runs the rank function here.
* Started by hand on one machine, :func:`run_ranks` spawns ``world_size`` processes: one per GPU with NCCL when the
  machine has enough GPUs, else CPU processes joined with gloo (GPUs hidden from them).

Third-party noise (Megatron's deprecation and async-save notices, the same warning from every rank) is silenced on
ranks > 0 and shown once on rank 0 (:func:`quiet_third_party`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from modelopt_moe.launch import init_from_environment, launched_environment, spawn

__all__ = ["Layout", "add_layout_args", "check_layout", "run_ranks", "quiet_third_party", "say", "gpus_hidden",
           "prints_here", "progress", "calibration_loop"]


class Layout:
    """The parallel layout a subcommand runs at: ``world_size`` ranks, ``tp`` x ``ep``, on GPUs or CPUs."""

    def __init__(self, world_size: int, tp: int, ep: int, gpus: bool):
        self.world_size, self.tp, self.ep, self.gpus = world_size, tp, ep, gpus

    def __repr__(self) -> str:
        return f"{self.world_size} {'GPU' if self.gpus else 'CPU'} rank(s), TP={self.tp} EP={self.ep}"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def add_layout_args(p: argparse.ArgumentParser, *, tp: int = 2, ep: int = 2, world_size: int = 4) -> None:
    """``--tp``, ``--ep``, ``--world-size`` and ``--cpu``; under a launcher its world size wins."""
    p.add_argument("--tp", type=int, default=tp, help="tensor-parallel size (default: %(default)s)")
    p.add_argument("--ep", type=int, default=ep, help="expert-parallel size (default: %(default)s)")
    p.add_argument("--world-size", type=int, default=world_size,
                   help="processes to start on this machine (default: %(default)s; under torchrun or srun the "
                        "launcher's)")
    p.add_argument("--cpu", action="store_true", help="run on CPU processes (gloo) even where GPUs are present")


def check_layout(p: argparse.ArgumentParser, args: argparse.Namespace) -> Layout:
    """The run's :class:`Layout`; an argparse error where ``--tp`` / ``--ep`` do not divide the world size."""
    found = launched_environment()
    if found is not None:
        args.world_size = found.world_size
    for name in ("tp", "ep"):
        size = getattr(args, name)
        if size < 1 or args.world_size % size:
            p.error(f"--{name} {size} must be >= 1 and divide --world-size {args.world_size}")
    gpus = not getattr(args, "cpu", False) and _gpu_count() >= (1 if found is not None else args.world_size)
    return Layout(args.world_size, args.tp, args.ep, gpus)


@contextlib.contextmanager
def gpus_hidden() -> Iterator[None]:
    """Hide GPUs from the processes started inside (they inherit the environment), then restore it: CPU ranks
    joined with gloo must not place Megatron models on a GPU that four of them would share."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def run_ranks(fn: Callable[..., Any], layout: Layout, *, args: tuple = (), timeout: float = 3600.0) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on every rank of ``layout``.

    ``fn`` must be a module-level function (spawned processes import it by its module's name).

    Returns:
        Under a launcher: ``[this rank's result]``. Spawned here: every rank's result, in rank order.

    Raises:
        RuntimeError: a rank failed (its traceback in the message); TimeoutError: the run took too long.
    """
    found = launched_environment()
    if found is not None:
        init_from_environment(backend="nccl" if layout.gpus else "gloo", timeout=timeout)
        return [fn(found.rank, found.world_size, *args)]
    if layout.gpus:
        return spawn(fn, layout.world_size, args=args, timeout=timeout, backend="nccl")
    with gpus_hidden():
        return spawn(fn, layout.world_size, args=args, timeout=timeout)


class _OnceFilter(logging.Filter):
    """Lets each distinct log message through once."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.getMessage()}"
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def quiet_third_party(rank: int) -> None:
    """Ranks > 0 print no third-party warnings or log notices; rank 0 shows each distinct one once."""
    logger = logging.getLogger("megatron")
    if rank != 0:
        warnings.filterwarnings("ignore")
        logger.setLevel(logging.ERROR)
        return
    warnings.simplefilter("once")
    logger.setLevel(logging.WARNING)
    # Megatron logs through per-module child loggers; a filter on the "megatron" logger never sees their records
    # (logger filters apply only where a record is created), so deduplicate where they are printed: the handlers.
    once = _OnceFilter()
    for handler in [logging.lastResort, *logging.getLogger().handlers]:
        if handler is not None and not any(isinstance(f, _OnceFilter) for f in handler.filters):
            handler.addFilter(once)


def progress(rank: int, total: int, desc: str, initial: int = 0):
    """A tqdm bar shown on rank 0 only, on stderr (stdout keeps the commands' one-line results)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=rank != 0, file=sys.stderr)


def calibration_loop(rank: int, batches: list) -> Callable:
    """``mtq.quantize``'s forward loop: the model's LM loss on each batch, with a progress bar on rank 0."""

    def forward_loop(model) -> None:
        from modelopt_moe.plugins.testing.megatron_models import lm_loss

        bar = progress(rank, len(batches), "calibrating")
        for b in batches:
            lm_loss(model, b)
            bar.update(1)
        bar.close()

    return forward_loop


def prints_here() -> bool:
    """Whether this process prints a command's own lines: always when started by hand (the spawned ranks report
    back to it), only global rank 0 under a launcher (every rank runs ``main``)."""
    found = launched_environment()
    return found is None or found.rank == 0


def say(rank: int, message: str) -> None:
    """Prints ``message`` on rank 0 (every rank calls it: the same code path everywhere)."""
    if rank == 0:
        print(message, flush=True)
