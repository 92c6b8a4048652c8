"""Figures of the STree end-to-end experiments (bench/e2e_tree.py, bench/stree_beam.py), drawn from result rows only.
tokens/s are tokens over the engine's step times; tau = mean accepted drafts + 1; speedups are over the
autoregressive line of the same run, model, batch and temperature. Oracle lines are drawn at their designed
acceptance with the measured numbers of the same steps as markers, and the paper's tables in a panel of their
own (``plots/designed.py``, docs/design.md, "Drafting and acceptance"). Rows measured on the trained pairs
(``pair: trained``) come in a figure of their own (``cli_report``): a row of panels per pair, every number
measured, the prompt set and the greedy exactness check in the panel notes."""
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
# Seed 003, Table 8 (appendix C, greedy): tokens/s and tau
PAPER_TAB8 = {"autoregressive": (39.98, 1.0), "vanilla SD": (67.68, 2.04), "static tree": (69.84, 2.47),
              "beam tree": (71.60, 2.60)}
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


def _models(data: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(label, rows) per model in row order: one preset on random weights, one per trained pair (family named) and
    train variant (``trained.variants``)."""
    variant = data["train_variant"] if "train_variant" in data.columns else pd.Series(None, index=data.index)
    keys = data["model"].astype(str) + "|" + variant.map(lambda v: "" if pd.isna(v) else str(v))
    out = []
    for key in dict.fromkeys(keys):
        g = data[keys == key]
        fam = g["family"].dropna() if "family" in g.columns else g.iloc[0:0]
        label = f"{g['model'].iloc[0]} ({fam.iloc[0]} pair)" if len(fam) else str(g["model"].iloc[0])
        out.append((label + (f", {key.split('|', 1)[1]}" if key.split("|", 1)[1] else ""), g))
    return out


def _trained(data: pd.DataFrame) -> bool:
    return "pair" in data.columns and bool((data["pair"] == "trained").any())


def _what(data: pd.DataFrame) -> str:
    """What the bars' acceptance is: designed (oracle), or measured (with the prompt set on trained pairs)."""
    if has_designed(data):
        return DESIGNED
    where = f" on {data['set'].dropna().iloc[0]} prompts" if "set" in data.columns and data["set"].notna().any() \
        else ""
    return "measured acceptance" + where


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
    sig = spec["sigma"].dropna() if "sigma" in spec.columns else spec.iloc[0:0]
    text = f"measured acceptance, drafter {spec['drafter'].iloc[0]}" + (f" (logit noise sigma {sig.iloc[0]:g})"
                                                                      if len(sig) else "")
    if "draft" in spec.columns and spec["draft"].notna().any():
        text += f" ({spec['draft'].dropna().iloc[0]})"
    if "prompts" in spec.columns and "set" in spec.columns and spec["set"].notna().any():
        n = spec["n"].max() if "n" in spec.columns else None
        text += f", {spec['set'].iloc[0]}: {int(spec['prompts'].max())} prompts" + (
            f", {int(n)} steps per line" if pd.notna(n) else "")
    return text + _exact_text(g)


def _exact_text(g: pd.DataFrame) -> str:
    """'; greedy output = autoregressive on k/n rows' where rows compared measured drafts with the reference."""
    if "exact" not in g.columns or g["acceptance"].eq("oracle").any():
        return ""
    checked = g[g["exact"].notna() & (g["draft_nodes"] > 0)]
    if checked.empty:
        return ""
    return f"; greedy output = autoregressive on {int(checked['exact'].astype(bool).sum())}/{len(checked)} rows"


def _data(df: pd.DataFrame, what: str) -> pd.DataFrame:
    data = ok_rows(df)
    if data.empty:
        raise ValueError(f"{what}: no measured rows to plot")
    return data


def _line_bars(ax_speed, ax_tau, data: pd.DataFrame, temps: list[float]) -> None:
    """Per temperature a bar per line: tokens/s with the speedup on top, tau; oracle lines at their designed
    acceptance with the measured numbers of the same steps as markers, measured lines as they are."""
    lines = list(dict.fromkeys(data["line"]))
    designed = has_designed(data)
    width = 0.8 / len(lines)
    for k, line in enumerate(lines):
        g = data[data["line"] == line].set_index("temperature").reindex(temps)
        x = np.arange(len(temps)) + (k - (len(lines) - 1) / 2) * width
        bars = ax_speed.bar(x, tokens_per_s(g), width, label=line, color=f"C{k}")
        for rect, s, tau in zip(bars, speedup(g), g["tau"]):
            if pd.notna(s) and line != "autoregressive":
                text = f"{s:.2f}x" if designed else f"{s:.2f}x\ntau {tau:.2f}"
                ax_speed.annotate(text, (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                                  va="bottom", fontsize=6)
        last = k == len(lines) - 1
        if designed:
            ax_speed.scatter(x, g["tokens_per_s"], marker="o", s=14, color="k", zorder=3,
                             label=MEASURED_MARK if last else None)
            ax_tau.bar(x, g["expected_accepted"] + 1.0, width, label=line, color=f"C{k}")
            ax_tau.scatter(x, g["tau"], marker="o", s=14, color="k", zorder=3, label=MEASURED_MARK if last else None)
        else:
            ax_tau.bar(x, g["tau"], width, label=f"{line} (measured)", color=f"C{k}")
    for ax, ylabel in ((ax_speed, "tokens/s"), (ax_tau, "tau (accepted + 1)" + ("" if designed else ", measured"))):
        ax.set_xticks(np.arange(len(temps)), [f"T = {t:g}" for t in temps])
        ax.set_ylabel(ylabel)
        ax.margins(y=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=2)


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
    """A row per model (per trained pair): per temperature our tokens/s (bars, speedup on top) and tau -- oracle
    lines at the designed acceptance with the measured numbers of the same steps as markers, measured lines (a
    real drafter, the trained pairs) as measured; the paper's Table 3 in a panel of its own (measured acceptance
    on other hardware: not comparable line for line)."""
    data = _data(df, "stree_tab3_e2e")
    data = data[data["batch"] == data["batch"].min()]
    temps = sorted(data["temperature"].unique())
    models = _models(data)
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.4 * len(models)), squeeze=False,
                             gridspec_kw=dict(width_ratios=[1.1, 1.1, 0.9]))
    for row, (label, g) in zip(axes, models):
        _line_bars(row[0], row[1], g, temps)
        row[0].set_title(f"{label}, batch {int(g['batch'].iloc[0])}: tokens/s at the {_what(g)}", fontsize=8)
        row[1].set_title(_acceptance_note(g), fontsize=7)
        row[2].axis("off")
    axes[0, 2].axis("on")
    _paper_tab3(axes[0, 2], temps)
    _finish(fig, df, "STree Table 3: chain SD vs STree tree" + (" (measured acceptance)" if _trained(data) else ""),
            out, note=_notes(df, data))


