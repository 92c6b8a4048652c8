"""Figures of the STree end-to-end experiments (bench/e2e_tree.py), drawn from result rows only.
tokens/s are emitted tokens over the engine's step times; tau = mean accepted drafts + 1; speedups are over the
autoregressive line of the same run, model, batch and temperature."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ssmspec.bench.e2e_tree import PAPER_TAB3, PAPER_TAB4
from ssmspec.plots.style import ok_rows, provenance


def _finish(fig, df: pd.DataFrame, title: str, out: Path) -> None:
    fig.suptitle(f"{title}\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _acceptance_note(g: pd.DataFrame, width: int = 80) -> str:
    """Where the acceptance came from, wrapped to ``width`` characters."""
    return textwrap.fill(_acceptance_text(g), width)


def _acceptance_text(g: pd.DataFrame) -> str:
    spec = g[g["draft_nodes"] > 0]
    if spec.empty:
        return ""
    kind = spec["acceptance"].iloc[0]
    if kind == "oracle":
        parts = [f"T={t:g}: alpha {a:g}" + (f", beta {d:g}" if pd.notna(d) else "")
                 for (t, a), d in spec.groupby(["temperature", "alpha"])["rank_decay"].first().items()]
        law = (" (law designed, not the target's: forced verdicts)" if (spec["law"] == "designed").any() else
               " (real verification, the target's law)")
        mode = spec["oracle"].iloc[0] if "oracle" in spec else "forced"
        return f"{mode} oracle per branch, " + "; ".join(parts) + law
    sig = spec["sigma"].dropna()
    return f"measured acceptance, drafter {spec['drafter'].iloc[0]}" + (f" (logit noise sigma {sig.iloc[0]:g})"
                                                                        if len(sig) else "")


def _data(df: pd.DataFrame, what: str) -> pd.DataFrame:
    data = ok_rows(df)
    if data.empty:
        raise ValueError(f"{what}: no measured rows to plot")
    return data


def plot_tab3(df: pd.DataFrame, out: Path) -> None:
    """Per temperature: tokens/s bars (speedup over autoregressive on top) and tau bars, the expected tau of the
    oracle as a tick, the paper's MT-Bench..GSM8K speedup range in the label."""
    data = _data(df, "stree_tab3_e2e")
    data = data[data["batch"] == data["batch"].min()]
    model = data["model"].iloc[0]
    data = data[data["model"] == model]
    temps = sorted(data["temperature"].unique())
    lines = list(dict.fromkeys(data["line"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(lines)
    for k, line in enumerate(lines):
        g = data[data["line"] == line].set_index("temperature").reindex(temps)
        x = np.arange(len(temps)) + (k - (len(lines) - 1) / 2) * width
        kind = "autoregressive" if line == "autoregressive" else ("chain" if line.startswith("chain") else "tree")
        paper = [PAPER_TAB3.get(float(t), {}).get(kind) for t in temps]
        ups = [f"{min(v[0] for v in p.values()) / min(a[0] for a in PAPER_TAB3[float(t)]['autoregressive'].values()):.2f}"
               for t, p in zip(temps, paper) if p and kind != "autoregressive"]
        label = line + (f" (paper {', '.join(ups)}x at T={', '.join(f'{t:g}' for t in temps)})" if ups else "")
        bars = axes[0].bar(x, g["tokens_per_s"], width, label=label, color=f"C{k}")
        for rect, s in zip(bars, g.get("speedup", pd.Series(index=g.index, dtype=float))):
            if pd.notna(s) and line != "autoregressive":
                axes[0].annotate(f"{s:.2f}x", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                                 ha="center", va="bottom", fontsize=7)
        axes[1].bar(x, g["tau"], width, label=line, color=f"C{k}")
        exp = g["expected_accepted"] + 1.0
        axes[1].scatter(x, exp, marker="_", s=200, color="k", zorder=3,
                        label="expected (oracle)" if k == len(lines) - 1 and exp.notna().any() else None)
        ptau = [(xi, p["mtbench"][1]) for xi, p in zip(x, paper) if p]
        if ptau:
            axes[1].scatter(*zip(*ptau), marker="*", color=f"C{k}", edgecolor="k", s=60, zorder=4,
                            label="paper MT-Bench" if k == len(lines) - 1 else None)
    for ax, ylabel in zip(axes, ("tokens/s", "tau (accepted + 1)")):
        ax.set_xticks(np.arange(len(temps)), [f"T = {t:g}" for t in temps])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[0].set_title(f"{model}, batch {int(data['batch'].iloc[0])}", fontsize=9)
    axes[1].set_title(_acceptance_note(data), fontsize=7)
    _finish(fig, df, "STree Table 3: chain SD vs STree tree", out)


def plot_fig4(df: pd.DataFrame, out: Path) -> None:
    """tokens/s and tau vs temperature, a line per method."""
    data = _data(df, "stree_fig4_temperature")
    data = data[data["batch"] == data["batch"].min()]
    model = data["model"].iloc[0]
    data = data[data["model"] == model]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, line in enumerate(dict.fromkeys(data["line"])):
        g = data[data["line"] == line].sort_values("temperature")
        style = dict(color="C7" if line == "autoregressive" else f"C{k}", marker="o",
                     linestyle="--" if "naive" in line else "-")
        axes[0].plot(g["temperature"], g["tokens_per_s"], label=line, **style)
        axes[1].plot(g["temperature"], g["tau"], label=line, **style)
    for ax, ylabel in zip(axes, ("tokens/s", "tau (accepted + 1)")):
        ax.set_xlabel("temperature")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title(f"{model}, batch {int(data['batch'].iloc[0])}", fontsize=9)
    axes[1].set_title(textwrap.fill(_acceptance_text(data) + "; seed 003: tau falls with T, STree stays ~0.4 above "
                                    "SD, naive falls fastest", 80), fontsize=7)
    _finish(fig, df, "STree Fig. 4: MSS vs naive tree sampling vs chain SD over temperature", out)


def plot_tab4(df: pd.DataFrame, out: Path) -> None:
    """Per shape A-E: tokens/s (speedup on top) and tau against the expected and the paper's tau."""
    data = _data(df, "stree_tab4_tree_shapes")
    data = data[(data["batch"] == data["batch"].min()) & (data["temperature"] == data["temperature"].max())]
    model = data["model"].iloc[0]
    data = data[data["model"] == model]
    tree = data[data["draft_nodes"] > 0]
    ar = data[data["line"] == "autoregressive"]
    shapes = list(dict.fromkeys(tree["shape"]))
    x = np.arange(len(shapes))
    g = tree.set_index("shape").reindex(shapes)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = axes[0].bar(x, g["tokens_per_s"], 0.6, color="C1", label="stree")
    if not ar.empty:
        axes[0].axhline(float(ar["tokens_per_s"].iloc[0]), color="C7", linestyle="--", label="autoregressive")
    for rect, s in zip(bars, g.get("speedup", pd.Series(index=g.index, dtype=float))):
        if pd.notna(s):
            axes[0].annotate(f"{s:.2f}x", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                             va="bottom", fontsize=7)
    axes[1].bar(x, g["tau"], 0.6, color="C1", label="measured")
    axes[1].scatter(x, g["expected_accepted"] + 1.0, marker="_", s=300, color="k", zorder=3, label="expected (oracle)")
    paper = [PAPER_TAB4.get(s, (None,) * 5)[4] for s in shapes]
    axes[1].scatter(x, paper, marker="*", s=70, color="C3", zorder=4, label="paper tau (T = 1)")
    labels = [f"{s}\n" + (f"w{PAPER_TAB4[s][0]} d{PAPER_TAB4[s][1]} {PAPER_TAB4[s][2]} tok" if s in PAPER_TAB4 else "")
              for s in shapes]
    for ax, ylabel in zip(axes, ("tokens/s", "tau (accepted + 1)")):
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[0].set_title(f"{model}, T = {data['temperature'].max():g}; paper A-E: "
                      + " / ".join(f"{PAPER_TAB4[s][3]:.0f}" for s in "ABCDE") + " tokens/s", fontsize=8)
    axes[1].set_title(_acceptance_note(data), fontsize=7)
    _finish(fig, df, "STree Table 4: static tree shapes", out)


def plot_tree_replay(df: pd.DataFrame, out: Path) -> None:
    """tokens/s vs batch per shape: replay tree, stree tree, replay chain (equal tokens per call), baselines."""
    data = _data(df, "tree_replay")
    model = data["model"].iloc[0]
    data = data[(data["model"] == model) & (data["temperature"] == data["temperature"].min())]
    shapes = [s for s in dict.fromkeys(data["shape"].dropna()) if not str(s).startswith("chain")]
    base = data[data["draft_nodes"] == 0]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.6 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        g = data[(data["shape"] == shape) | data["shape"].astype(str).str.endswith(f"(={shape})")]
        for line in dict.fromkeys(list(base["line"]) + list(g["line"])):
            pts = data[data["line"] == line].sort_values("batch")
            style = dict(color={"autoregressive": "C7", "replay": "C0"}.get(line, None), marker="o",
                         linestyle="--" if line in ("autoregressive", "replay") else "-")
            tau = pts["tau"].iloc[-1]
            ax.plot(pts["batch"], pts["tokens_per_s"], label=f"{line} (tau {tau:.2f})", **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{model}, shape {shape}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.text(0.5, 0.01, _acceptance_note(data, 160), ha="center", fontsize=7)
    _finish(fig, df, "replay on token trees vs stree vs chain replay (equal tokens per call)", out)
