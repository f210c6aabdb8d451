"""``report.md`` and its plots from a run record (plain JSON: numbers, loss curves, per-expert statistics).

The demo writes the record (``run.json``) and calls :func:`write_report`; ``modelopt-moe report --run run.json``
renders it again.
"""

from __future__ import annotations

import math
from pathlib import Path

from . import plots

__all__ = ["write_report", "short_gemm_name"]


def short_gemm_name(name: str) -> str:
    """``decoder.layers.0.mlp.experts.linear_fc1`` -> ``layer 0 fc1``."""
    parts = name.split(".")
    layer = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p == "layers"), "?")
    gemm = parts[-1].replace("linear_", "")
    return f"layer {layer} {gemm}"


def _fmt(x, digits: int = 4) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def write_report(run: dict, out_dir: str | Path) -> list[Path]:
    """Writes ``report.md`` and the PNG plots of ``run`` into ``out_dir``; returns the written paths.

    ``run`` keys used: ``title``, ``setup`` (lines), ``stages`` (one line each), ``losses`` (name -> number),
    ``curves`` (label -> [[step, loss], ...]), ``stats`` (:class:`~.expert_stats.ExpertStats` as a dict),
    ``summary`` (the quantizer summary text).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    curves = {k: [tuple(p) for p in v] for k, v in run.get("curves", {}).items()}
    refs = {k: v for k, v in run.get("losses", {}).items() if k in ("bf16 teacher (held out)", "PTQ (held out)")}
    if curves:
        written.append(plots.loss_curves(curves, out / "loss_curve.png", title="Training loss: bf16 teacher, then QAD",
                                         references=refs))
    stats = run.get("stats") or {}
    wa = stats.get("weight_amax") or {}
    if wa:
        written.append(plots.expert_amax_heatmap([short_gemm_name(k) for k in wa], list(wa.values()),
                                                 out / "expert_weight_amax.png",
                                                 title="Expert weight amax (layer x global expert)"))
    own, shared = stats.get("weight_error_own") or {}, stats.get("weight_error_shared") or {}
    if own:
        n = len(next(iter(own.values())))
        mean = lambda table: [sum(v[e] for v in table.values()) / len(table) for e in range(n)]  # noqa: E731
        written.append(plots.expert_weight_errors(mean(shared), mean(own), out / "expert_weight_error.png",
                                                  title="Weight quantization error per expert (mean over layers)"))
    ia, seen = stats.get("input_amax") or {}, stats.get("input_seen") or {}
    if ia:
        panels = {short_gemm_name(k): (v, seen.get(k) or [True] * len(v)) for k, v in ia.items()}
        written.append(plots.expert_input_amax(panels, out / "expert_input_amax.png",
                                               title="Input amax per expert (hatched: saw no calibration token)"))
    md = [f"# {run.get('title', 'modelopt_moe run')}", ""]
    md += [f"- {line}" for line in run.get("setup", [])]
    md += ["", "## What each stage proved", ""]
    md += [f"{i + 1}. {line}" for i, line in enumerate(run.get("stages", []))]
    md += ["", "## Losses", "", "| | value |", "|---|---|"]
    md += [f"| {k} | {_fmt(v)} |" for k, v in run.get("losses", {}).items()]
    md += ["", "## Plots", ""]
    md += [f"![{p.stem}]({p.name})" for p in written]
    if run.get("summary"):
        md += ["", "## Quantizers", "", "```", run["summary"].rstrip(), "```"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return [out / "report.md", *written]
