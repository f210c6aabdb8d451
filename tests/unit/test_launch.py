"""modelopt_moe.launch.spawn: real processes, per-rank results, errors with tracebacks, timeouts, cleanup, under both
start methods (the suite itself runs on ``forkserver``, see tests/conftest.py)."""

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from modelopt_moe.launch import spawn

pytestmark = pytest.mark.slow
# Generous: start-up (a fresh interpreter importing torch per rank) is slow on a loaded 2-core machine.
_TIMEOUT = 120
METHODS = ["spawn", "forkserver"]


def _allreduce_rank(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "value": rank * scale,
        "sum": t.item(),
        "world": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 would wait here forever: spawn must not
    return rank


def _exit_hard(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()
    return rank


def _sleep_forever(rank, world_size):
    time.sleep(1000)


def _write_pid_then_sleep(rank, world_size, folder):
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(1000)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but still listed until reaped; ps shows its state as Z.
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def _no_children_left():
    return not multiprocessing.active_children()


@pytest.mark.timeout(_TIMEOUT + 30)
@pytest.mark.parametrize("start_method", METHODS)
def test_spawn_returns_each_ranks_result_in_rank_order(start_method):
    out = spawn(_allreduce_rank, 3, args=(10,), timeout=_TIMEOUT, start_method=start_method)
    assert [r["rank"] for r in out] == [0, 1, 2]
    assert [r["value"] for r in out] == [0, 10, 20]
    assert all(r["sum"] == 3.0 and r["world"] == 3 for r in out)  # a real process group joined all three
    assert all(r["threads"] == 1 for r in out)
    assert len({r["pid"] for r in out} | {os.getpid()}) == 4  # separate processes
    assert _no_children_left()


@pytest.mark.timeout(_TIMEOUT + 30)
def test_spawn_raises_with_the_failing_ranks_traceback():
    with pytest.raises(RuntimeError) as info:
        spawn(_fail_on_rank_one, 2, timeout=_TIMEOUT)
    msg = str(info.value)
    assert "rank 1 of 2 failed" in msg
    assert "ValueError: deliberate failure on rank one" in msg
    assert "_fail_on_rank_one" in msg  # the traceback, not just the message
    assert _no_children_left()


@pytest.mark.timeout(_TIMEOUT + 30)
def test_spawn_reports_a_rank_that_dies_without_a_result():
    with pytest.raises(RuntimeError, match="exited with code 3"):
        spawn(_exit_hard, 2, timeout=_TIMEOUT)
    assert _no_children_left()


@pytest.mark.timeout(60)  # the 4 s timeout must fire long before this one
def test_spawn_times_out_and_kills_all_processes():
    with pytest.raises(TimeoutError, match=r"timeout=4 s"):
        spawn(_sleep_forever, 2, timeout=4)
    assert _no_children_left()


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="start_method 'fork'"):
        spawn(_sleep_forever, 1, start_method="fork")
    with pytest.raises(ValueError, match="world_size"):
        spawn(_sleep_forever, 0)
    with pytest.raises(ValueError, match="timeout"):
        spawn(_sleep_forever, 1, timeout=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.timeout(_TIMEOUT + 30)
@pytest.mark.parametrize("start_method", METHODS)
def test_ranks_die_when_the_launcher_is_killed(tmp_path, start_method):
    # The launcher process is SIGKILLed (no finally runs): its ranks must not be left blocked forever.
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_launch import _write_pid_then_sleep
        from modelopt_moe.launch import spawn
        spawn(_write_pid_then_sleep, 2, args=({str(tmp_path)!r},), timeout=600, start_method={start_method!r})
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script])
    try:
        pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
        deadline = time.monotonic() + _TIMEOUT
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert time.monotonic() < deadline, "ranks did not start"
            assert launcher.poll() is None, "launcher exited early"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in pid_files]
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        launcher.kill()
        launcher.wait()


def _start_a_helper_then_fail(rank, world_size):
    # Like Megatron's checkpoint writer: the rank starts a process of its own (here one that would never end).
    helper = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=False)
    helper.start()
    raise RuntimeError("boom after starting a helper process")


def test_a_failed_rank_leaves_no_process_holding_the_output_open():
    # `spawn ... | tee log` must end when spawn raises: nothing the ranks started may outlive it with our stdout.
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_launch import _start_a_helper_then_fail
        from modelopt_moe.launch import spawn
        try:
            spawn(_start_a_helper_then_fail, 1, timeout=60)
        except RuntimeError as e:
            print("spawn raised:", str(e).strip().splitlines()[-1])
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)  # waits for EOF
    assert "spawn raised: RuntimeError: boom after starting a helper process" in done.stdout, done.stdout + done.stderr
    assert time.monotonic() - start < 90


def _ready_then_sleep(path):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a multiprocessing manager's server does
    open(path, "w").close()
    time.sleep(600)


