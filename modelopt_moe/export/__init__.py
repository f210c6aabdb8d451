"""Hugging Face export and import: a QAT'd MoE model at any TP/EP to a servable checkpoint, and back.

Public API (all framework-free here; the framework adapter comes from the plugin registered through the core's one
registration call, :func:`modelopt_moe.quantization.conversion.register_framework_plugins`)::

    from modelopt_moe.export import build_megatron_model, import_hf, export_hf

    model = build_megatron_model("Qwen3-30B-A3B/")          # the matching Megatron-Core GPTModel, current TP/EP
    import_hf(model, "Qwen3-30B-A3B/")                      # HF bf16 weights into it, any TP/EP
    ...                                                     # mtq.quantize, QAT
    export_hf(model, "out/", format="compressed-tensors")   # or "modelopt"; every rank calls it, rank 0 writes

Formats: ``compressed-tensors`` (FP8 E4M3 per tensor / per channel, NVFP4; read by vLLM and transformers through the
compressed-tensors package; NVFP4 MoE experts through transformers only with :mod:`.transformers_compat`'s fix),
``modelopt`` (NVIDIA Model Optimizer's unified HF format: FP8, NVFP4, W4A16_NVFP4; read by vLLM, SGLang,
TensorRT-LLM) and ``hf`` (unquantized). Families: Qwen3-MoE (``Qwen3MoeForCausalLM``) and Mixtral
(``MixtralForCausalLM``). Linears quantized in different schemes (NVFP4 experts, FP8 attention) export as one
checkpoint with a scheme per layer (:mod:`.layer_schemes`). See docs/export.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from ..quantization.calib.tokens import expert_token_counts
from ..quantization.utils import rank
from ..quantization.weight_amax import update_weight_amax
from .calibration_coverage import DEFAULT_MIN_CALIB_TOKENS, warn_cold_experts
from .check import CheckReport, check_checkpoint
from .errors import ExportError
from .families import FAMILIES, Family, MoEArch, get_family, read_hf_config, register_family
from .registry import ExportAdapter, adapter_for, adapter_named, register_export_adapter
from .schemes import FORMATS

__all__ = [
    "export_hf",
    "import_hf",
    "build_megatron_model",
    "save_hf_config",
    "load_hf_config",
    "HF_CONFIG_FILE",
    "ExportError",
    "ExportAdapter",
    "register_export_adapter",
    "FORMATS",
    "FAMILIES",
    "Family",
    "MoEArch",
    "get_family",
    "register_family",
    "check_checkpoint",
    "CheckReport",
]

HF_CONFIG_FILE = "hf_config.json"


def _model_chunks(model, call: str) -> list[nn.Module]:
    """``[model]``, or the list of a stage's model chunks (virtual pipeline stages) as given.

    Raises:
        ExportError: an empty list.
    """
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    if not chunks:
        raise ExportError(f"{call}: an empty list of model chunks (expected a model or a stage's model chunks)")
    return chunks


def export_hf(model: nn.Module | list[nn.Module], out_dir: str | os.PathLike, *, format: str = "compressed-tensors",
              family: str | None = None, dtype=None, hf_config=None, progress: bool = True,
              base_model: str | None = None, min_calib_tokens: int = DEFAULT_MIN_CALIB_TOKENS) -> Path:
    """Writes ``model`` as a Hugging Face checkpoint with its model card (``README.md``: the format, the quantization
    per layer, the readers known to be exact and the fix a reader needs); every rank calls it, global rank 0 writes.

    Args:
        model: a (quantized) model of a framework with a registered adapter (Megatron-Core GPTModel, possibly
            wrapped in DDP / Float16Module), at any tensor / expert / pipeline parallel layout (each pipeline stage
            gathers its layers; the files are those of pipeline size 1), or the list of a stage's model chunks
            (Megatron's virtual pipeline stages).
        out_dir: the output directory; must not exist or be empty. Written to a temporary sibling and renamed when
            complete.
        format: ``compressed-tensors``, ``modelopt``, ``hf`` (unquantized weights) or ``hf-mxfp4`` (gpt-oss: MXFP4
            experts in the published fused layout, ``*_blocks`` / ``*_scales``, everything else unquantized).
        family: ``qwen3_moe`` / ``mixtral`` (or the architecture name); None infers it from the model (query/key
            norm: Qwen3-MoE, none: Mixtral) or from ``hf_config``.
        dtype: dtype of the unquantized tensors (default: the parameters' own).
        hf_config: a Hugging Face config (dict, file or directory) whose other keys (token ids, ...) the written
            ``config.json`` keeps; its architecture keys must match the model.
        progress: a progress bar per layer on rank 0.
        base_model: the Hugging Face id of the model it was trained from (``Qwen/Qwen3-30B-A3B``), for the model
            card's ``base_model`` (omitted when None).
        min_calib_tokens: warn naming the experts whose input quantizer calibrated on fewer tokens.

    Returns:
        The output directory.

    Raises:
        ExportError: an unsupported model, family or feature, a model that is not quantized, a quantization the
            format cannot express, a non-empty output directory (all before writing).

    Warns once per process, on rank 0, when it writes NVFP4 MoE experts in compressed-tensors format: transformers
    5.13 and later read them wrong without :func:`modelopt_moe.export.transformers_compat.fix_nvfp4_experts`; and
    naming the experts (global index, token count) whose input amax was calibrated on fewer than
    ``min_calib_tokens`` tokens (:mod:`.calibration_coverage`). Every scale written is finite, positive and normal.
    Where calibration counted each expert's tokens, ``calibration_tokens.json`` records them per expert linear, with
    ``min_calib_tokens`` (``modelopt-moe check`` reports them per layer).
    """
    chunks = _model_chunks(model, "export_hf")
    adapter = adapter_for(chunks[0])
    tokens: dict[str, dict[int, int]] = {}
    for chunk in chunks:  # the chunks name other layers (global names)
        # A dynamic weight amax holds the value of the last forward; after an optimizer step, recompute it from the
        # current weights so that the exported scales are those the next forward would use (same collectives on
        # every rank, in module order).
        update_weight_amax(chunk)
        tokens.update(expert_token_counts(chunk))  # one all_gather_object per chunk, every rank
    warn_cold_experts(chunks[0], min_calib_tokens, tokens)
    return adapter.export_hf(model, out_dir, format=format, family=family, dtype=dtype, hf_config=hf_config,
                             progress=progress, base_model=base_model, calibration_tokens=tokens,
                             min_calib_tokens=min_calib_tokens)


def import_hf(model: nn.Module | list[nn.Module], hf_dir: str | os.PathLike) -> None:
    """Loads an unquantized Hugging Face checkpoint (any dtype; gpt-oss's MXFP4 experts too, dequantized exactly)
    into the already built ``model``, at its tensor / expert / pipeline parallel layout; each rank reads only its
    slices (of its pipeline stage's layers).

    Args:
        model: a model of a framework with a registered adapter (Megatron-Core GPTModel, possibly wrapped), or the
            list of a stage's model chunks (Megatron's virtual pipeline stages, in ``vp_stage`` order: each chunk
            gets its own layers; the embedding goes to the chunk that holds it, the final norm and output layer, a
            tied embedding's copy included, to the chunk that holds them).
        hf_dir: the Hugging Face model directory.

    All or nothing: before the first parameter is written, ``config.json`` is checked against the model (every
    chunk), the index and the header of every shard against the config (each tensor present in the shard the index
    names, with the expected shape and a float dtype, no file shorter than its header says), and this rank's slices
    (of all its chunks) are read; on any error every chunk's parameters and buffers are exactly as before. Every rank
    checks the whole checkpoint, so all ranks raise the same error (no collective). Memory: this rank's share of the
    weights, once, on the host.

    Raises:
        ExportError: the checkpoint's config, files or tensors do not match the model, or a file cannot be read
            (names the file, the tensor, what was expected and what was found); one model at virtual pipeline
            stages, or a list that is not this stage's chunks in ``vp_stage`` order.
    """
    adapter_for(_model_chunks(model, "import_hf")[0]).import_hf(model, hf_dir)


def build_megatron_model(hf_dir_or_config, *, spec: str = "local", **overrides) -> nn.Module:
    """Builds the Megatron-Core ``GPTModel`` of a Hugging Face config at the current parallel state.

    Args:
        hf_dir_or_config: a Hugging Face model directory, ``config.json`` path, or config dict.
        spec: ``local`` (Megatron-Core modules, ``SequentialMLP`` experts; CPU or GPU) or ``te`` (Transformer Engine
            layers, ``TEGroupedMLP`` experts; GPU).
        **overrides: ``TransformerConfig`` fields (e.g. ``params_dtype``) or ``GPTModel`` arguments.

    Raises:
        ExportError: an unsupported architecture or feature; Megatron-Core cannot be imported.
    """
    return adapter_named("megatron").build_model(hf_dir_or_config, spec=spec, **overrides)


def save_hf_config(hf_dir_or_config, ckpt_dir: str | os.PathLike) -> Path:
    """Writes the model's Hugging Face config beside a distributed checkpoint (``<ckpt_dir>/hf_config.json``),
    so ``modelopt-moe export`` can rebuild the model; rank 0 writes (atomically), the others return.

    Returns:
        The file's path.
    """
    cfg = read_hf_config(hf_dir_or_config)
    path = Path(ckpt_dir) / HF_CONFIG_FILE
    if rank() == 0:
        if not path.parent.is_dir():
            raise ExportError(f"save_hf_config: checkpoint directory {path.parent} does not exist")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(cfg, indent=2) + "\n")
        os.replace(tmp, path)
    return path


def load_hf_config(ckpt_dir: str | os.PathLike) -> dict:
    """The Hugging Face config saved beside a checkpoint by :func:`save_hf_config`.

    Raises:
        ExportError: there is none (says how to provide one).
    """
    path = Path(ckpt_dir) / HF_CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{path} not found: the checkpoint does not record its model; save it with "
                          "modelopt_moe.export.save_hf_config(hf_dir, ckpt_dir), or pass --hf-config")
    return read_hf_config(path)
