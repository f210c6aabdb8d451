"""Joining a job that a cluster launcher started: torchrun's variables, SLURM's, and real process groups."""

import os
import subprocess
import sys
import textwrap

import pytest

from modelopt_moe.launch import LaunchEnvironment, free_port, launched_environment

pytestmark = pytest.mark.slow  # launcher processes

_CHILD = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from modelopt_moe.launch import init_from_environment
    place = init_from_environment()
    t = torch.tensor([float(place.rank + 1)])
    dist.all_reduce(t)
    line = f"{place.launcher} {place.rank} {place.world_size} {place.local_rank} {int(t.item())}"
    with open(os.path.join(sys.argv[1], f"rank{place.rank}.txt"), "w") as f:  # ranks share stdout: one file each
        f.write(line)
    dist.destroy_process_group()
""")


def test_torchrun_variables_come_first():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
    assert launched_environment(env) == LaunchEnvironment("torchrun", 3, 4, 1)


def test_slurm_variables_when_torchrun_is_absent():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert launched_environment(env) == LaunchEnvironment("slurm", 5, 8, 1)


def test_no_launcher_and_bad_values():
    assert launched_environment({}) is None
    with pytest.raises(ValueError, match=r"RANK='x': expected an integer"):
        launched_environment({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"slurm: rank 4 is outside \[0, world_size=4\)"):
        launched_environment({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"})


def _lines(out_dir, n):
    return [(out_dir / f"rank{r}.txt").read_text().split() for r in range(n)]


def _run_ranks(envs, out_dir):
    """Starts one process per environment (on top of ours, without torchrun's variables) and reads each one's line."""
    ours = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(out_dir)], env={**ours, **e},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in envs]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    return _lines(out_dir, len(envs))


@pytest.mark.timeout(180)
def test_processes_started_like_srun_join_one_group(tmp_path):
    # What srun sets per task; the rendezvous address comes from SLURM_LAUNCH_NODE_IPADDR.
    base = {"SLURM_NTASKS": "2", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    outs = _run_ranks([{**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)], tmp_path)
    assert outs == [["slurm", "0", "2", "0", "3"], ["slurm", "1", "2", "1", "3"]]


@pytest.mark.timeout(180)
def test_torchrun_starts_ranks_that_join_one_group(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _lines(tmp_path, 2) == [["torchrun", "0", "2", "0", "3"], ["torchrun", "1", "2", "1", "3"]]
