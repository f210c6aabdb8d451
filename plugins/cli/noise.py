"""What the ``modelopt-moe`` commands print besides their own lines: known harmless third-party messages are
hidden (:func:`modelopt_moe.plugins.quiet_known_warnings`, the public call; its module lists each with why), the
rest is shown once, and warnings come last, on rank 0.

Anything not listed is kept: ranks > 0 print no warnings (rank 0 sees the same ones), and rank 0 collects every other
warning, once each, for the command to print after its results (:func:`rank_output`, :func:`print_warnings`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from ..known_warnings import KNOWN_LOGS, KNOWN_WARNINGS, Known, quiet_known_warnings

__all__ = ["Known", "KNOWN_WARNINGS", "KNOWN_LOGS", "rank_output", "print_warnings"]


def _known(patterns, message: str) -> bool:
    return any(k.matches(message) for k in patterns)


class _LogFilter(logging.Filter):
    """Drops the known log messages and repeats of any message."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        key = f"{record.name}:{message}"
        if key in self.seen or _known(KNOWN_LOGS, message):
            return False
        self.seen.add(key)
        return True


def _origin(filename: str) -> str:
    """``modelopt_moe`` for the project's files, else the top-level package a warning came from."""
    here = Path(__file__).resolve().parents[2]  # the project root (modelopt_moe/ and plugins/ beside each other)
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return "?"
    if here in path.parents and "site-packages" not in path.parts:
        return "modelopt_moe"
    parts = path.parts
    return parts[parts.index("site-packages") + 1] if "site-packages" in parts[:-1] else path.name


@contextlib.contextmanager
def rank_output(rank: int) -> Iterator[list[str]]:
    """Within it: ranks > 0 show no warnings and no Megatron log below ERROR; rank 0 hides the known ones, shows
    other log records once, and collects every other warning once (in the yielded list, ``origin: message``) for
    the command to print last. If the block raises, rank 0 prints what it collected before the error goes on."""
    collected: list[str] = []
    megatron = logging.getLogger("megatron")
    level = megatron.level
    # One filter per handler: each handler shows a message once (a shared one would let only the first print it).
    filters = {h: _LogFilter() for h in [logging.lastResort, *logging.getLogger().handlers] if h is not None}
    with warnings.catch_warnings():
        if rank != 0:
            warnings.simplefilter("ignore")
            megatron.setLevel(logging.ERROR)
        else:
            warnings.simplefilter("default")  # each warning once per place it is raised, then deduplicated below
            quiet_known_warnings()

            def show(message, category, filename, lineno, file=None, line=None) -> None:
                kind = "" if category is UserWarning else f"{category.__name__}: "
                text = f"{_origin(filename)}: {kind}{message}"
                if text not in collected:
                    collected.append(text)

            warnings.showwarning = show
            for h, f in filters.items():  # Megatron logs through per-module loggers: filter where records print
                h.addFilter(f)
        try:
            yield collected
        except BaseException:
            print_warnings(collected, "warnings before the failure")
            raise
        finally:
            megatron.setLevel(level)
            for h, f in filters.items():
                h.removeFilter(f)


def print_warnings(messages: list[str], title: str = "warnings") -> None:
    """Prints the collected warnings on stderr, one block, after a command's own lines; the project's own last."""
    if messages:
        print(f"\n{title} ({len(messages)}):", file=sys.stderr)
        for m in sorted(messages, key=lambda m: m.startswith("modelopt_moe:")):
            print("  " + m.replace("\n", "\n  "), file=sys.stderr, flush=True)
