"""What QAD did to held-out numbers, said plainly and with its noise (framework-free: lists of floats in, a JSON-able
dict with a sentence out).

Held-out losses of the bf16 teacher, the PTQ model and the QAD model are measured on the same batches, so each
comparison is a mean of per-batch differences; its noise is the standard error of that mean (the spread over the
batches / sqrt(batches)). A difference counts only where it exceeds twice its noise. The "share of the PTQ loss gap
closed" is given only where the gap itself does (a gap inside its noise makes any ratio meaningless: a -259% share
of a gap that is noise says nothing about QAD). The KL to the teacher is the gap QAD minimises (0 for the teacher);
its change is given in percent, with its noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["mean_and_noise", "qad_outcome", "SIGNIFICANT"]

SIGNIFICANT = 2.0  # a difference counts when it exceeds this many standard errors


def mean_and_noise(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error (sample standard deviation / sqrt(n); NaN for fewer than 2)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean and noise of ``b - a`` over the same batches."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same batches: {len(a)} vs {len(b)}")
    return mean_and_noise([y - x for x, y in zip(a, b, strict=True)])


def _significant(diff: float, noise: float) -> bool:
    return math.isfinite(noise) and abs(diff) > SIGNIFICANT * noise


def qad_outcome(bf16_loss: Sequence[float], ptq_loss: Sequence[float], qad_loss: Sequence[float],
                ptq_kl: Sequence[float], qad_kl: Sequence[float]) -> dict:
    """Held-out loss and KL before and after QAD, per batch in, numbers and one plain sentence out.

    Args:
        bf16_loss: LM loss per held-out batch of the teacher (the bf16 model).
        ptq_loss: LM loss per held-out batch of the PTQ model.
        qad_loss: LM loss per held-out batch of the QAD model.
        ptq_kl: KL to the teacher per held-out batch, after PTQ.
        qad_kl: KL to the teacher per held-out batch, after QAD.

    Returns:
        ``batches``; ``loss`` (``bf16``, ``ptq``, ``qad`` means), ``gap`` / ``gap_noise`` (PTQ minus bf16),
        ``change`` / ``change_noise`` (QAD minus PTQ), ``share_closed`` (of the gap; None unless the gap exceeds
        twice its noise, and where QAD made the loss worse); ``kl_before`` / ``kl_after``, ``kl_change_pct`` /
        ``kl_change_noise_pct``; ``verdict`` on the held-out loss: ``better``, ``worse``, ``within noise`` or
        ``unknown`` (one batch: no noise estimate); ``text``: the sentence. Noises are standard errors; None where
        undefined.
    """
    n = len(bf16_loss)
    gap, gap_noise = _paired(bf16_loss, ptq_loss)
    change, change_noise = _paired(ptq_loss, qad_loss)
    kl_before, kl_after = mean_and_noise(ptq_kl)[0], mean_and_noise(qad_kl)[0]
    kl_change, kl_noise = _paired(ptq_kl, qad_kl)
    kl_pct = 100 * kl_change / kl_before if kl_before > 0 else math.nan
    kl_noise_pct = 100 * kl_noise / kl_before if kl_before > 0 else math.nan
    gap_counts = gap > 0 and _significant(gap, gap_noise)
    if not math.isfinite(change_noise):
        verdict = "unknown"  # one batch: no spread, no noise estimate
    else:
        verdict = "within noise" if not _significant(change, change_noise) else "worse" if change > 0 else "better"
    share = -change / gap if gap_counts and verdict != "worse" else None
    loss = {"bf16": sum(bf16_loss) / n, "ptq": sum(ptq_loss) / n, "qad": sum(qad_loss) / n}

    def pm(value: float, noise: float, fmt: str = ".2g") -> str:
        return f"{value:+{fmt}}" + (f" ± {noise:.2g}" if math.isfinite(noise) else "")

    kl_dir = "down" if kl_change < 0 else "up"
    kl_text = f"held-out KL to the teacher {kl_before:.3g} -> {kl_after:.3g}"
    if math.isfinite(kl_pct):
        kl_text += f" ({kl_dir} {abs(kl_pct):.2g}%{'' if math.isnan(kl_noise_pct) else f' ± {kl_noise_pct:.2g}%'})"
    moved = f"{loss['ptq']:#.5g} -> {loss['qad']:#.5g}"
    if verdict == "worse":
        loss_text = (f"QAD made the held-out loss WORSE: up by {change:.2g} ± {change_noise:.2g} ({moved}) while the "
                     f"KL went {kl_dir} by {abs(kl_pct):.2g}%")
    elif verdict == "better":
        loss_text = f"held-out loss down by {-change:.2g} ± {change_noise:.2g} ({moved})"
    elif verdict == "within noise":
        loss_text = f"held-out loss {moved} ({pm(change, change_noise)}: within the noise)"
    else:
        loss_text = f"held-out loss {moved} ({change:+.2g}; one batch gives no noise estimate)"
    batches = f"{n} held-out batch{'es' if n != 1 else ''}"
    after = f"after QAD the loss is {gap + change:+.2g} against the teacher's"
    if gap_counts and verdict == "worse":
        gap_part = f"the PTQ loss gap grew from {pm(gap, gap_noise)} to {gap + change:+.2g}"
    elif gap_counts:
        gap_part = (f"{100 * share:.0f}% ± {100 * change_noise / gap:.0f}% of the PTQ loss gap ({pm(gap, gap_noise)}) "
                    "closed")
    elif gap < 0 and _significant(gap, gap_noise):
        gap_part = f"PTQ's held-out loss was below the teacher's ({pm(gap, gap_noise)}): no loss gap to close; {after}"
    else:
        gap_part = (f"the PTQ loss gap ({pm(gap, gap_noise)} over {batches}) is not larger than twice its noise, so "
                    f"no share of it closed is reported{'; ' + after if verdict == 'worse' else ''}")
    out = {"batches": n, "loss": loss, "gap": gap, "gap_noise": gap_noise, "change": change,
           "change_noise": change_noise, "share_closed": share, "kl_before": kl_before, "kl_after": kl_after,
           "kl_change_pct": kl_pct, "kl_change_noise_pct": kl_noise_pct, "verdict": verdict,
           "text": f"{kl_text}; {loss_text}; {gap_part}"}
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}  # JSON has no NaN
