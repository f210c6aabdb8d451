"""Signals that stop a run (SIGTERM from a scheduler, SIGINT from Ctrl-C) as an exception, so that cleanup runs.

Python's default for SIGTERM ends the process at once: no ``finally`` block runs, processes it started are orphaned
and a half-written file stays. Within :func:`stop_on_signals`, the first SIGTERM or SIGINT raises
:class:`Interrupted` in the main thread instead (a ``KeyboardInterrupt``: ``except Exception`` lets it through, and
code that handles Ctrl-C handles it); later ones are ignored until the block ends, so the cleanup it starts runs to
its end (whatever does not stop in time, the launcher or the scheduler kills). Standard library only: the commands
install it before they import torch.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence

__all__ = ["Interrupted", "stop_on_signals", "received_signal", "handlers_are_default", "not_ignored", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: list[int] = []  # the signal the innermost active block turned into Interrupted
_active = [0]  # nesting depth of stop_on_signals blocks that installed their handlers


class Interrupted(KeyboardInterrupt):  # noqa: N818 (named like the KeyboardInterrupt it is)
    """A signal stopped the run: SIGINT (Ctrl-C) as Python reports it, and SIGTERM likewise.

    Attributes:
        signum: the signal (``signal.SIGTERM``, ``signal.SIGINT``).
        where: what the process was doing when it stopped, where the code that knows said so (e.g. ``"at step 7
            of 100"``); None otherwise.
    """

    def __init__(self, signum: int, where: str | None = None):
        super().__init__(signum, where)  # the arguments pickle it back (a rank reports it to its launcher)
        self.signum, self.where = int(signum), where

    @property
    def signame(self) -> str:
        """``"SIGTERM"``, ``"SIGINT"``, ..."""
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process the signal ended (143 for SIGTERM, 130 for
        SIGINT)."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {self.signame}" + (f" {self.where}" if self.where else "")


def received_signal() -> int | None:
    """The signal an active :func:`stop_on_signals` block received, or None. An error raised after it (a collective
    failing because a peer stopped first) is then part of the interruption, not a failure of its own."""
    return _received[-1] if _received else None


def handlers_are_default(signals: Sequence[int] = STOP_SIGNALS) -> bool:
    """Whether ``signals`` still have Python's default handlers (nobody installed their own)."""
    defaults = {signal.SIGINT: signal.default_int_handler}
    return all(signal.getsignal(s) in (signal.SIG_DFL, None, defaults.get(s)) for s in signals)


def not_ignored(signals: Sequence[int] = STOP_SIGNALS) -> tuple[int, ...]:
    """The ``signals`` this process does not ignore. An ignored signal is its parent's choice and stays ignored: a
    shell starts a script's background job (``cmd &``) with SIGINT ignored, so that Ctrl-C at the terminal stops the
    script and not the job."""
    return tuple(s for s in signals if signal.getsignal(s) is not signal.SIG_IGN)


@contextlib.contextmanager
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS, *, exit_after: bool = False) -> Iterator[None]:
    """Within the block, the first of ``signals`` raises :class:`Interrupted` in the main thread and the later ones
    are ignored; the previous handlers come back when the block ends. Inside another such block, or outside the main
    thread (where Python cannot install handlers), it does nothing.

    Args:
        signals: the signals that stop the block.
        exit_after: the process exits after an interrupted block: the signals then stay ignored (a second Ctrl-C
            would interrupt its exit with a traceback).
    """
    if _active[0] or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}

    def stop(signum, frame) -> None:
        del frame
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        _received.append(signum)
        raise Interrupted(signum)

    for s in signals:
        signal.signal(s, stop)
    _active[0] += 1
    try:
        yield
    finally:
        _active[0] -= 1
        stopped = bool(_received)
        _received.clear()
        if not (stopped and exit_after):
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