def _notes(df: pd.DataFrame, data: pd.DataFrame) -> str:
    return "\n".join(t for t in (within_note(data), rerun_note(df)) if t)


def plot_fig4(df: pd.DataFrame, out: Path) -> None:
    """A row per model (per trained pair): tokens/s and tau vs temperature, a line per method; every acceptance
    here is measured (the oracle is refused)."""
    data = _data(df, "stree_fig4_temperature")
    data = data[data["batch"] == data["batch"].min()]
    models = _models(data)
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4.2 * len(models)), squeeze=False)
    for row, (label, g) in zip(axes, models):
        for k, line in enumerate(dict.fromkeys(g["line"])):
            pts = g[g["line"] == line].sort_values("temperature")
            style = dict(color="C7" if line == "autoregressive" else f"C{k}", marker="o",
                         linestyle="--" if "naive" in line else "-")
            row[0].plot(pts["temperature"], pts["tokens_per_s"], label=line, **style)
            row[1].plot(pts["temperature"], pts["tau"], label=line, **style)
        for ax, ylabel in zip(row, ("tokens/s", "tau (accepted + 1), measured")):
            ax.set_xlabel("temperature")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        row[0].set_title(f"{label}, batch {int(g['batch'].iloc[0])}: {_what(g)}", fontsize=9)
        row[1].set_title(textwrap.fill(_acceptance_text(g) + "; seed 003: tau falls with T, STree stays ~0.4 above "
                                       "SD, naive falls fastest", 80), fontsize=7)
    _finish(fig, df, "STree Fig. 4: MSS vs naive tree sampling vs chain SD over temperature (measured acceptance)",
            out)