def _start_a_helper_then_work(rank, world_size, folder):
    # Like a Megatron rank that saves checkpoints: a process of its own, then work in collectives, until stopped.
    ready = os.path.join(folder, f"helper{rank}.ready")
    helper = multiprocessing.get_context("spawn").Process(target=_ready_then_sleep, args=(ready,), daemon=False)
    helper.start()
    while not os.path.exists(ready):  # started up (a Python starting up when Ctrl-C comes fails with a traceback)
        time.sleep(0.05)
    with open(os.path.join(folder, f"rank{rank}.pids"), "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    step = 0
    try:
        while True:
            step += 1
            dist.all_reduce(torch.ones(1))
            time.sleep(0.05)
    except BaseException:
        with open(os.path.join(folder, f"rank{rank}.stopped"), "w") as f:  # cleanup runs: not killed outright
            f.write(str(step))
        raise


def _assert_stopped_by(sig: int, pids, start: float, out: str, err: str, tmp_path) -> None:
    """Within 30 s of ``start`` every process of ``pids`` is gone; spawn raised ``Interrupted`` for ``sig``, every rank
    ran its cleanup, and nothing printed a traceback."""
    while any(_alive(p) for p in pids) and time.monotonic() < start + 30:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], (out, err)
    assert f"spawn raised: interrupted by {signal.Signals(sig).name} {128 + sig}" in out, (out, err)
    assert all((tmp_path / f"rank{r}.stopped").is_file() for r in (0, 1)), (out, err)
    assert "Traceback" not in err, err


def _as_a_shell_starts_it() -> None:
    """In the launcher's process before it runs: every signal's default action and none blocked, as a shell starts a
    program (not whatever this test process's threads and libraries left to be inherited)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


@contextlib.contextmanager
def _two_ranks_started(tmp_path, preexec_fn):
    """The launcher as a user's script runs it (``spawn`` of 2 ranks, each starting a helper process), in its own
    session, started with ``preexec_fn`` and the environment a user's script starts with; its signal state at start
    goes to ``launcher_state.txt``. Yields it and the pids of the ranks and their helpers once all have started, and
    kills what is left afterwards."""
    script = textwrap.dedent(f"""
        import signal, sys
        with open({str(tmp_path / "launcher_state.txt")!r}, "w") as f:
            f.write(repr((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM),
                          [l for l in open("/proc/self/status") if l.startswith(("SigIgn", "SigBlk"))])))
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_launch import _start_a_helper_then_work
        from modelopt_moe.launch import Interrupted, spawn
        try:
            spawn(_start_a_helper_then_work, 2, args=({str(tmp_path)!r},), timeout=600)
        except Interrupted as e:
            print("spawn raised:", e, e.exit_code, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELOPT_MOE_")}  # as a user's script starts
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, env=env, preexec_fn=preexec_fn)
    try:
        pid_files = [tmp_path / "rank0.pids", tmp_path / "rank1.pids"]
        deadline = time.monotonic() + _TIMEOUT
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert time.monotonic() < deadline, "ranks did not start"
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.2)
        yield launcher, [int(p) for f in pid_files for p in f.read_text().split()]  # ranks and their helpers
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and pids as on Linux")
@pytest.mark.timeout(_TIMEOUT + 60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_rank_and_what_they_started(tmp_path, sig):
    # A scheduler signals the one process it started (SIGTERM), or the user presses Ctrl-C (SIGINT to the terminal's
    # whole process group): every rank stops, its cleanup runs, nothing is left, and spawn raises Interrupted.
    with _two_ranks_started(tmp_path, _as_a_shell_starts_it) as (launcher, pids):
        if sig == signal.SIGINT:
            os.killpg(launcher.pid, sig)
        else:
            launcher.send_signal(sig)
        start = time.monotonic()
        try:
            out, err = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            state = (tmp_path / "launcher_state.txt").read_text()
            raise AssertionError(f"launcher exit {launcher.poll()}, its signal state at start: {state}") from None
        _assert_stopped_by(sig, pids, start, out, err, tmp_path)


def _as_a_shell_starts_a_background_job() -> None:
    """As a shell script starts ``cmd &``: SIGINT ignored (Ctrl-C at the terminal is for the script), the rest as
    :func:`_as_a_shell_starts_it`."""
    _as_a_shell_starts_it()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and pids as on Linux")
@pytest.mark.timeout(_TIMEOUT + 60)
def test_a_launcher_that_ignores_ctrl_c_keeps_ignoring_it_and_still_stops_on_sigterm(tmp_path):
    # A script's background job inherits SIGINT ignored: Ctrl-C (SIGINT to the whole process group) leaves the run
    # going, ranks included, and a scheduler's SIGTERM still stops every rank and what they started.
    with _two_ranks_started(tmp_path, _as_a_shell_starts_a_background_job) as (launcher, pids):
        os.killpg(launcher.pid, signal.SIGINT)
        time.sleep(2)
        assert launcher.poll() is None, launcher.communicate()
        assert all(_alive(p) for p in pids)
        assert not list(tmp_path.glob("rank*.stopped"))
        launcher.send_signal(signal.SIGTERM)
        start = time.monotonic()
        out, err = launcher.communicate(timeout=60)
        _assert_stopped_by(signal.SIGTERM, pids, start, out, err, tmp_path)
