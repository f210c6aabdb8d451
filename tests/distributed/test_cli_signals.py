"""``modelopt-moe qat`` stopped by a signal, as a scheduler or a terminal stops it: SIGTERM to the one process a user
started (which spawned the ranks), Ctrl-C (SIGINT to the terminal's whole process group). Every process the run
started is gone within seconds, the command names where it stopped and its last complete checkpoint, exits 128 + the
signal, leaves no unfinished save behind, and a run with ``--load`` resumes from the named checkpoint. The command is
the installed console script, started from a working directory that holds the user's data module (``--data
my_batches:batches``, found there as ``python -m`` would find it)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from limits import seconds

from modelopt_moe.quantization.config import preset_path

COMMAND = str(Path(sys.executable).parent / "modelopt-moe")
DATA_MODULE = '''
import torch


def batches(split, num_batches, batch_size, seq_len, offset):
    g = torch.Generator().manual_seed(offset + (0 if split == "calib" else 1))
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(seq_len, dtype=torch.int64).expand(batch_size, seq_len).contiguous()
    out = []
    for _ in range(num_batches):
        t = torch.randint(0, 256, (batch_size, seq_len + 1), generator=g)
        out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(), "position_ids": positions,
                    "attention_mask": mask})
    return out
'''
# What a stopped run may take, all processes together, on a loaded two-core machine (about 2 s idle); before the
# change, the processes the ranks had started were still there 100 s later.
STOPPED_WITHIN_S = 30.0


def _hf_checkpoint(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = json.loads(preset_path("qwen3_moe_tiny.json").read_text())
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16).save_pretrained(path)
    return path


def _as_a_terminal_starts_it() -> None:
    """A terminal's foreground job: every signal's default action and none blocked, whatever this test process
    inherited (under ``nohup`` or as a background job its SIGINT is ignored, which the command would keep)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _start(cwd, *args, preexec_fn=_as_a_terminal_starts_it):
    """``modelopt-moe qat ARGS`` in a session of its own (as a terminal's foreground job), output to files."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH="",
               MODELOPT_MOE_START_METHOD="spawn")
    out, err = open(cwd / "out.txt", "w"), open(cwd / "err.txt", "w")  # noqa: SIM115 (closed by _finish)
    proc = subprocess.Popen([COMMAND, "qat", *map(str, args)], cwd=cwd, env=env, stdout=out, stderr=err,
                            start_new_session=True, preexec_fn=preexec_fn)
    return proc, (out, err)


def _saved_iteration(ckpt: Path) -> int | None:
    try:
        return json.loads((ckpt / "modelopt_moe_complete.json").read_text())["iteration"]
    except (OSError, ValueError, KeyError):
        return None


def _wait_for_checkpoint(proc, ckpt: Path, cwd: Path, after: int | None = None) -> int | None:
    """Waits until ``ckpt`` holds a complete checkpoint (of an iteration above ``after``); returns its iteration."""
    deadline = time.monotonic() + seconds(600)
    while time.monotonic() < deadline:
        assert proc.poll() is None, (cwd / "out.txt").read_text()[-2000:] + (cwd / "err.txt").read_text()[-4000:]
        if (ckpt / "modelopt_moe_complete.json").is_file():
            iteration = _saved_iteration(ckpt)
            if after is None or (iteration is not None and iteration > after):
                return iteration
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint after iteration {after} in {ckpt}")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop(proc, files, send) -> tuple[int, float, list]:
    """Sends the signal (``send(pid)``); returns (exit code, seconds until every process the run had started was
    gone, the ones still alive then)."""
    started = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(started) >= 3, started  # the launcher and its two ranks (and what they started)
    t0 = time.monotonic()
    send(proc.pid)
    code = proc.wait(timeout=seconds(120))
    alive = started
    while alive and time.monotonic() < t0 + seconds(STOPPED_WITHIN_S) + 5:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.1)
    for f in files:
        f.close()
    return code, time.monotonic() - t0, alive


def test_sigterm_and_ctrl_c_stop_every_rank_name_the_checkpoint_and_resume(tmp_path):
    groups = []
    try:
        _signal_and_resume(tmp_path, groups)
    finally:  # whatever a failing run left, even processes orphaned in its process group
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def _signal_and_resume(tmp_path, groups):
    hf = _hf_checkpoint(tmp_path / "hf")
    cwd = tmp_path / "job"
    cwd.mkdir()
    (cwd / "my_batches.py").write_text(DATA_MODULE)
    ckpt = cwd / "ckpt"
    common = ["--hf", hf, "--config", "fp8_default.yaml", "--data", "my_batches:batches", "--world-size", "2",
              "--cpu", "--tp", "1", "--ep", "2", "--steps", "1000", "--micro-batches", "1", "--batch-size", "2",
              "--seq-len", "16", "--calib-batches", "1", "--save", ckpt, "--save-interval", "2"]

    # SIGTERM to the one process the user started: it passes the signal on to the ranks it spawned
    proc, files = _start(cwd, *common)
    groups.append(proc.pid)
    _wait_for_checkpoint(proc, ckpt, cwd)
    code, took, alive = _stop(proc, files, lambda pid: os.kill(pid, signal.SIGTERM))
    err = (cwd / "err.txt").read_text()
    assert code == 128 + signal.SIGTERM, err[-4000:]
    assert not alive, (alive, took)
    assert took < seconds(STOPPED_WITHIN_S), took
    found = re.search(r"modelopt-moe qat: interrupted by SIGTERM (at step \d+ of 1000|while saving iteration \d+); "
                      r"last complete checkpoint: iteration (\d+) in (\S+) \(resume with --load \S+\)", err)
    assert found, err[-4000:]
    named = int(found.group(2))
    assert Path(found.group(3)) == ckpt
    assert _saved_iteration(ckpt) == named  # the checkpoint named is the one on disk
    assert not Path(f"{ckpt}.tmp").exists()
    assert not Path(f"{ckpt}.old").exists()
    assert "Traceback" not in err, err[-4000:]

    # resumed from the named checkpoint (the steps go on from there), then Ctrl-C: SIGINT to the whole group
    proc, files = _start(cwd, *common, "--load", ckpt)
    groups.append(proc.pid)
    later = _wait_for_checkpoint(proc, ckpt, cwd, after=named)
    assert later == named + 2  # the first save after the resume: steps named+1 and named+2 ran
    code, took, alive = _stop(proc, files, lambda pid: os.killpg(pid, signal.SIGINT))
    out, err = (cwd / "out.txt").read_text(), (cwd / "err.txt").read_text()
    assert f"resuming from {ckpt}" in out
    assert code == 128 + signal.SIGINT, err[-4000:]
    assert not alive, (alive, took)
    assert took < seconds(STOPPED_WITHIN_S), took
    found = re.search(r"modelopt-moe qat: interrupted by SIGINT (at step (\d+) of 1000|while saving iteration \d+); "
                      r"last complete checkpoint: iteration (\d+) in", err)
    assert found, err[-4000:]
    assert int(found.group(3)) == _saved_iteration(ckpt) >= later
    assert "Traceback" not in err, err[-4000:]
    assert "KeyboardInterrupt" not in err
    assert not Path(f"{ckpt}.tmp").exists()


WAITING_DATA_MODULE = '''
import os
import time


def batches(split, num_batches, batch_size, seq_len, offset):
    open(f"reading.{os.getpid()}", "w").close()  # a rank is running
    time.sleep(600)
'''


def _as_a_script_starts_a_background_job() -> None:
    """``modelopt-moe ... &`` in a shell script: SIGINT ignored (Ctrl-C at the terminal is for the script)."""
    _as_a_terminal_starts_it()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_background_job_ignores_ctrl_c_and_stops_on_sigterm(tmp_path):
    """Started with SIGINT ignored, ``modelopt-moe qat`` and its ranks keep ignoring it (Ctrl-C to the process
    group leaves the run going), and a SIGTERM still stops every process it started, with 143."""
    hf = _hf_checkpoint(tmp_path / "hf")
    cwd = tmp_path / "job"
    cwd.mkdir()
    (cwd / "waiting_batches.py").write_text(WAITING_DATA_MODULE)
    proc, files = _start(cwd, "--hf", hf, "--config", "fp8_default.yaml", "--data", "waiting_batches:batches",
                         "--world-size", "2", "--cpu", "--tp", "1", "--ep", "2", "--steps", "1",
                         "--batch-size", "2", "--seq-len", "16", "--calib-batches", "1",
                         preexec_fn=_as_a_script_starts_a_background_job)
    try:
        deadline = time.monotonic() + seconds(600)
        while len(list(cwd.glob("reading.*"))) < 2:
            assert proc.poll() is None, (cwd / "err.txt").read_text()[-4000:]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        started = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(2)
        assert all(_running(pid) for pid in started), (cwd / "err.txt").read_text()[-4000:]
        code, took, alive = _stop(proc, files, lambda pid: os.kill(pid, signal.SIGTERM))
        err = (cwd / "err.txt").read_text()
        assert code == 128 + signal.SIGTERM, err[-4000:]
        assert not alive, (alive, took)
        assert "modelopt-moe qat: interrupted by SIGTERM" in err, err[-4000:]
        assert "Traceback" not in err, err[-4000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
