"""Figures of the STree end-to-end experiments (bench/e2e_tree.py), drawn from result rows only.
tokens/s are tokens over the engine's step times; tau = mean accepted drafts + 1; speedups are over the
autoregressive line of the same run, model, batch and temperature. Oracle lines are drawn at their designed
acceptance with the measured numbers of the same steps as markers, and the paper's tables in a panel of their
own (``plots/designed.py``, docs/design.md, "Drafting and acceptance")."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ssmspec.plots.designed import (DESIGNED, MEASURED_MARK, has_designed, rerun_note, speedup, tokens_per_s,
                                    within_note)
from ssmspec.plots.style import ok_rows, provenance

PAPER = "paper, measured acceptance (MambaInLlama-8B, RTX 3090)"
# Seed 003, Table 3 (MambaInLlama-8B, RTX 3090): tokens/s and tau per benchmark and temperature
PAPER_TAB3 = {
    0.0: {"autoregressive": {"mtbench": (39.98, 1.0), "humaneval": (39.98, 1.0), "gsm8k": (40.47, 1.0)},
          "chain": {"mtbench": (67.68, 2.04), "humaneval": (77.18, 2.32), "gsm8k": (78.38, 2.34)},
          "tree": {"mtbench": (69.84, 2.47), "humaneval": (78.35, 2.79), "gsm8k": (80.03, 2.83)}},
    1.0: {"autoregressive": {"mtbench": (39.72, 1.0), "humaneval": (40.04, 1.0), "gsm8k": (40.16, 1.0)},
          "chain": {"mtbench": (49.24, 1.55), "humaneval": (52.88, 1.65), "gsm8k": (51.80, 1.61)},
          "tree": {"mtbench": (54.08, 2.03), "humaneval": (60.34, 2.26), "gsm8k": (58.25, 2.16)}},
}
# Seed 003, Table 4 (temperature 1): (max width, depth, tokens incl. the root, tokens/s, tau)
PAPER_TAB4 = {"A": (3, 4, 13, 54.08, 2.03), "B": (16, 3, 29, 46.90, 2.15), "C": (6, 3, 16, 51.19, 2.01),
              "D": (4, 4, 13, 54.39, 2.07), "E": (3, 5, 16, 56.79, 2.09)}


def _finish(fig, df: pd.DataFrame, title: str, out: Path, note: str = "") -> None:
    fig.suptitle(f"{title}\n{provenance(df)}", fontsize=9)
    if note:
        fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=6, color="0.3")
    fig.tight_layout(rect=(0, 0.04 * (note.count("\n") + 1) if note else 0, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _acceptance_note(g: pd.DataFrame) -> str:
    """Where the acceptance came from, wrapped to 80 characters."""
    return textwrap.fill(_acceptance_text(g), 80)


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
        draws = spec["draws"].dropna() if "draws" in spec else spec.iloc[0:0]
        how = f", {draws.iloc[0]} draws" if len(draws) else ""
        return f"{mode} oracle per branch{how}, " + "; ".join(parts) + law
    sig = spec["sigma"].dropna()
    return f"measured acceptance, drafter {spec['drafter'].iloc[0]}" + (f" (logit noise sigma {sig.iloc[0]:g})"
                                                                        if len(sig) else "")


def _data(df: pd.DataFrame, what: str) -> pd.DataFrame:
    data = ok_rows(df)
    if data.empty:
        raise ValueError(f"{what}: no measured rows to plot")
    return data


def _paper_tab3(ax, temps: list[float]) -> None:
    """The paper's Table 3 in a panel of its own: speedup over its autoregressive line per benchmark (bars) for
    vanilla SD and STree at each temperature, its measured tau written on each bar."""
    groups = [(t, kind) for t in temps for kind in ("chain", "tree") if kind in PAPER_TAB3.get(float(t), {})]
    benches = ["mtbench", "humaneval", "gsm8k"]
    w = 0.8 / len(benches)
    for j, bench in enumerate(benches):
        x = np.arange(len(groups)) + (j - (len(benches) - 1) / 2) * w
        ups = [PAPER_TAB3[t][k][bench][0] / PAPER_TAB3[t]["autoregressive"][bench][0] for t, k in groups]
        bars = ax.bar(x, ups, w, color=f"C{j + 4}", label=bench)
        for rect, (t, k) in zip(bars, groups):
            ax.annotate(f"tau\n{PAPER_TAB3[t][k][bench][1]:.2f}", (rect.get_x() + rect.get_width() / 2,
                        rect.get_height()), ha="center", va="bottom", fontsize=5)
    ax.set_xticks(np.arange(len(groups)), [f"{'SD' if k == 'chain' else 'STree'}\nT = {t:g}" for t, k in groups])
    ax.set_ylabel("speedup over autoregressive")
    ax.margins(y=0.3)
    ax.legend(fontsize=6, loc="upper left", ncol=3)
    ax.set_title(PAPER, fontsize=7)


def plot_tab3(df: pd.DataFrame, out: Path) -> None:
    """Per temperature: our tokens/s at the designed acceptance (bars, designed speedup on top) with the measured
    tokens/s of the same steps as markers, designed tau (bars) with measured tau as markers; the paper's Table 3
    in a third panel of its own (measured acceptance on other hardware: not comparable line for line)."""
    data = _data(df, "stree_tab3_e2e")
    data = data[data["batch"] == data["batch"].min()]
    model = data["model"].iloc[0]
    data = data[data["model"] == model]
    temps = sorted(data["temperature"].unique())
    lines = list(dict.fromkeys(data["line"]))
    designed = has_designed(data)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw=dict(width_ratios=[1.1, 1.1, 0.9]))
    width = 0.8 / len(lines)
    for k, line in enumerate(lines):
        g = data[data["line"] == line].set_index("temperature").reindex(temps)
        x = np.arange(len(temps)) + (k - (len(lines) - 1) / 2) * width
        bars = axes[0].bar(x, tokens_per_s(g), width, label=line, color=f"C{k}")
        for rect, s in zip(bars, speedup(g)):
            if pd.notna(s) and line != "autoregressive":
                axes[0].annotate(f"{s:.2f}x", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                                 ha="center", va="bottom", fontsize=7)
        last = k == len(lines) - 1
        if designed:
            axes[0].scatter(x, g["tokens_per_s"], marker="o", s=14, color="k", zorder=3,
                            label=MEASURED_MARK if last else None)
            axes[1].bar(x, g["expected_accepted"] + 1.0, width, label=line, color=f"C{k}")
            axes[1].scatter(x, g["tau"], marker="o", s=14, color="k", zorder=3, label=MEASURED_MARK if last else None)
        else:
            axes[1].bar(x, g["tau"], width, label=line, color=f"C{k}")
    for ax, ylabel in zip(axes[:2], ("tokens/s", "tau (accepted + 1)")):
        ax.set_xticks(np.arange(len(temps)), [f"T = {t:g}" for t in temps])
        ax.set_ylabel(ylabel)
        ax.margins(y=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    what = DESIGNED if designed else "measured acceptance"
    axes[0].set_title(f"{model}, batch {int(data['batch'].iloc[0])}: tokens/s at the {what}", fontsize=8)
    axes[1].set_title(_acceptance_note(data), fontsize=7)
    _paper_tab3(axes[2], temps)
    _finish(fig, df, "STree Table 3: chain SD vs STree tree", out, note=_notes(df, data))


def _notes(df: pd.DataFrame, data: pd.DataFrame) -> str:
    return "\n".join(t for t in (within_note(data), rerun_note(df)) if t)


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
    """Per shape A-E: our tokens/s at the designed acceptance (bars, designed speedup on top, measured tokens/s as
    markers), designed tau (bars) with measured tau as markers; the paper's Table 4 in a panel of its own."""
    data = _data(df, "stree_tab4_tree_shapes")
    data = data[(data["batch"] == data["batch"].min()) & (data["temperature"] == data["temperature"].max())]
    model = data["model"].iloc[0]
    data = data[data["model"] == model]
    tree = data[data["draft_nodes"] > 0]
    ar = data[data["line"] == "autoregressive"]
    shapes = list(dict.fromkeys(tree["shape"]))
    x = np.arange(len(shapes))
    g = tree.set_index("shape").reindex(shapes)
    designed = has_designed(data)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    bars = axes[0].bar(x, tokens_per_s(g), 0.6, color="C1", label="stree, " + (DESIGNED if designed else "measured"))
    if designed:
        axes[0].scatter(x, g["tokens_per_s"], marker="o", s=14, color="k", zorder=3, label=MEASURED_MARK)
    if not ar.empty:
        axes[0].axhline(float(ar["tokens_per_s"].iloc[0]), color="C7", linestyle="--", label="autoregressive")
    for rect, s in zip(bars, speedup(g)):
        if pd.notna(s):
            axes[0].annotate(f"{s:.2f}x", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                             va="bottom", fontsize=7)
    if designed:
        axes[1].bar(x, g["expected_accepted"] + 1.0, 0.6, color="C1", label=DESIGNED)
        axes[1].scatter(x, g["tau"], marker="o", s=14, color="k", zorder=3, label=MEASURED_MARK)
    else:
        axes[1].bar(x, g["tau"], 0.6, color="C1", label="measured")
    labels = [f"{s}\n" + (f"w{PAPER_TAB4[s][0]} d{PAPER_TAB4[s][1]} {PAPER_TAB4[s][2]} tok" if s in PAPER_TAB4 else "")
              for s in shapes]
    for ax, ylabel in zip(axes[:2], ("tokens/s", "tau (accepted + 1)")):
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    axes[0].set_title(f"{model}, T = {data['temperature'].max():g}", fontsize=8)
    axes[1].set_title(_acceptance_note(data), fontsize=7)
    names = [s for s in "ABCDE" if s in PAPER_TAB4]
    px = np.arange(len(names))
    pbars = axes[2].bar(px, [PAPER_TAB4[s][3] for s in names], 0.6, color="C5", label="tokens/s")
    for rect, s in zip(pbars, names):
        axes[2].annotate(f"tau {PAPER_TAB4[s][4]:.2f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                         ha="center", va="bottom", fontsize=6)
    axes[2].set_xticks(px, names)
    axes[2].set_ylabel("tokens/s")
    axes[2].margins(y=0.15)
    axes[2].set_title(f"{PAPER}, T = 1", fontsize=7)
    _finish(fig, df, "STree Table 4: static tree shapes", out, note=_notes(df, data))


def plot_tree_replay(df: pd.DataFrame, out: Path) -> None:
    """tokens/s vs batch per shape: replay tree, stree tree, replay chain (equal tokens per call), baselines; the
    curves at the designed acceptance, the measured tokens/s of the same steps as crosses."""
    data = _data(df, "tree_replay")
    model = data["model"].iloc[0]
    data = data[(data["model"] == model) & (data["temperature"] == data["temperature"].min())]
    shapes = [s for s in dict.fromkeys(data["shape"].dropna()) if not str(s).startswith("chain")]
    base = data[data["draft_nodes"] == 0]
    designed = has_designed(data)
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.6 * len(shapes), 4.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        g = data[(data["shape"] == shape) | data["shape"].astype(str).str.endswith(f"(={shape})")]
        for k, line in enumerate(dict.fromkeys(list(base["line"]) + list(g["line"]))):
            pts = data[data["line"] == line].sort_values("batch")
            color = {"autoregressive": "C7", "replay": "C0"}.get(line, f"C{k + 1}")
            style = dict(color=color, marker="o", ms=4, linestyle="--" if line in ("autoregressive", "replay") else "-")
            spec = bool(pts["draft_nodes"].iloc[0])
            tau = (pts["expected_accepted"].iloc[-1] + 1.0) if designed and spec else pts["tau"].iloc[-1]
            label = line + (f" (tau {tau:.2f}{', designed' if designed else ', measured'})" if spec else "")
            ax.plot(pts["batch"], tokens_per_s(pts), label=label, **style)
            if designed and spec:
                ax.scatter(pts["batch"], pts["tokens_per_s"], marker="x", s=40, color=color, zorder=3)
        if designed:
            ax.scatter([], [], marker="x", color="k", label=MEASURED_MARK)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s" + (" (curves: designed acceptance)" if designed else ""))
        ax.set_title(f"{model}, shape {shape}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    note = "\n".join(t for t in (_acceptance_text(data), _notes(df, data)) if t)
    _finish(fig, df, "replay on token trees vs stree vs chain replay (equal tokens per call)", out, note=note)
