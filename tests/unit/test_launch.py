"""modelopt_moe.launch.spawn: real processes, per-rank results, errors with tracebacks, timeouts, cleanup."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from modelopt_moe.launch import spawn

# Generous: start-up (a fresh interpreter importing torch per rank) is slow on a loaded 2-core machine.
_TIMEOUT = 120


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


def _no_children_left():
    return not multiprocessing.active_children()


@pytest.mark.timeout(_TIMEOUT + 30)
def test_spawn_returns_each_ranks_result_in_rank_order():
    out = spawn(_allreduce_rank, 3, args=(10,), timeout=_TIMEOUT)
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
    with pytest.raises(ValueError, match="world_size"):
        spawn(_sleep_forever, 0)
    with pytest.raises(ValueError, match="timeout"):
        spawn(_sleep_forever, 1, timeout=0)
