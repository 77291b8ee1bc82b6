"""Outputs of the crossover experiment: crossover.csv, crossover.png, summary.md."""

from __future__ import annotations

import csv
from typing import Dict, List, Optional, Sequence

MODELS = ("ar", "dlm")
LABELS = {"ar": "AR (vanilla, causal)", "dlm": "DLM (difflm-noshift)"}
METRICS = {
    "heldout_loss": ("held-out loss, nats/token (AR: NLL, DLM: NELBO bound)", "lower"),
    "cloze_acc": ("held-out cloze accuracy", "higher"),
    "train_loss": ("training-text loss, nats/token (AR: NLL, DLM: NELBO)", "lower"),
}
CSV_COLUMNS = ("model", "epoch", "iteration", "tokens", "metric", "value")


def write_csv(rows: Sequence[Dict], path: str) -> None:
    """One row per (model, evaluation, metric)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in CSV_COLUMNS})


def series(rows: Sequence[Dict], model: str, metric: str) -> List[tuple]:
    """[(epoch, value)] of one model and metric, by epoch."""
    return sorted((r["epoch"], r["value"]) for r in rows if r["model"] == model and r["metric"] == metric)


def plot(rows: Sequence[Dict], path: str, *, chance: float, title: str) -> None:
    """One panel per metric, both models against epochs; the cloze panel marks chance."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(5.2 * len(METRICS), 4.2))
    for ax, (metric, (label, _)) in zip(axes, METRICS.items()):
        for model, style in zip(MODELS, ("o-", "s-")):
            pts = series(rows, model, metric)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, ms=3.5, label=LABELS[model])
        if metric == "cloze_acc":
            ax.axhline(chance, color="grey", ls="--", lw=1, label=f"chance ({chance:.2f})")
        ax.set_xlabel("epochs over the unique tokens")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def crossing(rows: Sequence[Dict], metric: str) -> Optional[float]:
    """First evaluated epoch from which the DLM is better than the AR model at every later
    evaluation (None if it is not better at the last one)."""
    ar, dlm = dict(series(rows, "ar", metric)), dict(series(rows, "dlm", metric))
    epochs = sorted(set(ar) & set(dlm))
    sign = 1.0 if METRICS[metric][1] == "higher" else -1.0
    first = None
    for e in epochs:
        if sign * (dlm[e] - ar[e]) > 0:
            first = e if first is None else first
        else:
            first = None
    return first


def _best(pts: List[tuple], better: str) -> tuple:
    return max(pts, key=lambda p: p[1]) if better == "higher" else min(pts, key=lambda p: p[1])


def summary(rows: Sequence[Dict], setting: Dict, checks: Dict[str, bool]) -> str:
    """The markdown summary: setting, matched-settings checks, per-metric best / last values
    and where (if anywhere) the DLM overtakes the AR model."""
    lines = [f"# DLM vs AR under limited data ({setting['preset']} preset)", ""]
    lines += ["| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in setting.items()]
    lines += ["", "Matched settings (checked):", ""]
    lines += [f"- {name}: {'yes' if ok else 'NO'}" for name, ok in checks.items()]
    lines += ["", "| metric | model | best (epoch) | last (epoch) |", "|---|---|---|---|"]
    for metric, (_, better) in METRICS.items():
        for model in MODELS:
            pts = series(rows, model, metric)
            b, last = _best(pts, better), pts[-1]
            lines.append(f"| {metric} | {model} | {b[1]:.4f} ({b[0]:.1f}) | {last[1]:.4f} ({last[0]:.1f}) |")
    lines += ["", f"Cloze chance level: {setting['cloze chance']}.", ""]
    for metric, (_, better) in METRICS.items():
        if metric == "train_loss":
            continue
        e = crossing(rows, metric)
        lines.append(
            f"- {metric} ({better} is better): "
            + (
                f"the DLM is better than the AR model from epoch {e:.1f} to the end."
                if e is not None
                else "the DLM is not better than the AR model at the last evaluation (no crossover)."
            )
        )
    return "\n".join(lines) + "\n"
