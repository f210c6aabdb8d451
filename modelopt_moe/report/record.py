"""The shape of a run record (``run.json``): what :func:`~.writer.write_report` reads, checked before it writes.

A record of the wrong shape (a list of stages that is empty, losses given as a list, a curve point that is not a
``[step, loss]`` pair) would otherwise give an empty report or a traceback from inside the plotting: it is refused
with every problem named by its key path, what was found and what was expected. Keys the report does not read are
left alone (a record may carry more).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

__all__ = ["RunRecordError", "run_record_problems", "check_run_record"]


class RunRecordError(ValueError):
    """A run record that is not of the shape the report reads; the message names the record, each key and what
    was expected."""


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_list(x: Any) -> bool:
    """A JSON array (a tuple too: the demo checks its record in memory, before it is written as JSON)."""
    return isinstance(x, list | tuple)


def _is_text(x: Any) -> bool:
    return isinstance(x, str)


def _numbers(x: Any) -> bool:
    return _is_list(x) and all(_is_number(v) for v in x)


def _shown(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _table(problems: list[str], key: str, value: Any, ok: Callable[[Any], bool], expected: str) -> None:
    """``value`` must be an object whose every entry passes ``ok``."""
    if not isinstance(value, dict):
        problems.append(f"{key}: expected an object (name -> {expected}), found {_shown(value)}")
        return
    for name, entry in value.items():
        if not ok(entry):
            problems.append(f"{key}[{name!r}]: expected {expected}, found {_shown(entry)}")


def run_record_problems(run: Any) -> list[str]:
    """Every way ``run`` differs from the record the report reads (empty: it can be rendered).

    The record is a JSON object with ``stages``, a non-empty list of lines; optionally ``title`` (text), ``setup``
    (lines), ``losses`` (name -> number or null), ``eval`` (model -> ``{"loss": [numbers], "kl": [numbers] or
    null}``, every model over the same batches), ``outcome`` (an object with a ``text``), ``curves`` (label ->
    ``[[step, loss], ...]``), ``stats`` (per-expert tables: GEMM -> one number per expert) and ``summary`` (text).
    """
    if not isinstance(run, dict):
        return [f"expected a JSON object with a 'stages' list, found {type(run).__name__} {_shown(run)}"]
    problems: list[str] = []
    stages = run.get("stages")
    if not _is_list(stages) or not stages or not all(_is_text(s) for s in stages):
        found = "no 'stages'" if "stages" not in run else _shown(stages)
        problems.append(f"stages: expected a non-empty list of lines (one per stage), found {found}")
    if "title" in run and not _is_text(run["title"]):
        problems.append(f"title: expected text, found {_shown(run['title'])}")
    for key in ("setup",):
        if key in run and not (_is_list(run[key]) and all(_is_text(s) for s in run[key])):
            problems.append(f"{key}: expected a list of lines, found {_shown(run[key])}")
    if "summary" in run and run["summary"] is not None and not _is_text(run["summary"]):
        problems.append(f"summary: expected text, found {_shown(run['summary'])}")
    if "losses" in run:
        _table(problems, "losses", run["losses"], lambda v: v is None or _is_number(v), "a number (or null)")
    if run.get("eval"):
        _eval_problems(problems, run["eval"])
    outcome = run.get("outcome")
    if outcome and not (isinstance(outcome, dict) and _is_text(outcome.get("text"))):
        problems.append(f"outcome: expected an object with a 'text', found {_shown(outcome)}")
    if "curves" in run:
        pair = lambda p: _is_list(p) and len(p) == 2 and all(_is_number(v) for v in p)  # noqa: E731
        _table(problems, "curves", run["curves"], lambda c: _is_list(c) and all(pair(p) for p in c),
               "a list of [step, loss] pairs")
    if run.get("stats"):
        _stats_problems(problems, run["stats"])
    return problems


def _eval_problems(problems: list[str], ev: Any) -> None:
    if not isinstance(ev, dict):
        problems.append(f"eval: expected an object of model -> {{'loss': [numbers], 'kl': [numbers] or null}}, "
                        f"found {_shown(ev)}")
        return
    batches = None
    for label, entry in ev.items():
        if not isinstance(entry, dict) or not _numbers(entry.get("loss")) or not entry.get("loss"):
            problems.append(f"eval[{label!r}]: expected {{'loss': [numbers], 'kl': [numbers] or null}}, found "
                            f"{_shown(entry)}")
            continue
        if entry.get("kl") is not None and not _numbers(entry["kl"]):
            problems.append(f"eval[{label!r}]['kl']: expected a list of numbers or null, found {_shown(entry['kl'])}")
        batches = len(entry["loss"]) if batches is None else batches
        if len(entry["loss"]) != batches:
            problems.append(f"eval[{label!r}]['loss']: {len(entry['loss'])} batches, the first model has {batches} "
                            "(every model is evaluated on the same batches)")


def _stats_problems(problems: list[str], stats: Any) -> None:
    if not isinstance(stats, dict):
        problems.append(f"stats: expected an object of per-expert tables, found {_shown(stats)}")
        return
    for key in ("weight_amax", "input_amax", "weight_error_own", "weight_error_shared"):
        if stats.get(key):
            _table(problems, f"stats.{key}", stats[key], lambda v: _numbers(v) and bool(v),
                   "a list of numbers (one per expert)")
    if stats.get("input_seen"):
        _table(problems, "stats.input_seen", stats["input_seen"],
               lambda v: v is None or (_is_list(v) and all(isinstance(s, bool) for s in v)),
               "a list of true/false (one per expert) or null")
    own, shared = stats.get("weight_error_own"), stats.get("weight_error_shared")
    if isinstance(own, dict) and own and not (isinstance(shared, dict) and shared.keys() == own.keys()):
        problems.append("stats.weight_error_shared: expected the same GEMMs as stats.weight_error_own "
                        f"({', '.join(own)})")
    elif isinstance(own, dict) and own:
        counts = {len(v) for table in (own, shared) for v in table.values() if _is_list(v)}
        if len(counts) > 1:
            problems.append(f"stats.weight_error_own / _shared: expected one number per expert, the same count for "
                            f"every GEMM, found counts {sorted(counts)}")


def check_run_record(run: Any, source: str = "the run record") -> None:
    """Raises :class:`RunRecordError` naming ``source`` and every problem :func:`run_record_problems` finds."""
    problems = run_record_problems(run)
    if problems:
        raise RunRecordError(f"{source}: not a run record of the shape the report reads ({len(problems)} "
                             f"problem{'s' if len(problems) != 1 else ''}): {'; '.join(problems)}")
