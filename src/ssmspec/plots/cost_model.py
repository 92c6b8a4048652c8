"""Figure of the ``cost_model`` experiment (bench/cost_model.py), drawn from result rows only."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.bench.cost_model import GOAL_AT_BATCH
from ssmspec.plots.style import provenance


def plot_cost_model(df: pd.DataFrame, out: Path) -> None:
    """Per model: left, evaluation-run tokens/s of every fixed setting vs batch with the policy's picks marked;
    right, each batch's ratio of the policy's pick to the best fixed setting, with the 0.97 goal line."""
    models = list(dict.fromkeys(df.loc[df["kind"] == "policy", "model"]))
    fig, axes = plt.subplots(len(models) or 1, 2, figsize=(11, 3.8 * max(len(models), 1)), squeeze=False)
    for (ax, axr), model in zip(axes, models):
        m = df[df["model"] == model]
        ev = m[(m["kind"] == "measure") & (m["phase"] == "eval") & (m["status"] == "ok")]
        for k, (label, g) in enumerate(ev.groupby("setting", sort=False)):
            g = g.sort_values("batch")
            ax.plot(g["batch"], g["tokens_per_s"], marker=".", lw=1, color=f"C{k % 10}",
                    ls="-" if g["S"].iloc[0] == 0 else "--", label=label)
        pol = m[m["kind"] == "policy"].sort_values("batch")
        ax.plot(pol["batch"], pol["tokens_per_s"], "k*", ms=10, label="policy's pick")
        for _, r in pol.iterrows():
            ax.annotate(r["setting"], (r["batch"], r["tokens_per_s"]), textcoords="offset points", xytext=(4, 6),
                        fontsize=6)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens / s (evaluation run)",
               title=f"{model}: fixed settings and the policy (oracle alpha {pol['alpha'].iloc[0]})")
        ax.legend(fontsize=6, ncol=2)
        axr.plot(pol["batch"], pol["ratio_to_best"], "k*-", label="policy / best fixed at the batch")
        axr.axhline(GOAL_AT_BATCH, color="r", ls=":", label=f"goal >= {GOAL_AT_BATCH}")
        rng = m[m["kind"] == "range"]
        if len(rng):
            p = rng[rng["is_policy"]]["geomean_ratio_to_best"].iloc[0]
            best = rng[rng["best_single_fixed"] == True]  # noqa: E712 (a pandas column)
            note = f"whole range (geomean): policy {p:.3f}"
            if len(best):
                note += f", best single fixed {best['setting'].iloc[0]} {best['geomean_ratio_to_best'].iloc[0]:.3f}"
            axr.set_title(note, fontsize=8)
        axr.set(xscale="log", xlabel="batch", ylabel="tokens/s ratio")
        axr.set_ylim(min(0.8, float(pol["ratio_to_best"].min()) - 0.02), 1.02)
        axr.legend(fontsize=7)
        for a in (ax, axr):
            a.grid(True, alpha=0.3)
    fig.suptitle(f"cost_model: fitted step costs pick strategy, S and D per batch\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
