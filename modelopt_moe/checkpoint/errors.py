"""Checkpoint errors: each message names the file or key, the expected and the found value."""

__all__ = ["CheckpointMismatchError", "IncompleteCheckpointError", "CorruptCheckpointError"]


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model; the message names the key, the expected and the found values."""


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory that a save did not finish; the message names the directory and what is missing."""


class CorruptCheckpointError(IncompleteCheckpointError):
    """A checkpoint file that exists but cannot be read (truncated or damaged); the message names the file."""
