"""``modelopt-moe check``: a Hugging Face checkpoint (ours or another tool's) against a serving engine's loader
contract, without a GPU: tensor names, dtypes and shapes, every expert's scales present, finite, positive and normal,
gate and up sharing the scales the engine fuses, and how far each expert's input scale is from the one the engine
uses (see ``modelopt_moe.export.check``). Prints the one-line verdict (``--details``: every finding); exits 1 when
the checkpoint fails, 2 on a usage error or an unreadable checkpoint.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]

_ENGINES = ("vllm", "sglang", "trtllm")


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelopt-moe check", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="Hugging Face checkpoint directory (config.json and safetensors shards)")
    p.add_argument("--engine", choices=_ENGINES, action="append",
                   help="serving engine whose loader to check against (repeatable; default: all three)")
    p.add_argument("--details", action="store_true", help="print every finding and the input-scale spread per layer")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """``modelopt-moe check``; returns the exit code (0: passes for every engine asked)."""
    args = _parse_args(argv)
    from modelopt_moe.export import ExportError, check_checkpoint

    failed = False
    for engine in args.engine or _ENGINES:
        try:
            report = check_checkpoint(args.checkpoint, engine=engine)
        except ExportError as e:
            print(f"modelopt-moe check: {e}", file=sys.stderr)
            return 2
        print(report.details() if args.details else report.verdict(), flush=True)
        failed |= not report.ok
    return 1 if failed else 0
