"""Table of ``lossless``: greedy agreement with autoregressive decoding, one table per model (rows:
strategies, columns: drafters; a cell is the fraction of tokens that agree, green when every sequence is
identical, with the mean emitted tokens per call below), then one row per strategy of the sampling check
(chi-square over the first tokens' joint outcomes, p-value, total variation vs its sampling noise)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import provenance

_GREEN, _RED, _GRAY = "#d4f4d4", "#f8d0d0", "#eeeeee"


def _cell(r) -> tuple[str, str]:
    if r["status"] != "ok":
        return str(r.get("reason") or r["status"]), _GRAY
    text = f"{100 * r['agree']:.1f}%" if not r["exact"] else "100%"
    if not r["exact"] and r.get("first_mismatch", -1) >= 0:
        text += f" @{int(r['first_mismatch'])}"
    return f"{text}\n{r['tokens_per_call']:.2f} tok/call", _GREEN if r["exact"] else _RED


def _greedy_table(ax, g: pd.DataFrame, model: str) -> None:
    strategies = list(dict.fromkeys(g["strategy"]))
    drafters = list(dict.fromkeys(g["drafter"]))
    text, colors = [], []
    for s in strategies:
        trow, crow = [], []
        for d in drafters:
            hit = g[(g["strategy"] == s) & (g["drafter"] == d)]
            t, c = _cell(hit.iloc[0]) if len(hit) else ("", "white")
            trow.append(t)
            crow.append(c)
        text.append(trow)
        colors.append(crow)
    ax.axis("off")
    tab = ax.table(cellText=text, cellColours=colors, rowLabels=strategies, colLabels=drafters, cellLoc="center",
                   bbox=[0.12, 0.0, 0.88, 0.9])
    tab.auto_set_font_size(False)
    tab.set_fontsize(7)
    fam = g["family"].iloc[0] if "family" in g.columns else ""
    ax.set_title(f"greedy agreement with autoregressive — {model} ({fam}, {g['dtype'].iloc[0]})", fontsize=9)


def _sampling_table(ax, s: pd.DataFrame) -> None:
    cols = ["model", "strategy", "drafter", "samples", "outcomes", "chi2", "dof", "p_value", "tv", "tv_noise", "pass"]
    text, colors = [], []
    for _, r in s.iterrows():
        text.append([r["model"], r["strategy"], r["drafter"], f"{int(r['samples'])}", f"{int(r['outcomes'])}",
                     f"{r['chi2']:.1f}", f"{int(r['dof'])}", f"{r['p_value']:.3g}", f"{r['tv']:.4f}",
                     f"{r['tv_noise']:.4f}", "yes" if r["pass"] else "NO"])
        colors.append([_GREEN if r["pass"] else _RED] * len(cols))
    ax.axis("off")
    tab = ax.table(cellText=text, cellColours=colors, colLabels=cols, cellLoc="center", bbox=[0.0, 0.0, 1.0, 0.85])
    tab.auto_set_font_size(False)
    tab.set_fontsize(7)
    r = s.iloc[0]
    ax.set_title(f"sampling: joint distribution of the first {int(r['tokens'])} tokens vs the exact target "
                 f"(T={r['temperature']}, top-k {int(r['top_k'])}; pass: p >= {r['alpha']})", fontsize=9)


def plot_lossless(df: pd.DataFrame, out: Path) -> None:
    """Draw the PNG at ``out`` from the rows of one lossless run."""
    greedy = df[df["kind"] == "greedy"] if "kind" in df.columns else df.iloc[0:0]
    sampling = df[df["kind"] == "sampling"] if "kind" in df.columns else df.iloc[0:0]
    models = list(dict.fromkeys(greedy["model"])) if len(greedy) else []
    if not models and not len(sampling):
        raise ValueError("lossless: no rows to plot")
    heights = [0.7 + 0.5 * greedy[greedy["model"] == m]["strategy"].nunique() for m in models]
    if len(sampling):
        heights.append(0.8 + 0.32 * len(sampling))
    width = max(10.0, 1.7 * (greedy["drafter"].nunique() if len(greedy) else 6))
    fig, axes = plt.subplots(len(heights), 1, figsize=(width, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, m in zip(axes[:, 0], models):
        _greedy_table(ax, greedy[greedy["model"] == m], m)
    if len(sampling):
        _sampling_table(axes[-1, 0], sampling)
    fig.suptitle(f"Lossless decoding, every strategy\n{provenance(df)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.8 / fig.get_figheight()))  # the two title lines keep their own band
    fig.savefig(out, dpi=120)
    plt.close(fig)
