r"""Progress that reads well on a terminal and in a log file.

On a terminal (the stream is a TTY) :func:`progress` returns a tqdm bar. Anywhere else (a SLURM log, a pipe, CI) a
bar redraws with ``\r`` on every update, and a log file keeps every redraw; there it returns a :class:`LineProgress`
instead, which writes one plain line at every tenth of the total and at least every ``interval`` seconds, and a
last line when it closes.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["progress", "LineProgress"]


class LineProgress:
    """A progress report for logs: ``desc: 30% (30/100), 12 s, loss=2.31``, one line per tenth of ``total`` (with a
    total) and at least every ``interval`` seconds while updates come. tqdm's calls that the project uses
    (``update``, ``set_postfix``, ``set_postfix_str``, ``close``) return None.

    Args:
        total: the count at completion, or None (then lines come every ``interval`` seconds).
        desc: what is counted, first on each line.
        unit: the unit after the count (``batches``, ``layers``).
        file: the stream.
        interval: seconds between lines at most, while updates come.
        delay: no line at all before this many seconds (a short job stays silent).
        initial: the count already done (a resumed job).
    """

    def __init__(self, total: int | None, desc: str, *, unit: str = "", file: TextIO | None = None,
                 interval: float = 30.0, delay: float = 0.0, initial: int = 0):
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.interval, self.delay = interval, delay
        self.n, self.postfix = initial, ""
        self.start = self.last_time = time.monotonic()
        self.last_tenth = 10 * initial // total if total else 0
        self.last_n, self.closed = initial, False

    def _line(self, now: float) -> str:
        unit = f" {self.unit}" if self.unit else ""
        count = f"{100 * self.n // self.total}% ({self.n}/{self.total}{unit})" if self.total else f"{self.n}{unit}"
        postfix = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {count}, {now - self.start:.0f} s{postfix}"

    def _write(self, now: float) -> None:
        print(self._line(now), file=self.file or sys.stderr, flush=True)
        self.last_time, self.last_n = now, self.n

    def update(self, n: int = 1) -> None:
        """Counts ``n`` more; writes a line when a tenth of the total was passed or ``interval`` seconds went by."""
        self.n += n
        now = time.monotonic()
        if now - self.start < self.delay:
            return
        tenth = 10 * self.n // self.total if self.total else 0
        if tenth > self.last_tenth or now - self.last_time >= self.interval:
            self.last_tenth = tenth
            self._write(now)

    def set_postfix(self, **values) -> None:
        """Shown at the end of the next line, as ``key=value``."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, text: str) -> None:
        """Shown as given at the end of the next line (tqdm's ``set_postfix_str``)."""
        self.postfix = text

    def close(self) -> None:
        """Writes the last count, unless the last line already showed it (or the job ended within ``delay``)."""
        if self.closed:
            return
        self.closed = True
        now = time.monotonic()
        if self.n != self.last_n and now - self.start >= self.delay:
            self._write(now)


def progress(total: int | None, desc: str, *, unit: str = "it", file: TextIO | None = None, enabled: bool = True,
             delay: float = 0.0, leave: bool = True, interval: float = 30.0, initial: int = 0):
    """A progress bar on a terminal, periodic lines in a log, nothing when not ``enabled``.

    Args:
        total: the count at completion, or None.
        desc: the label.
        unit: the unit counted.
        file: the stream (``sys.stderr`` by default).
        enabled: False returns None (callers skip their updates: e.g. every rank but the first).
        delay: seconds before anything is shown (a short job shows nothing).
        leave: on a terminal, keep the finished bar on screen.
        interval: in a log, seconds between lines at most.
        initial: the count already done (a resumed job).

    Returns:
        A tqdm bar (a TTY), a :class:`LineProgress` (anything else), or None.
    """
    if not enabled:
        return None
    stream = file or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, delay=delay, leave=leave, initial=initial)
    return LineProgress(total, desc, unit="" if unit == "it" else unit, file=stream, interval=interval, delay=delay,
                        initial=initial)
