"""The parallel layout a ``modelopt-moe`` command runs at, chosen to fit the machine, without importing torch.

Every command parses its flags and settles its layout before anything heavy is imported, so ``--help`` and every
usage error answer at once. :func:`choose_layout` is the one rule, a pure function of what the machine shows and
what the user asked:

* world size: the launcher's under ``torchrun`` / ``srun``; else ``--world-size``; else one process per visible GPU,
  or 4 CPU processes (gloo) on a machine without GPUs or with ``--cpu``;
* ``--tp`` / ``--ep`` left out: TP 2 from 4 processes up (where the model's sizes allow), EP the largest size that
  divides both the processes left per TP group and the expert count;
* a layout that cannot run (more processes than GPUs, a TP or EP size that does not divide the world size, the
  expert count or the model's sizes) is refused with the layout that would run.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Layout", "LayoutError", "choose_layout", "visible_gpus", "launcher_world_size", "CPU_WORLD_SIZE"]

CPU_WORLD_SIZE = 4  # CPU processes without GPUs: enough for TP=2 x EP=2, small enough for 2 cores


class LayoutError(ValueError):
    """A layout that cannot run here; the message says what would."""


@dataclass(frozen=True)
class Layout:
    """``world_size`` ranks at ``tp`` x ``ep``, one per GPU (NCCL) or CPU processes (gloo).

    Attributes:
        world_size: ranks.
        tp: tensor-parallel size.
        ep: expert-parallel size.
        gpus: whether each rank takes a GPU.
        visible_gpus: GPUs the machine shows (the reason for the choice).
        chosen: the flags whose values were chosen here (not given).
    """

    world_size: int
    tp: int
    ep: int
    gpus: bool
    visible_gpus: int = 0
    chosen: tuple[str, ...] = ()

    def __str__(self) -> str:
        kind = "GPU" if self.gpus else "CPU"
        procs = f"{self.world_size} {kind} process{'es' if self.world_size != 1 else ''}"
        return f"{procs}{' (NCCL)' if self.gpus else ' (gloo)'}, TP={self.tp} x EP={self.ep}"

    def describe(self) -> str:
        """One line: the layout and why (e.g. for a command's first output line)."""
        if not self.chosen:
            return str(self)
        n = self.visible_gpus
        seen = "no GPU visible" if n == 0 else f"{n} GPU{'s' if n != 1 else ''} visible"
        return f"{self} ({seen}; {', '.join(self.chosen)} chosen to fit, set them to change)"

    def flags(self) -> str:
        """The flags that give this layout."""
        cpu = " --cpu" if not self.gpus and self.visible_gpus else ""
        return f"--world-size {self.world_size} --tp {self.tp} --ep {self.ep}{cpu}"


def _auto_tp(world: int, tp_divides: Mapping[str, int]) -> int:
    if world >= 4 and world % 2 == 0 and all(v % 2 == 0 for v in tp_divides.values()):
        return 2
    return 1


def _auto_ep(world: int, tp: int, num_experts: int | None) -> int:
    per_tp = world // tp if world % tp == 0 else 1
    return max(d for d in range(1, per_tp + 1) if per_tp % d == 0 and (num_experts is None or num_experts % d == 0))


def _problems(world: int, tp: int, ep: int, num_experts: int | None,
              tp_divides: Mapping[str, int]) -> list[tuple[str, str]]:
    """``(flag, message)`` for each size that does not fit."""
    out = []
    if world % tp:
        out.append(("--tp", f"--tp {tp} must divide the world size {world}"))
    out += [("--tp", f"{name} {value} must be a multiple of --tp {tp}")
            for name, value in tp_divides.items() if value % tp]
    if world % ep:
        out.append(("--ep", f"--ep {ep} must divide the world size {world}"))
    if num_experts is not None and num_experts % ep:
        out.append(("--ep", f"--ep {ep} must divide the model's {num_experts} experts"))
    return out


def choose_layout(gpus: int, *, world_size: int | None = None, tp: int | None = None, ep: int | None = None,
                  cpu: bool = False, launched_world_size: int | None = None, num_experts: int | None = None,
                  tp_divides: Mapping[str, int] | None = None) -> Layout:
    """The layout to run, from what the machine shows and the flags given (None: not given).

    Args:
        gpus: GPUs visible here (:func:`visible_gpus`).
        world_size: ``--world-size`` as given, or None.
        tp: ``--tp`` as given, or None.
        ep: ``--ep`` as given, or None.
        cpu: ``--cpu``: CPU processes even where GPUs are visible.
        launched_world_size: the launcher's world size under ``torchrun`` / ``srun`` (:func:`launcher_world_size`).
        num_experts: the model's expert count where known (EP must divide it).
        tp_divides: sizes TP must divide, by the name a message shows (e.g. ``{"--seq-len": 64}``).

    Returns:
        The :class:`Layout`.

    Raises:
        LayoutError: the flags cannot run here; the message names the flag and the layout that would run.
    """
    tp_divides = dict(tp_divides or {})
    for name, value in (("--world-size", world_size), ("--tp", tp), ("--ep", ep)):
        if value is not None and value < 1:
            raise LayoutError(f"{name} {value} must be >= 1")
    on_gpus = not cpu and gpus >= 1
    chosen = []
    if launched_world_size is not None:
        if world_size is not None and world_size != launched_world_size:
            raise LayoutError(f"--world-size {world_size}: the launcher started {launched_world_size} processes "
                              "(leave --world-size out under torchrun or srun)")
        world = launched_world_size
    elif world_size is not None:
        world = world_size
        if on_gpus and world > gpus:
            raise LayoutError(
                f"--world-size {world} needs {world} GPUs (one process each) and this machine shows {gpus}: run "
                f"--world-size {gpus} (or leave it out), or add --cpu for {world} CPU processes")
    else:
        world = gpus if on_gpus else CPU_WORLD_SIZE
        chosen.append("--world-size")
    if tp is None:
        tp = _auto_tp(world, tp_divides)
        chosen.append("--tp")
    if ep is None:
        ep = _auto_ep(world, tp, num_experts)
        chosen.append("--ep")
    problems = _problems(world, tp, ep, num_experts, tp_divides)
    if problems:
        bad = {flag for flag, _ in problems}
        fit_tp = _auto_tp(world, tp_divides) if "--tp" in bad else tp
        fit_ep = _auto_ep(world, fit_tp, num_experts) if "--ep" in bad or "--ep" in chosen else ep
        fits = Layout(world, fit_tp, fit_ep, on_gpus, gpus)
        raise LayoutError(f"{'; '.join(m for _, m in problems)}. This would run: {fits.flags()} ({fits})")
    return Layout(world, tp, ep, on_gpus, gpus, tuple(chosen))


def _torch_has_cuda() -> bool:
    """Whether the installed torch was built with CUDA, read from its ``version.py`` (importing torch takes
    seconds); True where that cannot be read (the run path checks again with torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return True
    return not re.search(r"^cuda\s*(:[^=]*)?=\s*None\s*$", text, flags=re.M)


def visible_gpus() -> int:
    """The GPUs a process started here would see, found without importing torch: 0 with ``CUDA_VISIBLE_DEVICES``
    empty, a torch built without CUDA, or no NVIDIA driver; else the CUDA driver's device count (which applies
    ``CUDA_VISIBLE_DEVICES``)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1") or not _torch_has_cuda():
        return 0
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def launcher_world_size() -> int | None:
    """The world size ``torchrun`` or ``srun`` gave this process, or None when no launcher started it."""
    if not any(v in os.environ for v in ("WORLD_SIZE", "SLURM_NTASKS")):
        return None  # no launcher: nothing to import
    from modelopt_moe.launch import launched_environment  # imports torch; only a launched process gets here

    found = launched_environment()
    return None if found is None else found.world_size
