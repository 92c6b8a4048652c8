"""Figures of ``saguaro_fig4_fanout`` and ``saguaro_fig5_residual`` (bench/saguaro_cache.py), from results only.

Fig. 4: held-out speculation-cache hit rate vs temperature, one line per topology (uniform, geometric, optimal),
one panel per cache budget. Fig. 5: hit rate (after a rejection, and overall) and mean accepted length vs the
residual scaling lambda, one line per temperature. Both are MEASURED on a trained pair; the title says so
(``plots/style.py`` provenance) and names the pair and train key. No oracle row is drawn here.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance

_STYLE = {"uniform": ("#4c72b0", "o"), "geometric": ("#dd8452", "s"), "optimal": ("#55a868", "^")}


def save(fig, out: Path, title: str, top: float) -> None:
    """Every seed 002 figure's ending: the title (fontsize 8) above the panels, which fill up to ``top``."""
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _pair_line(df: pd.DataFrame) -> str:
    r = df.iloc[0]
    return (f"MEASURED acceptance: trained pair {r['target']} / {r['draft']} (train run {r['train_run']} "
            f"{r['train_key']}), draft_model chains of S = {int(r['S'])}, {int(r['prompts'])} validation prompts")


def plot_fanout(df: pd.DataFrame, out: Path) -> None:
    """Hit rate vs temperature per topology, one panel per (family, budget)."""
    d = ok_rows(df)
    d = d[d["kind"] == "fanout"] if "kind" in d.columns else d.iloc[0:0]
    if not len(d):
        raise ValueError("saguaro_fig4_fanout: no fanout rows to plot")
    panels = list(dict.fromkeys(zip(d["family"], d["budget"])))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (fam, N) in zip(axes[0], panels):
        p = d[(d["family"] == fam) & (d["budget"] == N)]
        for name in dict.fromkeys(p["topology"]):
            t = p[p["topology"] == name].sort_values("temperature")
            color, marker = _STYLE.get(name, ("#888888", "x"))
            ax.plot(t["temperature"], t["hit_rate"], marker=marker, color=color, label=name)
        ax.set_title(f"{fam}, budget {int(N)} branches", fontsize=9)
        ax.set_xlabel("temperature")
        ax.set_ylabel("cache hit rate (held-out prompts)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="fan-out", title_fontsize=8)
    save(fig, out, f"Saguaro Fig. 4: speculation-cache hit rate by fan-out topology (MEASURED)\n{_pair_line(d)}; "
         f"fitted on half the prompts, scored on the other half\n{provenance(df)}", 0.84)


def plot_residual(df: pd.DataFrame, out: Path) -> None:
    """Hit rate and mean accepted length vs lambda, one line per (family, temperature)."""
    d = ok_rows(df)
    d = d[d["kind"] == "residual"] if "kind" in d.columns else d.iloc[0:0]
    if not len(d):
        raise ValueError("saguaro_fig5_residual: no residual rows to plot")
    fig, (ax_hit, ax_acc) = plt.subplots(1, 2, figsize=(10, 4.2))
    for i, ((fam, T), g) in enumerate(d.groupby(["family", "temperature"], sort=False)):
        g = g.sort_values("lam")
        color = list(_STYLE.values())[i % len(_STYLE)][0]
        label = f"{fam}, T = {T:g}"
        ax_hit.plot(g["lam"], g["hit_rate_reject"], marker="o", color=color, label=f"{label}: after a rejection")
        ax_hit.plot(g["lam"], g["hit_rate"], marker="s", ls="--", color=color, label=f"{label}: all rounds")
        ax_acc.plot(g["lam"], g["mean_accepted"], marker="o", color=color, label=label)
    r = d.iloc[0]
    ax_hit.set_title(f"bonus-token hit rate, uniform fan-out {list(r['fanout'])}", fontsize=9)
    ax_hit.set_ylabel("cache hit rate")
    ax_acc.set_title("acceptance (lambda < 1 trades it for hits)", fontsize=9)
    ax_acc.set_ylabel("mean accepted drafts per round")
    for ax in (ax_hit, ax_acc):
        ax.set_xlabel("residual scaling lambda (1: none)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, out, f"Saguaro Fig. 5: residual scaling (MEASURED)\n{_pair_line(d)}\n{provenance(df)}", 0.84)
