"""Figures of the Snakes and Ladders end-to-end experiments (bench/e2e_snl.py), drawn from result rows only.
Throughput is decode tokens/s of the engine's steps; a speedup is over the autoregressive line of the same set
and run. Every panel names its acceptance (oracle at alpha, or measured with the PNG drafter)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance

COLORS = {"autoregressive": "0.55", "joint_attainment": "tab:orange", "activation_replay": "tab:blue"}
SHORT = {"autoregressive": "autoregressive", "joint_attainment": "joint", "activation_replay": "ARP"}
PAPER_FIG4_GAIN = 0.29  # seed 001 Fig. 4: up to +29% throughput at the best draft count


def _finish(fig, df: pd.DataFrame, title: str, out: Path) -> None:
    fig.suptitle(f"{title}\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def acceptance_note(data: pd.DataFrame) -> str:
    """'oracle alpha=0.51' / 'measured (png)' from the speculative rows."""
    spec = data[data["drafts"] > 0]
    kinds = sorted(set(spec["acceptance"].dropna()))
    parts = []
    if "oracle" in kinds:
        modes = sorted(set(spec["oracle"].dropna())) if "oracle" in spec.columns else []
        parts.append("oracle alpha=" + "/".join(f"{a:.2f}" for a in sorted(set(spec["alpha"].dropna())))
                     + (f" ({'/'.join(modes)})" if modes else ""))
    if "measured" in kinds:
        parts.append("measured acceptance (PNG drafter)")
    return ", ".join(parts)


def tab5_table(df: pd.DataFrame) -> pd.DataFrame:
    """(line x set) table of measured tokens/s and speedup, for the plot and the README."""
    data = ok_rows(df)
    return data.pivot_table(index=["model", "line"], columns="set", values=["tokens_per_s", "speedup"], sort=False)


def plot_snl_tab5(df: pd.DataFrame, out: Path) -> None:
    """Per model: grouped bars of tokens/s per prompt set and line, each bar labelled with its speedup over
    autoregressive and the paper's (Table 5); skipped sets are named with why."""
    if "status" not in df.columns or ok_rows(df).empty:
        raise ValueError("snl_tab5_e2e: no measured rows to plot")
    data = ok_rows(df)
    models = list(dict.fromkeys(data["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        g = data[data["model"] == model]
        sets = list(dict.fromkeys(g["set"]))
        lines = list(dict.fromkeys(g["line"]))
        w = 0.8 / len(lines)
        x = np.arange(len(sets))
        for i, line in enumerate(lines):
            pts = g[g["line"] == line].set_index("set").reindex(sets)
            strategy = str(pts["strategy"].dropna().iloc[0])
            bars = ax.bar(x + (i - (len(lines) - 1) / 2) * w, pts["tokens_per_s"].fillna(0), w,
                          color=COLORS.get(strategy, "C2"), label=line)
            for bar, (_, r) in zip(bars, pts.iterrows()):
                if pd.isna(r.get("speedup")) or r["drafts"] == 0:
                    continue
                paper = r.get("paper_speedup")
                text = f"{r['speedup']:.2f}x\n{r['mean_accepted']:.2f} acc"
                if paper is not None and not pd.isna(paper):
                    text += f"\n(paper {paper:.2f}x)"
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                            fontsize=6)
        skipped = df[(df["model"] == model) & (df["status"] == "skipped")]
        notes = [f"{s}: skipped, " + ("not on disk (python -m ssmspec.data.fetch)" if "ssmspec.data.fetch" in str(r)
                                      else str(r)[:80])
                 for s, r in dict(zip(skipped["set"], skipped["reason"])).items() if s not in sets]
        ax.set_xticks(x, sets)
        ax.margins(y=0.3)
        ax.set(ylabel="decode tokens / s", title=f"{model}: {acceptance_note(g)}, batch "
               f"{'/'.join(str(int(b)) for b in sorted(set(g['batch'])))}, {int(g['new_tokens'].iloc[0])} new tokens")
        ax.legend(fontsize=7, loc="upper left")
        if notes:
            ax.text(0.99, 0.98, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=6,
                    bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
    _finish(fig, df, "Snakes and Ladders Table 5: end-to-end decode throughput with PNG drafts "
            "(paper mean 1.82x joint, 1.64x ARP)", out)


def fig4_best(data: pd.DataFrame) -> pd.DataFrame:
    """Per (model, strategy, batch): the draft count with the highest tokens/s and its gain over autoregressive
    (draft count 0 included: a gain of 0 means speculation does not pay at that batch)."""
    out = []
    for (model, batch), g in data.groupby(["model", "batch"], sort=True):
        ar = g[g["drafts"] == 0]
        if ar.empty:
            continue
        for strategy, s in g[g["drafts"] > 0].groupby("strategy", sort=False):
            best = pd.concat([ar, s]).sort_values("tokens_per_s", ascending=False).iloc[0]
            out.append(dict(model=model, strategy=strategy, batch=int(batch), best_drafts=int(best["drafts"]),
                            tokens_per_s=float(best["tokens_per_s"]), ar_tokens_per_s=float(ar["tokens_per_s"].iloc[0]),
                            gain=float(best["tokens_per_s"] / ar["tokens_per_s"].iloc[0] - 1.0)))
    return pd.DataFrame(out)


def plot_snl_fig4(df: pd.DataFrame, out: Path) -> None:
    """Per model, seed 001 Fig. 4's two panels: (left) the gain over autoregressive at the best draft count per
    batch and strategy, labelled with that count; (right) tokens/s vs drafts per sequence, a line per batch."""
    data = ok_rows(df)
    if data.empty:
        raise ValueError("snl_fig4_multiseq: no measured rows to plot")
    models = list(dict.fromkeys(data["model"]))
    best = fig4_best(data)
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4.2 * len(models)), squeeze=False)
    for (left, right), model in zip(axes, models):
        g = data[data["model"] == model]
        b = best[best["model"] == model] if not best.empty else best
        batches = sorted({int(v) for v in g["batch"]})
        strategies = [s for s in dict.fromkeys(g["strategy"]) if s != "autoregressive"]
        x = np.arange(len(batches))
        w = 0.8 / max(len(strategies), 1)
        for i, strategy in enumerate(strategies):
            pts = b[b["strategy"] == strategy].set_index("batch").reindex(batches)
            bars = left.bar(x + (i - (len(strategies) - 1) / 2) * w, 100 * pts["gain"].fillna(0), w,
                            color=COLORS.get(strategy, "C2"), label=SHORT.get(strategy, strategy))
            for bar, (_, r) in zip(bars, pts.iterrows()):
                if not pd.isna(r["gain"]):
                    left.annotate(f"D={int(r['best_drafts'])}\n{r['tokens_per_s']:.0f}/s", (bar.get_x() + bar.get_width() / 2,
                                  max(bar.get_height(), 0)), ha="center", va="bottom", fontsize=6)
        left.axhline(100 * PAPER_FIG4_GAIN, color="0.3", ls=":", lw=1, label=f"paper: up to +{PAPER_FIG4_GAIN:.0%}")
        left.axhline(0, color="0.5", lw=0.8)
        left.set_xticks(x, [str(v) for v in batches])
        left.margins(y=0.25)
        left.set(xlabel="batch size", ylabel="throughput gain at the best draft count (%)",
                 title=f"{model}: {acceptance_note(g)}")
        left.legend(fontsize=7, loc="upper right")
        cmap = plt.get_cmap("viridis")
        for j, batch in enumerate(batches):
            color = cmap(j / max(len(batches) - 1, 1))
            ar = g[(g["batch"] == batch) & (g["drafts"] == 0)]
            for strategy, style in zip(strategies, ("-", "--", ":")):
                pts = pd.concat([ar, g[(g["batch"] == batch) & (g["strategy"] == strategy)]]).sort_values("drafts")
                right.plot(pts["drafts"], pts["tokens_per_s"], style, marker="o", ms=3, color=color,
                           label=f"B={batch} {SHORT.get(strategy, strategy)}")
        right.set_yscale("log")
        right.set_xticks(sorted({int(v) for v in g["drafts"]}))
        right.set(xlabel="drafts per sequence (0 = autoregressive)", ylabel="decode tokens / s",
                  title=f"S = {int(g[g['drafts'] > 0]['S'].max()) if (g['drafts'] > 0).any() else 0} tokens per draft, "
                        f"{int(g['new_tokens'].iloc[0])} new tokens per sequence")
        right.grid(alpha=0.3, which="both")
        right.legend(fontsize=5, ncol=2, loc="best")
    _finish(fig, df, "Snakes and Ladders Fig. 4: multi-sequence speculation, throughput vs drafts per sequence", out)