def plot_tab4(df: pd.DataFrame, out: Path) -> None:
    """A row per model (per trained pair), per shape A-E: our tokens/s (bars, speedup on top) and tau -- at the
    designed acceptance with measured markers for the oracle, measured for a real drafter; the paper's Table 4 in
    a panel of its own."""
    data = _data(df, "stree_tab4_tree_shapes")
    data = data[(data["batch"] == data["batch"].min()) & (data["temperature"] == data["temperature"].max())]
    models = _models(data)
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.4 * len(models)), squeeze=False)
    for row, (label, g) in zip(axes, models):
        _shape_bars(row[0], row[1], g)
        row[0].set_title(f"{label}, T = {g['temperature'].max():g}: tokens/s at the {_what(g)}", fontsize=8)
        row[1].set_title(_acceptance_note(g), fontsize=7)
        row[2].axis("off")
    axes[0, 2].axis("on")
    names = [s for s in "ABCDE" if s in PAPER_TAB4]
    px = np.arange(len(names))
    pbars = axes[0, 2].bar(px, [PAPER_TAB4[s][3] for s in names], 0.6, color="C5", label="tokens/s")
    for rect, s in zip(pbars, names):
        axes[0, 2].annotate(f"tau {PAPER_TAB4[s][4]:.2f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                            ha="center", va="bottom", fontsize=6)
    axes[0, 2].set_xticks(px, names)
    axes[0, 2].set_ylabel("tokens/s")
    axes[0, 2].margins(y=0.15)
    axes[0, 2].set_title(f"{PAPER}, T = 1", fontsize=7)
    _finish(fig, df, "STree Table 4: static tree shapes" + (" (measured acceptance)" if _trained(data) else ""), out,
            note=_notes(df, data))


def _shape_bars(ax_speed, ax_tau, data: pd.DataFrame) -> None:
    tree = data[data["draft_nodes"] > 0]
    ar = data[data["line"] == "autoregressive"]
    shapes = list(dict.fromkeys(tree["shape"]))
    x = np.arange(len(shapes))
    g = tree.set_index("shape").reindex(shapes)
    designed = has_designed(data)
    bars = ax_speed.bar(x, tokens_per_s(g), 0.6, color="C1", label="stree, " + (DESIGNED if designed else "measured"))
    if designed:
        ax_speed.scatter(x, g["tokens_per_s"], marker="o", s=14, color="k", zorder=3, label=MEASURED_MARK)
    if not ar.empty:
        ax_speed.axhline(float(ar["tokens_per_s"].iloc[0]), color="C7", linestyle="--", label="autoregressive")
    for rect, s in zip(bars, speedup(g)):
        if pd.notna(s):
            ax_speed.annotate(f"{s:.2f}x", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                              va="bottom", fontsize=7)
    if designed:
        ax_tau.bar(x, g["expected_accepted"] + 1.0, 0.6, color="C1", label=DESIGNED)
        ax_tau.scatter(x, g["tau"], marker="o", s=14, color="k", zorder=3, label=MEASURED_MARK)
    else:
        ax_tau.bar(x, g["tau"], 0.6, color="C1", label="measured")
    labels = [f"{s}\n" + (f"w{PAPER_TAB4[s][0]} d{PAPER_TAB4[s][1]} {PAPER_TAB4[s][2]} tok" if s in PAPER_TAB4 else "")
              for s in shapes]
    for ax, ylabel in ((ax_speed, "tokens/s"), (ax_tau, "tau (accepted + 1)" + ("" if designed else ", measured"))):
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=2)


