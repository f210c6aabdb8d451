"""PNG plots of a QAT run, from plain data (matplotlib, Agg backend: no display needed).

Each function takes numbers (no models), writes one PNG and returns its path, so the same plots serve any framework.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["loss_curves", "expert_amax_heatmap", "expert_weight_errors", "expert_input_amax"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def loss_curves(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path, *,
                title: str = "Training loss", references: Mapping[str, Mapping[str, float]] | None = None,
                held_out: Mapping[str, tuple[float, float | None]] | None = None,
                held_out_baseline: str | None = None, log_panels: Sequence[str] = ()) -> Path:
    """One panel per phase (``{label: [(step, loss), ...]}``, steps continuing across phases), each on its own y
    scale (an LM loss of ~2.5 and a KL of ~1e-4 do not share an axis).

    Args:
        curves: the training curves, one panel each.
        path: the PNG to write.
        title: the figure's title.
        references: ``{panel label: {line label: value}}``: horizontal lines in that panel (e.g. the held-out KL
            before and after QAD in the QAD panel), each in its own colour and dash, its value in the legend; the y
            axis takes them in.
        held_out: ``{label: (mean, noise)}``: a last panel of points with error bars, its y axis fitted to them
            (e.g. the held-out loss of the PTQ and the QAD model minus the teacher's, paired by batch: a difference
            of 1e-3 on a loss of 3.5 stays visible; as horizontal lines in a training panel, the losses would lie on
            top of each other).
        held_out_baseline: with ``held_out`` given as differences, what they are measured from: drawn as the zero
            line, labelled.
        log_panels: panel labels drawn on a log y scale (a KL that falls by orders of magnitude).
    """
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    phases = [(label, points) for label, points in curves.items() if points]
    n = max(1, len(phases) + bool(held_out))
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.2), squeeze=False)
    dashes = ("--", ":", "-.", (0, (5, 1)))
    for i, (ax, (label, points)) in enumerate(zip(axes.flat, phases, strict=False)):
        steps, losses = zip(*points, strict=True)
        ax.plot(steps, losses, marker="o" if len(points) < 40 else None, markersize=3, color=f"C{i}",
                label=f"{label} (training batches)")
        refs = (references or {}).get(label, {})
        for j, (ref, value) in enumerate(refs.items()):
            ax.axhline(value, linestyle=dashes[j % len(dashes)], linewidth=1.6, color=f"C{j + len(phases) + 1}",
                       label=f"{ref}: {value:.4g}")
        values = [*losses, *refs.values()]
        lo, hi = min(values), max(values)
        if label in log_panels and lo > 0:
            ax.set_yscale("log")
            ax.set_ylim(lo / 1.3, hi * 3.0)  # headroom above the lines for the legend
        else:
            ax.set_ylim(lo - 0.05 * (hi - lo or 1.0), hi + 0.35 * (hi - lo or 1.0))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats / token)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if held_out:
        ax = axes.flat[len(phases)]
        for i, (label, (mean, noise)) in enumerate(held_out.items()):
            ax.errorbar([i], [mean], yerr=[noise or 0.0], fmt="o", capsize=6, markersize=7, color=f"C{i + 2}",
                        label=f"{label}: {mean:+.3g}" + (f" ± {noise:.2g}" if noise else ""))
        if held_out_baseline:
            ax.axhline(0.0, color="black", linewidth=1.2, linestyle="--", label=f"{held_out_baseline}: 0")
        ax.set_xticks(range(len(held_out)), list(held_out), fontsize=8)
        ax.set_xlim(-0.6, len(held_out) - 0.4)
        what = f"minus the {held_out_baseline}'s, paired by batch" if held_out_baseline else "mean over batches"
        ax.set_ylabel("held-out loss difference (nats / token)" if held_out_baseline else
                      "held-out loss (nats / token)", fontsize=9)
        ax.set_title(f"held-out loss {what}\n(mean ± standard error over the batches)", fontsize=9)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def expert_amax_heatmap(rows: Sequence[str], amax: Sequence[Sequence[float]], path: str | Path, *,
                        title: str = "Expert weight amax") -> Path:
    """A heatmap of ``amax[row][global expert]`` (rows: e.g. ``layer 0 fc1``), value printed where it fits."""
    plt = _plt()
    import numpy as np

    data = np.asarray(amax, dtype=float)
    n_rows, n_cols = data.shape
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * n_cols + 2.5), max(2.5, 0.45 * n_rows + 1.5)))
    im = ax.imshow(data, aspect="auto", cmap="viridis")
    ax.set_xticks(range(n_cols), [str(e) for e in range(n_cols)])
    ax.set_yticks(range(n_rows), list(rows))
    ax.set_xlabel("global expert")
    ax.set_title(title)
    if n_cols <= 16 and n_rows <= 16:
        mid = (data.max() + data.min()) / 2
        for r in range(n_rows):
            for c in range(n_cols):
                ax.text(c, r, f"{data[r, c]:.3g}", ha="center", va="center", fontsize=7,
                        color="black" if data[r, c] > mid else "white")
    fig.colorbar(im, ax=ax, label="amax")
    return _save(fig, path)


def expert_weight_errors(shared: Sequence[float], per_expert: Sequence[float], path: str | Path, *,
                         title: str = "Weight quantization error per expert", note: str | None = None) -> Path:
    """Per global expert, the relative quantization error with one amax for all experts (``shared``) and with each
    expert's own (``per_expert``), as points: the y axis is fitted to the values (from 0, bars of nearly equal
    errors would hide their differences). ``note``: a line under the title (e.g. why the two are close)."""
    import textwrap

    plt = _plt()
    import numpy as np

    x = np.arange(len(shared))
    width = max(6.5, 0.5 * len(shared) + 3)
    fig, ax = plt.subplots(figsize=(width, 4.6))
    # In percent: relative errors of ~1e-2 would otherwise carry a "1e-3" offset label that collides with the title.
    ax.plot(x, 100 * np.asarray(shared), "o-", color="C3", markersize=6, linewidth=1,
            label="shared amax (one per layer)")
    ax.plot(x, 100 * np.asarray(per_expert), "s--", color="C0", markersize=5, linewidth=1, label="per-expert amax")
    ax.set_xticks(x, [str(e) for e in x])
    ax.set_xlabel("global expert")
    ax.set_ylabel("relative MSE  |Q(w) - w|² / |w|²  (%)")
    lines = [title, *textwrap.wrap(note, width=int(13 * width))] if note else [title]
    ax.set_title("\n".join(lines), fontsize=10 if note is None else 8.5)
    ax.grid(alpha=0.3)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.legend(fontsize=8)
    return _save(fig, path)


def expert_input_amax(panels: Mapping[str, tuple[Sequence[float], Sequence[bool]]], path: str | Path, *,
                      title: str = "Input amax per expert") -> Path:
    """One bar panel per GEMM (``{label: (amax per global expert, saw_tokens per global expert)}``), on a log scale;
    experts that saw no calibration token (they take the shared amax) are hatched and listed in the panel title."""
    plt = _plt()
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    n = len(panels)
    cols = min(2, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 2.8 * rows), squeeze=False)
    for ax, (label, (amax, seen)) in zip(axes.flat, panels.items(), strict=False):
        x = np.arange(len(amax))
        colors = ["C0" if s else "lightgray" for s in seen]
        bars = ax.bar(x, amax, color=colors, edgecolor="black", linewidth=0.4)
        for bar, s in zip(bars, seen, strict=True):
            if not s:
                bar.set_hatch("//")
        unseen = [int(i) for i in x if not seen[i]]
        ax.set_title(f"{label}" + (f"  (no tokens: experts {unseen})" if unseen else ""), fontsize=9)
        ax.set_xticks(x, [str(e) for e in x], fontsize=7)
        ax.set_xlabel("global expert", fontsize=8)
        ax.set_ylabel("input amax (log scale)", fontsize=8)
        ax.set_yscale("log", nonpositive="clip")  # amaxes span decades: a linear axis hides the small experts
        positive = [v for v in amax if v > 0]
        if positive:  # bars grow from the bottom: put it well below the smallest so that one stays visible
            ax.set_ylim(min(positive) / 3, max(positive) * 2)
        if len(amax) <= 16:
            for xi, v in zip(x, amax, strict=True):
                ax.text(xi, v, f"{v:.3g}", ha="center", va="bottom", fontsize=6.5)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.grid(axis="y", which="major", alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title)
    return _save(fig, path)
