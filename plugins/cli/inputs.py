"""Checks of the model and checkpoint directories given on the command line, before torch is imported.

What the files alone can tell is refused while the flags are parsed, in a fraction of a second, instead of by every
rank after its imports: a ``--hf`` directory that does not exist or holds no Hugging Face model, a Hugging Face
model given where a checkpoint this package saved is expected (``qat --load``, ``export --checkpoint``), and a
layout that the model's sizes do not allow (:func:`model_sizes`, for :func:`~.ranks.check_layout`). The full checks
that need torch (every tensor's shape from the safetensors headers) run next, still before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_hf_model_config", "read_json_config", "refuse_hf_model", "model_sizes"]

_HF_CONFIG = "config.json"
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_DCP_METADATA = ".metadata"  # what every distributed checkpoint holds


def read_json_config(path: str | Path) -> dict[str, Any]:
    """A model config for its sizes: ``path`` itself, or its ``config.json`` when it is a directory; {} where it
    cannot be read (a later check names the problem)."""
    path = Path(path)
    try:
        config = json.loads((path / _HF_CONFIG if path.is_dir() else path).read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def read_hf_model_config(hf_dir: str, flag: str) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory given as ``flag``.

    Raises:
        ValueError: the directory does not exist, or holds no readable ``config.json`` (a JSON object) or no
            safetensors weights; the message names the flag, the path and what was expected.
    """
    path = Path(hf_dir)
    expected = f"expected a Hugging Face model directory ({_HF_CONFIG} and {' or '.join(_HF_WEIGHTS)})"
    if not path.exists():
        raise ValueError(f"{flag} {hf_dir}: no such directory; {expected}")
    if not path.is_dir():
        raise ValueError(f"{flag} {hf_dir}: not a directory; {expected}")
    try:
        config = json.loads((path / _HF_CONFIG).read_text())
    except FileNotFoundError:
        raise ValueError(f"{flag} {hf_dir}: no {_HF_CONFIG}; {expected}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {hf_dir}: {_HF_CONFIG} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{flag} {hf_dir}: {_HF_CONFIG} holds {type(config).__name__}, expected a JSON object")
    if not any((path / name).is_file() for name in _HF_WEIGHTS):
        raise ValueError(f"{flag} {hf_dir}: no weights ({' or '.join(_HF_WEIGHTS)}); {expected}")
    return config


def refuse_hf_model(ckpt_dir: str, flag: str, instead: str) -> None:
    """Raises where ``ckpt_dir``, given as ``flag`` for a checkpoint this package saved, is a Hugging Face model
    directory instead (its ``config.json`` and safetensors weights, no distributed checkpoint); ``instead`` says
    what to run with it.

    Raises:
        ValueError: naming the flag, the directory, what it holds and ``instead``.
    """
    path = Path(ckpt_dir)
    weights = [name for name in _HF_WEIGHTS if (path / name).is_file()]
    if (path / _HF_CONFIG).is_file() and weights and not (path / _DCP_METADATA).exists():
        raise ValueError(f"{flag} {ckpt_dir} is a Hugging Face model ({_HF_CONFIG}, {weights[0]}), not a "
                         f"distributed checkpoint saved by modelopt-moe qat (--save) or save_sharded_checkpoint: "
                         f"{instead}")


def model_sizes(config: dict[str, Any], seq_len: int | None = None) -> tuple[int | None, dict[str, int]]:
    """What the layout must divide, from a Hugging Face model config: ``(the expert count, {name: size TP must
    divide})``: the attention heads and the vocabulary (split over TP), and with sequence parallelism the sequence
    length. Sizes the config lacks are left out."""
    tp_divides = {} if seq_len is None else {"--seq-len": seq_len}
    tp_divides.update({f"the model's {k}": config[k] for k in ("num_key_value_heads", "num_attention_heads",
                                                                 "vocab_size") if isinstance(config.get(k), int)})
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None)
    return (experts if isinstance(experts, int) else None), tp_divides
