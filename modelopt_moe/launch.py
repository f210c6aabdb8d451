"""Run a function on N real processes joined by ``torch.distributed`` (gloo on CPU, nccl on GPU), or join the group a
cluster launcher (``torchrun``, SLURM's ``srun``) already started.

Framework-free: torch only. :func:`spawn` is used by the multi-rank tests and the demo on one machine::

    from modelopt_moe.launch import spawn

    def work(rank, world_size, scale):        # module level, so the spawn context can pickle it
        return rank * scale

    assert spawn(work, 4, args=(10,), timeout=60) == [0, 10, 20, 30]

Every rank's return value (picklable) comes back to the parent, in rank order. An exception on any rank raises a
``RuntimeError`` in the parent that carries that rank's traceback; a run that does not finish in ``timeout``
seconds raises ``TimeoutError``; SIGTERM or Ctrl-C stops every rank and raises :class:`Interrupted`
(:mod:`modelopt_moe.interrupt`). In every case all child processes are gone when ``spawn`` returns or raises.

Under a launcher, every process runs the program itself: :func:`launched_environment` reads where this process sits
(torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, else SLURM's ``SLURM_PROCID`` / ``SLURM_NTASKS`` /
``SLURM_LOCALID``) and :func:`init_from_environment` joins the process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .interrupt import (
    STOP_SIGNALS,
    Interrupted,
    handlers_are_default,
    not_ignored,
    received_signal,
    stop_on_signals,
)

__all__ = ["spawn", "free_port", "LaunchEnvironment", "launched_environment", "init_from_environment",
           "Interrupted"]

# Seconds a rank's peers get to report their own failure after the first one: the root cause usually arrives
# first, the others (broken connections) shortly after; waiting longer only delays the error.
_ERROR_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Seconds the ranks get to exit on their own once all results are in.
_EXIT_GRACE_S = 30.0
_ERROR_EXIT_GRACE_S = 10.0  # per reporting rank, once some rank failed
# Seconds the ranks get to stop on their own once a signal stopped the run, before they are killed: a scheduler's
# SIGKILL follows its SIGTERM after a grace of its own (SLURM's KillWait, 30 s by default).
_INTERRUPT_GRACE_S = 10.0
# How often spawn retries when rank 0 could not bind the port it was given (another program took it between
# free_port() and the bind).
_PORT_RETRIES = 3


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the parent dies (even by SIGKILL, when no ``finally`` runs),
    so ranks blocked in a collective never outlive the launcher. Best effort elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _exit_when_closed(launcher_alive: multiprocessing.connection.Connection) -> None:
    """Ends this process (in a daemon thread) once the launcher's end of ``launcher_alive`` is closed: the launcher
    exited or was killed. With the ``forkserver`` start method the kernel's parent is the fork server, not the
    launcher, so the parent-death signal alone would not end a rank whose launcher was killed."""

    def wait() -> None:
        try:
            launcher_alive.recv_bytes()  # the launcher never writes: this returns only by EOF
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=wait, name="launcher-alive", daemon=True).start()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    conn: multiprocessing.connection.Connection,
    launcher_alive: multiprocessing.connection.Connection,
    stdio: tuple[multiprocessing.connection.Connection, ...] | None,
    stop_signals: tuple[int, ...] = STOP_SIGNALS,
) -> None:
    """Child process body: join the group, run ``fn``, send ``(status, payload)`` back through ``conn``.
    ``stop_signals`` are those the launcher does not ignore; the others the rank ignores as well (a forked rank would
    otherwise have its fork server's)."""
    for s in STOP_SIGNALS:
        if s not in stop_signals:
            signal.signal(s, signal.SIG_IGN)
    with stop_on_signals(stop_signals):  # SIGTERM / SIGINT: fn's cleanup runs, the launcher learns where it stopped
        _worker_body(rank, world_size, port, backend, timeout, fn, args, conn, launcher_alive, stdio)
    for s in STOP_SIGNALS:  # on the way out (finalizers: a multiprocessing manager's shutdown): a late signal,
        signal.signal(s, signal.SIG_IGN)  # the launcher's passed on or a second Ctrl-C, would only interrupt it


def _worker_body(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    conn: multiprocessing.connection.Connection,
    launcher_alive: multiprocessing.connection.Connection,
    stdio: tuple[multiprocessing.connection.Connection, ...] | None,
) -> None:
    _die_with_parent()
    _exit_when_closed(launcher_alive)
    if stdio is not None:  # write where the launcher's stdout / stderr point now (see _launcher_stdio)
        for fd, target in zip((1, 2), stdio, strict=True):
            os.dup2(target.fileno(), fd)
            target.close()
    # The machine has few cores and N ranks share them: more than one thread per rank only oversubscribes.
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (e.g. fn's module did inter-op work at import): harmless
        pass
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        if backend == "nccl":  # one GPU per rank, before NCCL binds the communicator to a device
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # The group's own timeout makes a collective that waits for a dead peer fail instead of hanging.
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=max(timeout, 1.0))
        )
    except BaseException as e:
        if isinstance(e, Interrupted) or received_signal() is not None:
            _send(conn, ("interrupted", (received_signal(), getattr(e, "where", None))))
        else:
            _send(conn, ("init_error", traceback.format_exc()))
        conn.close()
        return
    try:
        result = fn(rank, world_size, *args)
        try:
            _send(conn, ("ok", result))
        except Exception:  # pickling the result failed: report it like any other error
            _send(conn, ("error", f"return value of rank {rank} could not be sent:\n{traceback.format_exc()}"))
    except BaseException as e:
        if isinstance(e, Interrupted) or received_signal() is not None:  # peers' errors after a signal are part of it
            _send(conn, ("interrupted", (received_signal(), getattr(e, "where", None))))
        else:
            _send(conn, ("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _send(conn: multiprocessing.connection.Connection, message: tuple) -> None:
    # Plain pickle, by value: torch's multiprocessing pickler would pass tensors as shared-memory handles that
    # die with this process, which exits right after sending. The time it was sent orders the failures: the launcher
    # may find several in one wake-up, and the first sent is most likely the root cause.
    conn.send_bytes(pickle.dumps((*message, time.time())))


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))  # functools.partial has no __qualname__


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, recursively (psutil, which Megatron needs anyway; none without it)."""
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001  (no psutil, or the process is gone: nothing to find)
        return []


def _descendant_processes(pids: Sequence[int]) -> list:
    """The processes ``pids`` started, recursively, as ``psutil.Process`` objects (which notice a reused pid)."""
    try:
        import psutil
    except ImportError:
        return []
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found += psutil.Process(pid).children(recursive=True)
    return found


def _stop_ranks(procs: list[mp.process.BaseProcess], conns: list[multiprocessing.connection.Connection],
                signum: int, where: dict[int, str] | None = None) -> Interrupted:
    """A signal stopped the launcher: passes it on to every rank (a scheduler signals one process), gives them
    :data:`_INTERRUPT_GRACE_S` to stop on their own, then kills what is left, the processes the ranks started
    included (found now: once a rank is gone, its children are no longer its). Returns what to raise, with where
    rank 0 (else the first rank that said) stopped."""
    where = dict(where or {})
    alive = [p for p in procs if p.is_alive()]
    started = _descendant_processes([p.pid for p in alive])
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)
    deadline = time.monotonic() + _INTERRUPT_GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for r, c in enumerate(conns):
        with contextlib.suppress(EOFError, OSError, pickle.UnpicklingError):
            while c.poll():
                status, payload, _ = pickle.loads(c.recv_bytes())
                if status == "interrupted" and payload[1]:
                    where[r] = payload[1]
    _kill_all(procs)
    for child in started:  # what the ranks started and did not stop (or that a killed rank left behind)
        with contextlib.suppress(Exception):
            child.kill()
    return Interrupted(signum, where.get(0, next(iter(where.values()), None)))  # rank 0's, else the first's


def _kill_all(procs: list[mp.process.BaseProcess]) -> None:
    """Kills the ranks still alive AND the processes they started (Megatron's checkpoint writer starts a
    multiprocessing manager): an orphan would outlive us and hold our stdout open, hanging ``spawn ... | tee``."""
    for p in procs:
        if p.is_alive():
            for pid in _descendants(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            p.kill()
    for p in procs:
        p.join(timeout=10)


START_METHODS = ("spawn", "forkserver")
# The environment variables that choose the start method of every spawn call that names none, and the modules a
# forkserver imports once for all the processes it starts.
START_METHOD_VAR = "MODELOPT_MOE_START_METHOD"
PRELOAD_VAR = "MODELOPT_MOE_FORKSERVER_PRELOAD"


def _context(start_method: str | None):
    """The multiprocessing context of ``start_method`` (default: ``$MODELOPT_MOE_START_METHOD``, else ``spawn``).

    ``forkserver`` starts a server process that imports torch (and the comma-separated modules in
    ``$MODELOPT_MOE_FORKSERVER_PRELOAD``) once; every rank is then forked from it instead of importing them again,
    which is most of a rank's start-up on a small machine. The server only imports: no thread pool or process group
    exists in it to be inherited. Ranks that use CUDA need ``spawn`` when a preloaded module creates a CUDA context
    on import (megatron-core with Transformer Engine does): a forked process cannot use its parent's context.

    Raises:
        ValueError: an unknown start method.
    """
    method = start_method or os.environ.get(START_METHOD_VAR) or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"start_method {method!r} (or ${START_METHOD_VAR}): expected one of {START_METHODS}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        extra = [m.strip() for m in os.environ.get(PRELOAD_VAR, "").split(",") if m.strip()]
        ctx.set_forkserver_preload(["torch", "torch.distributed", *extra])  # used when the server first starts
    return ctx


def _launcher_stdio(ctx) -> tuple[multiprocessing.connection.Connection, ...] | None:
    """This process's stdout and stderr as they are now, for ranks forked from a fork server: those inherit the
    server's, which point wherever this process's pointed when the server started (a test's captured output, a
    command's redirected log would miss them). Passed as connections (the one object whose file descriptor the start
    methods hand to a child); None with ``spawn``, whose children are started from this process as it is."""
    if ctx.get_start_method() != "forkserver":
        return None
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    return tuple(multiprocessing.connection.Connection(os.dup(fd), readable=False) for fd in (1, 2))


def _run_once(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout: float, backend: str,
    start_method: str | None,
) -> tuple[str, Any]:
    """One attempt. Returns ``("ok", results)``, ``("port", message)`` or raises."""
    ctx = _context(start_method)
    port = free_port()
    procs: list[mp.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    alive_r, alive_w = ctx.Pipe(duplex=False)  # only this process holds alive_w: its end ends every rank
    stdio = _launcher_stdio(ctx)
    stop_signals = not_ignored()
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, backend, timeout, fn, tuple(args), child_end, alive_r, stdio,
                      stop_signals),
                name=f"spawn-rank{rank}",
                # Not daemonic: ranks may start processes of their own (Megatron's checkpoint writer starts a
                # multiprocessing.Manager). They still never outlive us: killed in `finally`, and by the kernel
                # (PR_SET_PDEATHSIG) if this process dies.
                daemon=False,
            )
            p.start()
            child_end.close()  # so the parent sees EOF when the child dies
            procs.append(p)
            conns.append(parent_end)

        try:
            status, payload = _collect(fn, procs, conns, world_size, timeout)
        except (Interrupted, KeyboardInterrupt) as e:  # a signal reached the launcher
            raise _stop_ranks(procs, conns, getattr(e, "signum", signal.SIGINT)) from None
        if status == "interrupted":
            r, signum, where = payload
            raise _stop_ranks(procs, conns, signum or signal.SIGTERM, {r: where} if where else {})
        return status, payload
    finally:
        _kill_all(procs)
        for c in (*conns, alive_r, alive_w, *(stdio or ())):
            c.close()


def _collect(fn: Callable[..., Any], procs: list[mp.process.BaseProcess],
             conns: list[multiprocessing.connection.Connection], world_size: int, timeout: float) -> tuple[str, Any]:
    """Waits for every rank's message. Returns ``("ok", results)``, ``("port", message)`` or ``("interrupted",
    (rank, signal, where))``, or raises the ranks' failure."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}  # rank -> (when it was sent, traceback)
    first_error_at: float | None = None
    pending = set(range(world_size))
    while pending:
        now = time.monotonic()
        if first_error_at is not None and now > first_error_at + _ERROR_GRACE_S:
            break
        if now > deadline:
            raise TimeoutError(
                f"spawn: {_name(fn)} did not finish within timeout={timeout:g} s on ranks "
                f"{sorted(pending)} (of world_size={world_size}); all processes were killed"
            )
        wait_until = deadline if first_error_at is None else min(deadline, first_error_at + _ERROR_GRACE_S)
        waitables = {}
        for r in pending:
            waitables[conns[r]] = r
            waitables[procs[r].sentinel] = r
        ready = multiprocessing.connection.wait(list(waitables), timeout=max(0.0, wait_until - now))
        for obj in ready:
            r = waitables[obj]
            if r not in pending:
                continue
            why = "nothing in its pipe"
            try:
                # A dead child may still have left its message in the pipe: read it before judging.
                status, payload, sent_at = (pickle.loads(conns[r].recv_bytes()) if conns[r].poll()
                                            else ("dead", None, time.time()))
            except (EOFError, OSError) as e:
                status, payload, sent_at, why = "dead", None, time.time(), f"{type(e).__name__}: {e}"
            if status == "dead":
                procs[r].join(timeout=5)
                status, payload = "error", (f"rank {r} exited with code {procs[r].exitcode} without a result "
                                            f"({why})")
            pending.discard(r)
            if status == "ok":
                results[r] = payload
                continue
            if status == "init_error" and "address already in use" in str(payload).lower():
                return "port", payload
            if status == "interrupted":  # a signal reached this rank: the run stops
                return "interrupted", (r, *payload)
            errors[r] = (sent_at, payload)
            if first_error_at is None:
                first_error_at = time.monotonic()
    if errors:
        # The ranks that reported are shutting down on their own (process group teardown, the processes they
        # started): let them finish briefly rather than kill them mid-way.
        for r in range(world_size):
            if r not in pending:
                procs[r].join(timeout=_ERROR_EXIT_GRACE_S)
        first, *others = sorted(errors, key=lambda r: errors[r][0])
        msg = f"spawn: rank {first} of {world_size} failed in {_name(fn)}:\n{errors[first][1]}"
        if others:
            msg += f"\n(ranks {others} failed too; first of them:)\n{errors[others[0]][1]}"
        raise RuntimeError(msg)
    # Let the ranks finish their own shutdown (process group teardown, atexit hooks, flushing output) before
    # the finally below kills whatever is left: a killed child leaks the resources it registered.
    for p in procs:
        p.join(timeout=max(1.0, min(_EXIT_GRACE_S, deadline - time.monotonic())))
    return "ok", [results[r] for r in range(world_size)]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    backend: str = "gloo",
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes joined in one process group.

    Each process uses one torch thread, gets ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, calls
    ``torch.distributed.init_process_group(backend)`` before ``fn`` and destroys the group after it.

    Args:
        fn: A module-level (picklable) function ``fn(rank, world_size, *args)``; its return value must pickle.
        world_size: Number of processes (ranks), >= 1.
        args: Extra positional arguments for ``fn`` (must pickle).
        timeout: Seconds for the whole run (start-up included); also the process group's collective timeout.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
        start_method: ``"spawn"`` (a fresh interpreter per rank) or ``"forkserver"`` (ranks forked from a server
            that imported torch once: faster start-up); default ``$MODELOPT_MOE_START_METHOD``, else ``"spawn"``.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        ValueError: ``world_size`` < 1 or ``timeout`` <= 0.
        RuntimeError: A rank raised or died; the message carries its traceback (and the first other failure).
        TimeoutError: The run took longer than ``timeout``; all processes were killed.
        Interrupted: SIGTERM or SIGINT (Ctrl-C) reached this process or a rank. Every rank got the signal, as
            :class:`Interrupted` in its main thread (``finally`` blocks run; ``where`` says what ``fn`` was doing if
            it set it), and had a few seconds to stop before the ones left, and the processes the ranks started,
            were killed. ``where`` is rank 0's; its ``exit_code`` is 128 + the signal. Where this process has its
            own SIGTERM or SIGINT handler, spawn leaves it in place (it still stops the ranks on
            ``KeyboardInterrupt`` or :class:`Interrupted`). Each signal is taken on its own: a signal this process
            ignores (SIGINT in a shell script's background job ``cmd &``) stays ignored, here and in the ranks,
            while SIGTERM still stops them.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    _context(start_method)  # an unknown start method fails before anything starts
    message = ""
    # Each signal on its own: one with a handler of the caller's (or ignored) is left as it is, the others stop the run.
    own = tuple(s for s in STOP_SIGNALS if handlers_are_default((s,)))
    with stop_on_signals(own) if own else contextlib.nullcontext():
        for _ in range(_PORT_RETRIES):
            status, payload = _run_once(fn, world_size, args, timeout, backend, start_method)
            if status == "ok":
                return payload
            message = payload
    raise RuntimeError(f"spawn: could not bind a free MASTER_PORT in {_PORT_RETRIES} tries:\n{message}")


# ---------------------------------------------------------------------------------------------------------------
# Processes started by a cluster launcher

_DEFAULT_SLURM_PORT = 29500


@dataclass(frozen=True)
class LaunchEnvironment:
    """Where this process sits in a job a launcher started."""

    launcher: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None


def launched_environment(env: Mapping[str, str] | None = None) -> LaunchEnvironment | None:
    """This process's rank, world size and local rank as its launcher set them, or None without a launcher.

    torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` come first; without them, SLURM's ``SLURM_PROCID``,
    ``SLURM_NTASKS`` and ``SLURM_LOCALID`` (what ``srun`` sets for each task).

    Raises:
        ValueError: a variable is not an integer, or the rank is outside ``[0, world_size)``.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        found = LaunchEnvironment("torchrun", _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE"),
                                  _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        found = LaunchEnvironment("slurm", _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS"),
                                  _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0)
    else:
        return None
    if not 0 <= found.rank < found.world_size:
        raise ValueError(f"{found.launcher}: rank {found.rank} is outside [0, world_size={found.world_size})")
    return found


def init_from_environment(backend: str | None = None, timeout: float = 1800.0) -> LaunchEnvironment:
    """Joins the process group of a job started by torchrun or SLURM (``srun``), and returns this process's place.

    The rendezvous is ``MASTER_ADDR`` / ``MASTER_PORT`` (torchrun sets them; under SLURM set them in the batch
    script, or ``MASTER_ADDR`` defaults to ``SLURM_LAUNCH_NODE_IPADDR`` and ``MASTER_PORT`` to 29500). With CUDA,
    each process takes GPU ``local_rank`` and the backend is NCCL; gloo otherwise.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default by CUDA availability.
        timeout: The process group's collective timeout, seconds.

    Raises:
        RuntimeError: no launcher variables, or no rendezvous address.
    """
    found = launched_environment()
    if found is None:
        raise RuntimeError("init_from_environment: not started by a launcher (no RANK/WORLD_SIZE from torchrun, no "
                           "SLURM_PROCID/SLURM_NTASKS from srun); use modelopt_moe.launch.spawn on one machine")
    if found.launcher == "slurm":
        os.environ.setdefault("MASTER_PORT", str(_DEFAULT_SLURM_PORT))
        if "MASTER_ADDR" not in os.environ and "SLURM_LAUNCH_NODE_IPADDR" in os.environ:
            os.environ["MASTER_ADDR"] = os.environ["SLURM_LAUNCH_NODE_IPADDR"]
        os.environ.update(RANK=str(found.rank), WORLD_SIZE=str(found.world_size), LOCAL_RANK=str(found.local_rank))
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError(f"init_from_environment ({found.launcher}): MASTER_ADDR is not set; export it in the job "
                           "script (e.g. the first host of `scontrol show hostnames $SLURM_JOB_NODELIST`)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(found.local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=found.rank, world_size=found.world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    return found
