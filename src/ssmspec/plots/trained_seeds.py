"""Figure of ``trained_seeds``: the draft's measured mean accepted length per training seed, one panel per family.

One column of points per (variant, set, S) (``train_variant``, e.g. drafts distilled for more steps; no label
when the run has no variants): each point a seed's pair (labelled with its seed; a hollow point: that seed's
output was not the autoregressive greedy output), beside it the mean over the seeds with a bar of +- one sample
standard deviation, and the goal (``goal`` of the summary rows, 2.0) as a dashed line; under each column the
number of seeds at or above the goal. The validation points of different seeds are measured on different held-out
files (each seed's own split); HumanEval's on the same prompts. Measured on pairs the suite trained offline: the
title says so and how many seeds.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import provenance

_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def _variant(r) -> str | None:
    """The row's ``train_variant`` (None: the run as configured, also where the column is absent or NaN)."""
    v = r.get("train_variant")
    return v if isinstance(v, str) and v else None


def _summary_of(summary: pd.DataFrame, family: str, r) -> pd.DataFrame:
    """The summary rows of seed row ``r``'s (variant, family, set, S); a run without variants matches on None."""
    if not len(summary):
        return summary
    same = summary.apply(lambda s: _variant(s) or "", axis=1) == (_variant(r) or "")  # None == None is False in pandas
    return summary[same & (summary["family"] == family) & (summary["set"] == r["set"]) & (summary["S"] == r["S"])]


def _column(r) -> str:
    head = f"{_variant(r)}\n" if _variant(r) else ""
    return f"{head}{r['set']}, S={int(r['S'])}"


def plot_seeds(df: pd.DataFrame, out: Path) -> None:
    """Draw the PNG at ``out`` from the rows of one trained_seeds run (module doc)."""
    kind = df["kind"] if "kind" in df.columns else pd.Series("", index=df.index)
    ok = df["status"] == "ok" if "status" in df.columns else pd.Series(True, index=df.index)
    seeds, summary = df[(kind == "seed") & ok], df[(kind == "summary") & ok]
    if not len(seeds):
        raise ValueError("trained_seeds: no measured seed rows to plot")
    fams = list(dict.fromkeys(seeds["family"]))
    all_seeds = sorted({int(s) for s in seeds["seed"]})
    color = {s: _COLORS[i % len(_COLORS)] for i, s in enumerate(all_seeds)}
    n_cols = len({_column(r) for _, r in seeds.iterrows()})
    fig, axes = plt.subplots(1, len(fams), figsize=(max(8.0, 2.4 * n_cols + 2), 5.2), squeeze=False)
    goal = float(summary["goal"].iloc[0]) if len(summary) else None
    for ax, fam in zip(axes[0], fams):
        d = seeds[seeds["family"] == fam]
        cols = list(dict.fromkeys(_column(r) for _, r in d.iterrows()))
        ticks = list(cols)
        labelled: set[int] = set()
        for i, col in enumerate(cols):
            rows = [r for _, r in d.iterrows() if _column(r) == col]
            for j, r in enumerate(rows):
                s = int(r["seed"])
                x = i - 0.15 + 0.3 * (j + 0.5) / len(rows) - 0.15
                ax.scatter(x, r["mean_accepted"], s=36, zorder=3, color=color[s] if r["exact"] else "none",
                           edgecolors=color[s], label=None if s in labelled else f"seed {s}")
                labelled.add(s)
            sm = _summary_of(summary, fam, rows[0])
            if len(sm):
                m = sm.iloc[0]
                std = m["std"] if pd.notna(m["std"]) else 0.0
                ax.errorbar(i + 0.22, m["mean"], yerr=std, fmt="D", color="black", ms=5, capsize=4, zorder=4,
                            label="mean +- std" if i == 0 else None)
                ax.text(i + 0.27, m["mean"], f" {m['mean']:.2f} +- {std:.2f}", va="center", fontsize=7)
                ticks[i] += f"\n{int(m['seeds_at_goal'])}/{int(m['n_seeds'])} seeds at goal"
        if goal is not None:
            ax.axhline(goal, color="red", ls="--", lw=0.9, label=f"goal {goal:g}")
        ax.set_xticks(range(len(cols)), ticks, fontsize=8)
        ax.set_xlim(-0.6, len(cols) - 0.2)
        top = max([float(d["mean_accepted"].max())] + ([goal] if goal is not None else []))
        ax.set_ylim(0, 1.15 * top + 0.1)
        ax.set_ylabel("mean accepted draft tokens per step")
        r = d.iloc[0]
        ax.set_title(f"{fam}: {r['drafter']} chains, {r['strategy']}; {int(r['prompts'])} prompts x "
                     f"{int(r['new_tokens'])} new tokens per set", fontsize=8)
        ax.legend(fontsize=7, loc="best")  # where it covers the fewest points and labels
    r = seeds.iloc[0]
    n = len(all_seeds)
    where = df.assign(weights=f"trained {r['train_run']}")  # one weights label, not one per seed's cache key
    fig.suptitle(f"Draft acceptance over training seeds, measured on pairs trained offline, {n} seed{'s' * (n > 1)}"
                 f" ({', '.join(map(str, all_seeds))})\nvalidation: each seed's own held-out files; HumanEval: the "
                 f"same prompts\n{provenance(where)}", fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 0.9))
    fig.savefig(out, dpi=120)
    plt.close(fig)
