"""How every ``modelopt-moe`` subcommand runs its ranks, and keeps their output readable.

* Started by a cluster launcher (``torchrun``, or SLURM's ``srun``: :func:`modelopt_moe.launch.launched_environment`),
  every process IS a rank: :func:`run_ranks` joins the launcher's process group and runs the rank function here.
* Started by hand on one machine, :func:`run_ranks` spawns the layout's processes: one per GPU with NCCL, or CPU
  processes joined with gloo, with GPUs hidden from them and Megatron set up for the CPU
  (:func:`modelopt_moe.plugins.megatron_cpu.apply_cpu_shims`: Transformer Engine stays out).

The layout itself is chosen before anything heavy is imported (:mod:`.layout`); this module imports torch only
inside :func:`run_ranks`. Output: stage lines on stdout from rank 0, progress on stderr from rank 0
(:func:`progress`), third-party noise hidden and warnings printed last (:mod:`.noise`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..known_warnings import quiet_known_warnings
from .layout import Layout, LayoutError, choose_layout, launcher_world_size, visible_gpus
from .noise import rank_output

__all__ = ["Layout", "LayoutError", "Ran", "add_layout_args", "check_layout", "run_ranks", "say", "gpus_hidden",
           "prints_here", "progress", "calibration_loop"]


def add_layout_args(p: argparse.ArgumentParser, *, tp: int | None = None, ep: int | None = None,
                    world_size: int | None = None) -> None:
    """``--tp``, ``--ep``, ``--world-size`` and ``--cpu``; a default of None is chosen to fit the machine."""
    auto = "chosen to fit the world size and the model"
    p.add_argument("--tp", type=int, default=tp, help=f"tensor-parallel size (default: {tp or auto})")
    p.add_argument("--ep", type=int, default=ep, help=f"expert-parallel size (default: {ep or auto})")
    per_gpu = "one per visible GPU; 4 CPU processes without GPUs or with --cpu"
    p.add_argument("--world-size", type=int, default=world_size,
                   help=f"processes to start on this machine (default: {world_size or per_gpu}; under torchrun or "
                        "srun the launcher's)")
    p.add_argument("--cpu", action="store_true", help="run CPU processes (gloo) even where GPUs are visible")


def check_layout(p: argparse.ArgumentParser, args: argparse.Namespace, *, num_experts: int | None = None,
                 tp_divides: Mapping[str, int] | None = None) -> Layout:
    """The run's :class:`Layout` from the parsed flags and this machine (an argparse error, exit 2, where it cannot
    run: the message says what would). Sets ``args.world_size`` / ``tp`` / ``ep`` to the chosen values."""
    try:
        layout = choose_layout(0 if args.cpu else visible_gpus(), world_size=args.world_size, tp=args.tp,
                               ep=args.ep, cpu=args.cpu, launched_world_size=launcher_world_size(),
                               num_experts=num_experts, tp_divides=tp_divides)
    except LayoutError as e:
        p.error(str(e))
    args.world_size, args.tp, args.ep = layout.world_size, layout.tp, layout.ep
    return layout


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


@dataclass
class Ran:
    """What :func:`run_ranks` brings back: every rank's result (this rank's alone under a launcher) and rank 0's
    warnings, to print after the command's own lines."""

    results: list[Any]
    warnings: list[str] = field(default_factory=list)


def _rank_entry(rank: int, world_size: int, fn: Callable[..., Any], gpus: bool, args: tuple) -> dict[str, Any]:
    """Every rank: Megatron set up for the CPU on CPU ranks (before it is imported), output tidied, then ``fn``."""
    if not gpus:
        from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

        apply_cpu_shims()
    with rank_output(rank) as collected:
        result = fn(rank, world_size, *args)
    return {"result": result, "warnings": collected}


def run_ranks(fn: Callable[..., Any], layout: Layout, *, args: tuple = (), timeout: float = 3600.0) -> Ran:
    """Runs ``fn(rank, world_size, *args)`` on every rank of ``layout``.

    ``fn`` must be a module-level function (spawned processes import it by its module's name).

    Returns:
        A :class:`Ran`: under a launcher, this rank's result; spawned here, every rank's, in rank order.

    Raises:
        LayoutError: torch sees fewer GPUs than the layout needs (checked before any process starts).
        RuntimeError: a rank failed (its traceback in the message); TimeoutError: the run took too long.
    """
    import torch

    from modelopt_moe.launch import init_from_environment, launched_environment, spawn

    found = launched_environment()
    if layout.gpus:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = 1 if found is not None else layout.world_size
        if have < need:
            raise LayoutError(f"{layout} needs {need} GPU(s) and torch {torch.__version__} sees {have}: run with "
                              "--cpu, or install a torch built with CUDA")
    if found is not None:
        init_from_environment(backend="nccl" if layout.gpus else "gloo", timeout=timeout)
        out = [_rank_entry(found.rank, found.world_size, fn, layout.gpus, args)]
    elif layout.gpus:
        out = spawn(_rank_entry, layout.world_size, args=(fn, True, args), timeout=timeout, backend="nccl")
    else:
        with gpus_hidden():
            out = spawn(_rank_entry, layout.world_size, args=(fn, False, args), timeout=timeout)
    return Ran([o["result"] for o in out], out[0]["warnings"])


def quiet_parent() -> None:
    """The process that parses and spawns hides the known third-party warnings of its own imports too."""
    quiet_known_warnings()


class _Silent:
    """The progress of ranks > 0: every call does nothing."""

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix(self, **values) -> None:
        del values

    def close(self) -> None:
        pass


def progress(rank: int, total: int, desc: str, initial: int = 0):
    """Progress on rank 0, on stderr (stdout keeps the commands' one-line results): a bar on a terminal, a line per
    tenth or per 30 s in a log (:func:`modelopt_moe.progress.progress`); on other ranks an object that does
    nothing."""
    from modelopt_moe.progress import progress as make

    return make(total, desc, unit="steps", initial=initial) if rank == 0 else _Silent()


def calibration_loop(batches: list) -> Callable:
    """``mtq.quantize``'s forward loop: the model's LM loss on each batch (``mtq.calibrate`` shows the progress)."""

    def forward_loop(model) -> None:
        from .evaluate import lm_loss

        for b in batches:
            lm_loss(model, b)

    return forward_loop


def prints_here() -> bool:
    """Whether this process prints a command's own lines: always when started by hand (the spawned ranks report
    back to it), only global rank 0 under a launcher (every rank runs ``main``)."""
    from modelopt_moe.launch import launched_environment

    found = launched_environment()
    return found is None or found.rank == 0


def say(rank: int, message: str) -> None:
    """Prints ``message`` on rank 0 (every rank calls it: the same code path everywhere)."""
    if rank == 0:
        print(message, flush=True)
