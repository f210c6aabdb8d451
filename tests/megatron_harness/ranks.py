"""What the distributed tests do with their ranks' results: merge the tensors the ranks return, and record what a
list of calls raised."""

from collections.abc import Callable, Iterable

import torch


def merged_across_ranks(parts: Iterable[dict]) -> dict:
    """The ranks' dicts of tensors as one; ranks that hold the same entry (TP ranks of one stage, replicas) must hold
    the same bits."""
    merged = {}
    for part in parts:
        for key, t in part.items():
            assert key not in merged or torch.equal(merged[key], t), key
            merged[key] = t
    return merged


def errors_of(calls: dict[str, Callable[[], object]]) -> dict[str, str | None]:
    """Each call's error as ``"<type>: <message>"`` (None where it returned), so that a test names any other kind."""
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001  (the test names any other kind)
            errors[name] = f"{type(e).__name__}: {e}"
    return errors
