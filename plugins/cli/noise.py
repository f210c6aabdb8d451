"""What the ``modelopt-moe`` commands print besides their own lines: known harmless third-party messages are
hidden (each listed below with why), the rest is shown once, and warnings come last, on rank 0.

A Megatron job prints a few dozen warnings that say nothing about the run (a missing optional package, an API
Megatron itself calls being deprecated), from every rank; they bury the one that matters (e.g. experts that saw no
calibration token). :data:`KNOWN_WARNINGS` and :data:`KNOWN_LOGS` are the one list of what is hidden. Anything not
listed is kept: ranks > 0 print no warnings (rank 0 sees the same ones), and rank 0 collects every other warning,
once each, for the command to print after its results (:func:`rank_output`, :func:`print_warnings`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Known", "KNOWN_WARNINGS", "KNOWN_LOGS", "hide_known_warnings", "rank_output", "print_warnings"]


@dataclass(frozen=True)
class Known:
    """A third-party message hidden by the commands: a regular expression matched at the message's start, and why
    it is harmless."""

    pattern: str
    why: str

    def matches(self, message: str) -> bool:
        """Whether ``message`` starts with a match of :attr:`pattern`."""
        return re.match(self.pattern, message) is not None


# Python warnings (``warnings.warn``), from the imports and calls the commands make.
KNOWN_WARNINGS = (
    Known(r"Transformer Engine and Apex are not installed",
          "Megatron without Transformer Engine and Apex (every CPU run): it takes torch's optimizers and its own "
          "multi-tensor helpers, which is what a CPU run needs"),
    Known(r"Apex is not installed\. Falling back to Torch Norm",
          "Megatron's local spec without Apex; the project builds its norms itself (sequence_parallel_norm)"),
    Known(r"absl\.logging is not installed", "Megatron's logging falls back to Python's logging"),
    Known(r"`torch\.jit\.script_method` is deprecated", "raised by torch when Megatron's modules are imported"),
    Known(r"The following imports from `dynamic_context\.py` will be removed",
          "a Megatron import notice for Megatron's own inference code, which the commands do not use"),
    Known(r"MimoModelConfig is experimental", "a Megatron model the commands do not use, seen at import"),
    Known(r"full scope is deprecated\. Use empty cuda_graph_modules",
          "Megatron's own TransformerConfig default; the commands use no CUDA graphs"),
    Known(r"`sequence_parallel` is set to `True`, but tensor model parallel size is 1",
          "Megatron turns sequence parallelism off at TP=1 itself, as intended"),
    Known(r"When using sequence parallelism it is recommended to set the environment variable "
          r"CUDA_DEVICE_MAX_CONNECTIONS", "a GPU speed hint of Megatron, printed on CPU too"),
    Known(r"Warning: tp_group is None, using default tp group",
          "Megatron's own layers call themselves without the group; the default group is the right one"),
    Known(r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
          "torch API names Megatron calls; nothing the user chose"),
    Known(r"WARNING: there is no optimizer on RANK \d+",
          "QAD trains the expert weights only: with expert parallelism a rank may hold no trainable parameter of "
          "one optimizer group (Megatron: 'may be expected if you have frozen sub-models')"),
    Known(r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to load in a "
          r"single process", "Megatron's checkpoint loader reads its metadata on each rank alone (no_dist=True)"),
    Known(r"The argument order of load has been changed",
          "torch's notice to callers of torch.distributed.checkpoint.load; Megatron calls it by keyword"),
    Known(r"Please use DTensor instead and we are deprecating ShardedTensor",
          "Megatron's distributed checkpoints are written with ShardedTensor; torch's deprecation notice only"),
    Known(r"You passed `quantization_config` or equivalent parameters to `from_pretrained`",
          "the demo loads the export with CompressedTensorsConfig(dequantize=True) on purpose; transformers says "
          "it takes the checkpoint's config, which dequantize then applies to"),
)

# Log records (``logging``): Megatron logs these with log_single_rank or logger.warning.
KNOWN_LOGS = (
    Known(r"GPTModel IS DEPRECATED", "Megatron's notice about its own model class; the project builds GPTModel "
                                     "because Megatron-Core 0.19 models and checkpoints are GPTModel"),
    Known(r"DistributedDataParallel: full_param_layout not provided",
          "Megatron computes the layout itself, as its own training loop lets it"),
    Known(r"MCore's async save is deprecated", "Megatron's default checkpoint strategy; saves here are synchronous"),
)


def _known(patterns, message: str) -> bool:
    return any(k.matches(message) for k in patterns)


def hide_known_warnings() -> None:
    """Hides the :data:`KNOWN_WARNINGS` in this process (the filters go first, so they win)."""
    for k in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=k.pattern)


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
            hide_known_warnings()

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
