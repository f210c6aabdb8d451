"""``report.md`` and its plots from a run record (plain JSON: numbers, loss curves, per-expert statistics).

The demo writes the record (``run.json``) and calls :func:`write_report`; ``modelopt-moe report --run run.json``
renders it again.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..numerics import FORMATS
from . import plots
from .outcome import mean_and_noise
from .record import check_run_record

__all__ = ["write_report", "short_gemm_name"]


def short_gemm_name(name: str) -> str:
    """``decoder.layers.0.mlp.experts.linear_fc1`` -> ``layer 0 fc1``."""
    parts = name.split(".")
    layer = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p == "layers"), "?")
    gemm = parts[-1].replace("linear_", "")
    return f"layer {layer} {gemm}"


def _fmt(x) -> str:
    """Five significant digits: a KL of 1.2e-05 stays 1.2e-05 (not 0.0000), a loss of 3.5292 stays 3.5292."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.5g}" if isinstance(x, (int, float)) else str(x)


def _held_out(run: dict) -> tuple[list[str], dict[str, tuple[float, float | None]]]:
    """The held-out table and, for the plot, each model's loss minus the teacher's, paired over the same batches
    (the batches differ far more from each other than the models do: unpaired, the spread would hide everything)."""
    ev = run.get("eval") or {}
    if not ev:
        return [], {}
    base_label = next(iter(ev))
    base = ev[base_label]["loss"]
    top1 = any("top1" in v for v in ev.values())  # teacher-forced top-1 agreement (runs that measured it)
    md = ["", f"## Held out ({len(base)} batches; mean ± standard error over them)", "",
          f"| | loss | minus the {base_label}'s (paired by batch) | KL to the teacher |"
          + (" the teacher's top-1 token (% of positions) |" if top1 else ""),
          "|---|---|---|---|" + ("---|" if top1 else "")]
    points = {}

    def cell(values, fmt: str = "#.5g") -> str:
        if values is None:
            return "-"
        mean, noise = mean_and_noise(values)
        return f"{mean:{fmt}}" + ("" if math.isnan(noise) else f" ± {noise:.2g}")

    for label, values in ev.items():
        diff = None if label == base_label else [a - b for a, b in zip(values["loss"], base, strict=True)]
        md.append(f"| {label} | {cell(values['loss'])} | {cell(diff, '+.2g')} | {cell(values.get('kl'), '.3g')} |"
                  + (f" {cell(values.get('top1') and [100 * v for v in values['top1']], '.1f')} |" if top1 else ""))
        if diff is not None:
            mean, noise = mean_and_noise(diff)
            points[label] = (mean, None if math.isnan(noise) else noise)
    outcome = run.get("outcome")
    if outcome:
        md += ["", f"**What QAD did:** {outcome['text']}."]
    return md, points


def _generation(run: dict) -> list[str]:
    """The greedy-generation table: what the KL does not show (a student that stops later, or never)."""
    gen = run.get("generation")
    if not gen:
        return []
    md = ["", f"## Greedy generation ({gen['prompts']} held-out prompts of {gen['prompt tokens']} tokens, up to "
              f"{gen['new tokens']} new tokens, end token {gen['end token']})", "",
          "| | the teacher's tokens (positions both generated) | end rate | mean length |", "|---|---|---|---|"]
    for label, g in gen["models"].items():
        same = g["same tokens as the reference"]
        md.append(f"| {label} | {'-' if same is None else f'{same:.1%}'} | {g['end rate']:.0%} | "
                  f"{g['mean length']:.1f} |")
    return md


def _weight_error_note(stats: dict) -> str | None:
    """Why a per-expert amax may look no better than a shared one: block-scaled formats."""
    formats, sizes = stats.get("weight_format") or {}, stats.get("weight_block_size") or {}
    blocks = {fmt: sizes.get(k) or (FORMATS[fmt].block_length if fmt in FORMATS else None)
              for k, fmt in formats.items()}
    blocks = {fmt: size for fmt, size in blocks.items() if size}
    if not blocks:
        return None
    fmt, size = next(iter(blocks.items()))
    spec = FORMATS.get(fmt)
    if spec is not None and spec.block_scale is not None:  # two-level: quantized block scales under the amax
        return (f"{spec.label}: every block of {size} weights has its own {spec.block_scale.upper()} scale; "
                "the per-tensor amax only sets the range of those block scales, so a per-expert amax changes the "
                "error little (either may come out lower: the block scales round differently)")
    return (f"{fmt} in blocks of {size}: every block has its own scale from its own values; the per-tensor amax does "
            "not set the step sizes, so a per-expert amax changes the error little")


