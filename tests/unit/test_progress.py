"""Progress: a bar on a terminal, plain periodic lines in a log (no carriage-return redraws)."""

import io
import os

from tqdm import tqdm

from modelopt_moe.progress import LineProgress, progress


def test_a_log_gets_a_line_per_tenth_and_no_redraws():
    log = io.StringIO()
    bar = progress(40, "QAD", unit="steps", file=log)
    assert isinstance(bar, LineProgress)
    for step in range(40):
        bar.set_postfix(loss=f"{1e-5 * (step + 1):.4g}")
        assert bar.update(1) is None  # usable from a forward hook, whose return value would replace the output
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 10, lines  # one per tenth; close() adds nothing when the last line showed the end
    assert lines[0].startswith("QAD: 10% (4/40 steps), ")
    assert lines[0].endswith("loss=4e-05")
    assert lines[-1].startswith("QAD: 100% (40/40 steps)")


def test_without_a_total_lines_come_with_time_and_at_close():
    log = io.StringIO()
    bar = LineProgress(None, "calibrating", unit="batches", file=log, interval=0.0)
    bar.update(1)
    bar.update(2)
    bar.close()
    bar.close()
    assert log.getvalue().splitlines()[:2] == ["calibrating: 1 batches, 0 s", "calibrating: 3 batches, 0 s"]
    assert len(log.getvalue().splitlines()) == 2


def test_a_short_job_under_its_delay_stays_silent_and_a_resumed_one_starts_where_it_was():
    log = io.StringIO()
    bar = progress(None, "calibrating", file=log, delay=60.0)
    bar.update(5)
    bar.close()
    assert log.getvalue() == ""
    resumed = progress(10, "QAT", file=log, initial=5)
    resumed.update(1)
    assert log.getvalue().startswith("QAT: 60% (6/10)")


def test_a_terminal_gets_a_tqdm_bar_and_disabled_gets_none():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as tty:
        bar = progress(3, "export", unit="layer", file=tty)
        assert isinstance(bar, tqdm)
        bar.close()
    os.close(leader)
    assert progress(3, "export", enabled=False) is None
