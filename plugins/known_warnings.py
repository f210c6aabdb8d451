"""Known harmless third-party messages, and :func:`quiet_known_warnings`, the call that hides them.

A Megatron job prints a few dozen warnings per process that say nothing about the run (a missing optional package,
an API Megatron itself calls being deprecated); they bury the one that matters (e.g. experts that saw no calibration
token). :data:`KNOWN_WARNINGS` (Python warnings) and :data:`KNOWN_LOGS` (log records) are the one list of them,
each with why it is harmless; the ``modelopt-moe`` commands hide them, and a script using the library does the same
with one call::

    from modelopt_moe.plugins import quiet_known_warnings

    quiet_known_warnings()  # in every process, before megatron.core is imported

Anything not listed is left alone. Importing this module imports no framework.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

__all__ = ["Known", "KNOWN_WARNINGS", "KNOWN_LOGS", "quiet_known_warnings"]


@dataclass(frozen=True)
class Known:
    """A known harmless third-party message: a regular expression matched at the message's start, why it is
    harmless, and for a log record the logger that emits it."""

    pattern: str
    why: str
    logger: str = ""

    def matches(self, message: str) -> bool:
        """Whether ``message`` starts with a match of :attr:`pattern`."""
        return re.match(self.pattern, message) is not None


# Python warnings (``warnings.warn``), from importing and running Megatron, torch.distributed and transformers.
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
                                     "because Megatron-Core 0.19 models and checkpoints are GPTModel",
          "megatron.core.models.gpt.gpt_model"),
    Known(r"DistributedDataParallel: full_param_layout not provided",
          "Megatron computes the layout itself, as its own training loop lets it",
          "megatron.core.distributed.distributed_data_parallel"),
    Known(r"MCore's async save is deprecated", "Megatron's default checkpoint strategy; saves here are synchronous",
          "megatron.core.dist_checkpointing.strategies.torch"),
)


class _KnownLogs(logging.Filter):
    """Drops the known log records of one logger."""

    def __init__(self, known: list[Known]):
        super().__init__()
        self.known = known

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(k.matches(message) for k in self.known)


def quiet_known_warnings() -> None:
    """Hides the known harmless third-party messages in this process: every :data:`KNOWN_WARNINGS` (warning filters
    put first, so they win over earlier ones) and every :data:`KNOWN_LOGS` (a filter on the logger that emits it,
    which holds whenever that logger is created and however logging is configured). Other messages are unchanged.

    Call it in every process of the job (a module-level call runs in ranks that ``spawn`` or ``torchrun`` start too),
    before ``megatron.core`` is imported: most of these warnings are raised by Megatron's imports. Calling it again
    changes nothing.
    """
    for k in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=k.pattern)
    by_logger: dict[str, list[Known]] = {}
    for k in KNOWN_LOGS:
        by_logger.setdefault(k.logger, []).append(k)
    for name, known in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownLogs) for f in logger.filters):
            logger.addFilter(_KnownLogs(known))
