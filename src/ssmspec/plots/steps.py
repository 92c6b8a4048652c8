"""Figures of the step-time experiments (bench/steps_replay.py, bench/steps_fit.py), drawn from result rows
only. Times are medians; speedups are ratios of medians measured in the same run."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance

PARTS = (("ssm", "SSM state kernels", "C0"), ("attention", "attention", "C3"), ("rest", "rest", "C7"))
# seed 000, Fig. 10: replay over snapshot at S = 4 (Qwen3.5 / Nemotron-3, vLLM, H100 / B300)
PAPER_FIG10 = {"kernel": (2.28, 3.33), "forward": (1.23, 1.69), "step": (1.20, 1.58)}


def _finish(fig, df: pd.DataFrame, title: str, out: Path) -> None:
    fig.suptitle(f"{title}\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _need(df: pd.DataFrame, what: str, **eq) -> pd.DataFrame:
    data = ok_rows(df)
    for k, v in eq.items():
        data = data[data[k] == v] if k in data.columns else data.iloc[0:0]
    if data.empty:
        raise ValueError(f"{what}: no measured rows to plot")
    return data


def plot_breakdown(df: pd.DataFrame, out: Path) -> None:
    """Stacked shares of the step time per context length, one panel per (model, strategy, batch); the step's
    median time over each bar; contexts that did not fit are named in the panel."""
    data = _need(df, "replay_fig2_breakdown")
    keys = list(dict.fromkeys(zip(data["model"], data["strategy"], data["batch"])))
    cols = min(len(keys), 2)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (model, strategy, bsz) in zip(axes.flat, keys):
        g = data[(data["model"] == model) & (data["strategy"] == strategy) & (data["batch"] == bsz)]
        g = g.sort_values("context")
        x = np.arange(len(g))
        bottom = np.zeros(len(g))
        for part, label, color in PARTS:
            share = g[f"{part}_share"].to_numpy(dtype=float)
            ax.bar(x, share, bottom=bottom, color=color, label=label)
            bottom += share
        for i, ms in enumerate(g["ms_p50"]):
            ax.annotate(f"{ms:.1f} ms", (i, 1.0), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(x, [f"{int(t) // 1024}K" if t >= 1024 else str(int(t)) for t in g["context"]], fontsize=7)
        skipped = df[df["status"] == "skipped"]
        skipped = skipped[(skipped["model"] == model) & (skipped["strategy"] == strategy) & (skipped["batch"] == bsz)]
        note = f" (no fit from {int(skipped['context'].min())})" if len(skipped) else ""
        ax.set(ylim=(0, 1.12), xlabel="context length", ylabel="share of step time",
               title=f"{model}, {strategy}, batch {int(bsz)}{note}")
        ax.legend(fontsize=6, loc="lower left")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    _finish(fig, data, "Decode-step time: SSM state kernels vs attention vs rest (seed 000, Fig. 2)", out)


def plot_propagation(df: pd.DataFrame, out: Path) -> None:
    """Speedup of replay over snapshot at each stage (kernel -> verify forward -> whole step) per model and
    batch, with the paper's ranges as bands."""
    data = _need(df, "replay_fig10_propagation")
    stages = ("kernel", "forward", "step")
    keys = list(dict.fromkeys(zip(data["model"], data["batch"])))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(len(keys), 1)
    for k, (model, bsz) in enumerate(keys):
        m = data[(data["model"] == model) & (data["batch"] == bsz)]
        sp = []
        for st in stages:
            snap, rep = m[m["impl"] == f"{st}_snapshot"], m[m["impl"] == f"{st}_replay"]
            sp.append(float(snap["ms_p50"].iloc[0] / rep["ms_p50"].iloc[0]) if len(snap) and len(rep) else np.nan)
        pos = np.arange(len(stages)) + (k - (len(keys) - 1) / 2) * width
        bars = ax.bar(pos, sp, width, label=f"{model}, batch {int(bsz)}")
        ax.bar_label(bars, fmt="%.2fx", fontsize=6)
    for i, st in enumerate(stages):
        lo, hi = PAPER_FIG10[st]
        ax.fill_between([i - 0.45, i + 0.45], lo, hi, color="k", alpha=0.1, label="paper range" if i == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(stages)), ["SSM kernel", "verify forward", "whole step"])
    ax.set_ylabel("speedup replay / snapshot")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    S = int(data["S"].iloc[0])
    _finish(fig, data, f"How the verify speedup propagates, S = {S} (seed 000, Fig. 10)", out)


def plot_runtime_fit(df: pd.DataFrame, out: Path) -> None:
    """Left: model-call time vs tokens per call with the linear and quadratic fits, per strategy. Right: the
    acceptance ratio tau2 / tau1 a tree of N2 tokens needs over a chain of n1 tokens (seed 003, Eqs. 7-8)."""
    data = _need(df, "stree_fig2_runtime_fit")
    calls = data[(data["kind"] == "measure") & (data["stage"] == "call")]
    fits, needed = data[data["kind"] == "fit"], data[data["kind"] == "needed"]
    models = list(dict.fromkeys(calls["model"]))
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for (ax, axr), model in zip(axes, models):
        c = calls[calls["model"] == model]
        grid = np.linspace(c["tokens"].min(), c["tokens"].max(), 100)
        for k, (strategy, g) in enumerate(c.groupby("strategy", sort=False)):
            g = g.sort_values("tokens")
            ax.plot(g["tokens"], g["ms_p50"], "o", color=f"C{k}", label=strategy)
            f = fits[(fits["model"] == model) & (fits["strategy"] == strategy)]
            for _, r in f.iterrows():
                coef = [r["k"], r["C"]] if r["degree"] == 1 else [r["a"], r["b"], r["c"]]
                ax.plot(grid, np.polyval(coef, grid), color=f"C{k}", ls="-" if r["degree"] == 1 else "--", lw=1,
                        label=f"{strategy} {'linear' if r['degree'] == 1 else 'quadratic'} (R2 {r['r2']:.3f})")
        ax.set(xlabel="tokens per call N", ylabel="ms per model call", title=f"{model}, batch {int(c['batch'].iloc[0])}")
        ax.legend(fontsize=6)
        ax.grid(True, alpha=0.3)
        n = needed[needed["model"] == model].sort_values("tokens")
        if len(n):
            axr.plot(n["tokens"], n["needed_linear"], marker="o", label="linear fits (Eq. 7)")
            axr.plot(n["tokens"], n["needed_quadratic"], marker="s", ls="--", label="quadratic fits (Eq. 8)")
            axr.plot([15], [1.5], "r*", ms=9, label="paper: 1.5x at 15 tokens (2.7B)")
            axr.set(xlabel="tree tokens N2", ylabel="tau2 / tau1 needed",
                    title=f"{n['strategy'].iloc[0]} vs chain of {int(n['n1'].iloc[0])} ({n['chain_strategy'].iloc[0]})")
            axr.axhline(1.0, color="k", lw=0.8)
            axr.legend(fontsize=6)
            axr.grid(True, alpha=0.3)
    _finish(fig, data, "Model-call time vs tokens per call and the acceptance trees need (seed 003, Fig. 2)", out)
