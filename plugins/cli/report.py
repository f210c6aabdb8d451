"""``modelopt-moe report``: render a run's ``report.md`` and plots again from its ``run.json``.

    modelopt-moe report --run report/run.json [--out DIR]

The demo writes ``run.json`` beside its report (the numbers, the loss curves, the per-expert statistics and the
quantizer summary); this command redraws the report from it, e.g. after editing the record or on another machine.
No processes, no model: it reads JSON and writes Markdown and PNGs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``modelopt-moe report``; returns the exit code (2: the record is missing or not a run record)."""
    p = argparse.ArgumentParser(prog="modelopt-moe report", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a run record (run.json) written by `modelopt-moe demo`")
    p.add_argument("--out", help="where to write report.md and the plots (default: the record's directory)")
    args = p.parse_args(argv)
    path = Path(args.run)
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"modelopt-moe report: --run {path}: no such file", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"modelopt-moe report: --run {path}: not JSON ({e})", file=sys.stderr)
        return 2
    from modelopt_moe.report.record import RunRecordError, check_run_record
    from modelopt_moe.report.writer import write_report

    try:  # before anything is written
        check_run_record(run, f"--run {path}")
    except RunRecordError as e:
        print(f"modelopt-moe report: {e}. Expected a run.json as `modelopt-moe demo` writes it; nothing was written",
              file=sys.stderr)
        return 2
    written = write_report(run, Path(args.out) if args.out else path.parent)
    print(f"report: {written[0]} ({len(written) - 1} plots)")
    return 0
