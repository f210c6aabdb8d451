"""``modelopt-moe export``: a distributed checkpoint of a quantized Megatron MoE model -> a servable Hugging Face
checkpoint (compressed-tensors or NVIDIA Model Optimizer format; for gpt-oss also ``hf-mxfp4``, the published MXFP4
layout of its fused experts).

The checkpoint is one written by ``modelopt_moe.plugins.megatron.save_sharded_checkpoint`` (weights, amaxes and the
quantization state, at any TP / EP layout). The model it holds is rebuilt from the Hugging Face config recorded
beside it (``modelopt_moe.export.save_hf_config(hf_dir, ckpt_dir)`` writes ``<ckpt_dir>/hf_config.json``) or given
with ``--hf-config``; the export runs on ``--world-size`` ranks at ``--tp`` / ``--ep`` (any layout loads any
checkpoint; under torchrun or srun, the launcher's ranks), rank 0 writing layer by layer with a progress bar.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .inputs import model_sizes, read_json_config, refuse_hf_model
from .noise import print_warnings
from .ranks import LayoutError, add_layout_args, check_layout, prints_here, run_ranks

__all__ = ["main"]

_DTYPES = ("bfloat16", "float16", "float32")
# export_hf's formats for a quantized model ("hf" writes unquantized models only); the engine check reads the first two
_FORMATS = ("compressed-tensors", "modelopt", "hf-mxfp4")
_CHECKED_FORMATS = ("compressed-tensors", "modelopt")


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelopt-moe export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="distributed checkpoint directory (save_sharded_checkpoint)")
    p.add_argument("--format", required=True, choices=_FORMATS,
                   help="output format (hf-mxfp4: gpt-oss's published layout, MXFP4 weight-only experts, every other "
                        "layer unquantized)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--hf-config", help="Hugging Face config.json or model directory of the model (default: the "
                                       "checkpoint's hf_config.json)")
    p.add_argument("--family", help="Hugging Face family, e.g. qwen3_moe or gpt_oss (default: from the config)")
    p.add_argument("--dtype", choices=_DTYPES,
                   help="parameter dtype of the rebuilt model, as the checkpoint was saved (default: the config's)")
    add_layout_args(p, tp=1, ep=1, world_size=1)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        refuse_hf_model(args.checkpoint, "--checkpoint", f"quantize and export it with modelopt-moe qat --hf "
                        f"{args.checkpoint} --config CONFIG --steps 0 --export OUT (or modelopt_moe.export.import_hf "
                        "into a Megatron model, then mtq.quantize and export_hf)")
    except ValueError as e:
        p.error(str(e))
    # The model's sizes bound the layout (the same rule as qat's and the demo's); an unreadable config is named below.
    config = read_json_config(args.hf_config or Path(args.checkpoint) / "hf_config.json")
    experts, tp_divides = model_sizes(config)
    args.layout = check_layout(p, args, num_experts=experts, tp_divides=tp_divides)
    return args


def _export_rank(rank: int, world_size: int, opts: dict[str, Any]) -> str:
    """One rank: rebuild the model, load the checkpoint (any layout), export (rank 0 writes)."""
    import torch

    from modelopt_moe.export import build_megatron_model, export_hf
    from modelopt_moe.plugins.megatron import destroy_model_parallel, init_model_parallel, load_sharded_checkpoint

    init_model_parallel(opts["tp"], opts["ep"])
    cfg = opts["hf_config"]
    dtype = getattr(torch, opts["dtype"] or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    model = build_megatron_model(cfg, perform_initialization=False, params_dtype=dtype)
    load_sharded_checkpoint(model, opts["checkpoint"])
    model.eval()
    out = export_hf(model, opts["out"], format=opts["format"], family=opts["family"], hf_config=cfg,
                    dtype=getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
                    progress=rank == 0)
    destroy_model_parallel()
    return str(out)


def main(argv: list[str]) -> int:
    """``modelopt-moe export``; returns the exit code (2: bad arguments or inputs, found before any process
    starts)."""
    args = _parse_args(argv)
    from modelopt_moe.checkpoint.errors import IncompleteCheckpointError
    from modelopt_moe.checkpoint.files import check_checkpoint_dir
    from modelopt_moe.export import ExportError, load_hf_config
    from modelopt_moe.export.families import family_for_architecture, get_family, read_hf_config
    from modelopt_moe.export.fused_mxfp4 import FILE_FORMAT, check_family
    from modelopt_moe.export.writer import check_out_dir

    try:  # everything checkable before starting processes
        check_checkpoint_dir(args.checkpoint)
        cfg = read_hf_config(args.hf_config) if args.hf_config else load_hf_config(args.checkpoint)
        family_for_architecture(cfg).arch_from_hf(cfg)
        family = get_family(args.family) if args.family else family_for_architecture(cfg)
        if args.format == FILE_FORMAT:  # export_hf's own check, before the model is loaded
            check_family(family)
        check_out_dir(args.out)
    except (ExportError, IncompleteCheckpointError) as e:
        print(f"modelopt-moe export: {e}", file=sys.stderr)
        return 2
    if prints_here():
        print(f"modelopt-moe export: {args.checkpoint} -> {args.out} ({args.format}), {args.layout.describe()}",
              flush=True)
    opts = {"checkpoint": str(Path(args.checkpoint)), "out": str(Path(args.out)), "format": args.format,
            "family": args.family, "hf_config": cfg, "dtype": args.dtype, "tp": args.tp, "ep": args.ep}
    try:
        ran = run_ranks(_export_rank, args.layout, args=(opts,), timeout=args.timeout)
    except LayoutError as e:
        print(f"modelopt-moe export: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as e:
        print(f"modelopt-moe export: failed: {e}", file=sys.stderr)
        return 1
    if not prints_here():
        return 0
    print(f"wrote {ran.results[0]}", flush=True)
    print_warnings(ran.warnings)
    if args.format not in _CHECKED_FORMATS:
        print(f"check: not run (the engine check reads {' and '.join(_CHECKED_FORMATS)} checkpoints; {args.format} is "
              "the published gpt-oss layout that transformers' Mxfp4Config and vLLM's gpt-oss loader read)", flush=True)
        return 0
    from modelopt_moe.export.check import check_all_engines

    passed, verdict = check_all_engines(ran.results[0])  # the engines' loader contracts, from the files
    print(verdict, flush=True)
    return 0 if passed else 1