def write_report(run: dict, out_dir: str | Path) -> list[Path]:
    """Writes ``report.md`` and the PNG plots of ``run`` into ``out_dir``; returns the written paths.

    ``run`` keys used (all optional but ``stages``): ``title``, ``setup`` (lines), ``stages`` (one line each),
    ``losses`` (name -> number), ``eval`` (model -> ``{"loss": [per batch], "kl": [per batch] or None}``, and
    ``"top1": [per batch]`` where measured), ``outcome`` (:func:`~.outcome.qad_outcome`), ``generation``
    (``prompts``, ``prompt tokens``, ``new tokens``, ``end token``, ``models``: model -> ``{"same tokens as the
    reference", "end rate", "mean length"}``), ``curves`` (label -> [[step, loss], ...]), ``stats``
    (:class:`~.expert_stats.ExpertStats` as a dict), ``summary`` (the quantizer summary text).

    Raises:
        RunRecordError: ``run`` is not of that shape (:func:`~.record.check_run_record`); nothing is written.
    """
    check_run_record(run)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    curves = {k: [tuple(p) for p in v] for k, v in run.get("curves", {}).items()}
    losses = run.get("losses", {})
    held_md, held_points = _held_out(run)
    qad_panel = next((k for k in curves if k.startswith("QAD")), None)
    refs = {}
    if qad_panel and "KL to teacher after PTQ" in losses and "KL to teacher after QAD" in losses:
        refs[qad_panel] = {"held-out KL after PTQ": losses["KL to teacher after PTQ"],
                           "held-out KL after QAD": losses["KL to teacher after QAD"]}
    if curves:
        base = next(iter(run.get("eval") or {}), None)
        written.append(plots.loss_curves(
            curves, out / "loss_curve.png", title="bf16 teacher training, QAD, and the held-out loss of each model",
            references=refs, held_out=held_points, log_panels=[qad_panel] if qad_panel else [],
            held_out_baseline=base))
    stats = run.get("stats") or {}
    wa = stats.get("weight_amax") or {}
    if wa:
        written.append(plots.expert_amax_heatmap([short_gemm_name(k) for k in wa], list(wa.values()),
                                                 out / "expert_weight_amax.png",
                                                 title="Expert weight amax (layer x global expert, every rank's)"))
    own, shared = stats.get("weight_error_own") or {}, stats.get("weight_error_shared") or {}
    if own:
        n = len(next(iter(own.values())))
        mean = lambda table: [sum(v[e] for v in table.values()) / len(table) for e in range(n)]  # noqa: E731
        written.append(plots.expert_weight_errors(mean(shared), mean(own), out / "expert_weight_error.png",
                                                  title="Weight quantization error per expert (mean over layers)",
                                                  note=_weight_error_note(stats)))
    ia, seen = stats.get("input_amax") or {}, stats.get("input_seen") or {}
    if ia:
        panels = {short_gemm_name(k): (v, seen.get(k) or [True] * len(v)) for k, v in ia.items()}
        written.append(plots.expert_input_amax(panels, out / "expert_input_amax.png",
                                               title="Input amax per expert (hatched: saw no calibration token)"))
    md = [f"# {run.get('title', 'modelopt_moe run')}", ""]
    md += [f"- {line}" for line in run.get("setup", [])]
    md += ["", "## What each stage proved", ""]
    md += [f"{i + 1}. {line}" for i, line in enumerate(run.get("stages", []))]
    md += held_md
    md += _generation(run)
    md += ["", "## Numbers", "", "| | value |", "|---|---|"]
    md += [f"| {k} | {_fmt(v)} |" for k, v in losses.items()]
    md += ["", "## Plots", ""]
    md += [f"![{p.stem}]({p.name})" for p in written]
    if run.get("summary"):
        md += ["", "## Quantizers (every rank's experts, by global index)", "", "```", run["summary"].rstrip(), "```"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return [out / "report.md", *written]