def plot_tree_replay(df: pd.DataFrame, out: Path) -> None:
    """A row per model (per trained pair), a panel per shape: tokens/s vs batch of replay tree, stree tree, replay
    chain (equal tokens per call) and the baselines; oracle curves at the designed acceptance with the measured
    tokens/s of the same steps as crosses, measured curves (a real drafter) as measured."""
    data = _data(df, "tree_replay")
    data = data[data["temperature"] == data["temperature"].min()]
    shapes = [s for s in dict.fromkeys(data["shape"].dropna()) if not str(s).startswith("chain")]
    models = _models(data)
    fig, axes = plt.subplots(len(models), len(shapes), figsize=(5.6 * len(shapes), 4.4 * len(models)), squeeze=False)
    for row, (label, m) in zip(axes, models):
        designed = has_designed(m)
        base = m[m["draft_nodes"] == 0]
        for ax, shape in zip(row, shapes):
            g = m[(m["shape"] == shape) | m["shape"].astype(str).str.endswith(f"(={shape})")]
            for k, line in enumerate(dict.fromkeys(list(base["line"]) + list(g["line"]))):
                pts = m[m["line"] == line].sort_values("batch")
                color = {"autoregressive": "C7", "replay": "C0"}.get(line, f"C{k + 1}")
                style = dict(color=color, marker="o", ms=4,
                             linestyle="--" if line in ("autoregressive", "replay") else "-")
                spec = bool(pts["draft_nodes"].iloc[0])
                tau = (pts["expected_accepted"].iloc[-1] + 1.0) if designed and spec else pts["tau"].iloc[-1]
                lab = line + (f" (tau {tau:.2f}{', designed' if designed else ', measured'})" if spec else "")
                ax.plot(pts["batch"], tokens_per_s(pts), label=lab, **style)
                if designed and spec:
                    ax.scatter(pts["batch"], pts["tokens_per_s"], marker="x", s=40, color=color, zorder=3)
            if designed:
                ax.scatter([], [], marker="x", color="k", label=MEASURED_MARK)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel("tokens/s" + (" (curves: designed acceptance)" if designed else " (measured acceptance)"))
            ax.set_title(f"{label}, shape {shape}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    note = "\n".join(t for t in (textwrap.fill(_acceptance_text(data), 150), _notes(df, data)) if t)
    _finish(fig, df, "replay on token trees vs stree vs chain replay (equal tokens per call)", out, note=note)


def plot_tab8(df: pd.DataFrame, out: Path) -> None:
    """A row per trained pair: tokens/s (speedup and tau on top) and measured tau of autoregressive, vanilla SD,
    STree's static tree and STree's beam-search tree, greedy; the paper's Table 8 in a panel of its own."""
    data = _data(df, "stree_tab8_beam")
    data = data[(data["batch"] == data["batch"].min()) & (data["temperature"] == data["temperature"].min())]
    models = _models(data)
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.4 * len(models)), squeeze=False,
                             gridspec_kw=dict(width_ratios=[1.1, 1.1, 0.9]))
    temps = [float(data["temperature"].min())]
    for row, (label, g) in zip(axes, models):
        _line_bars(row[0], row[1], g, temps)
        row[0].set_title(f"{label}, batch {int(g['batch'].iloc[0])}: tokens/s at the {_what(g)}", fontsize=8)
        row[1].set_title(_acceptance_note(g), fontsize=7)
        row[2].axis("off")
    ax = axes[0, 2]
    ax.axis("on")
    names = list(PAPER_TAB8)
    bars = ax.bar(np.arange(len(names)), [PAPER_TAB8[n][0] for n in names], 0.6, color="C5")
    for rect, n in zip(bars, names):
        speed, tau = PAPER_TAB8[n]
        ax.annotate(f"{speed / PAPER_TAB8['autoregressive'][0]:.2f}x\ntau {tau:.2f}",
                    (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(np.arange(len(names)), [n.replace(" ", "\n") for n in names], fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.margins(y=0.2)
    ax.set_title(f"{PAPER}, greedy, MT-Bench", fontsize=7)
    _finish(fig, df, "STree Table 8: static tree vs beam-search tree (M=3, N=4), greedy, measured acceptance", out,
            note=_notes(df, data))
