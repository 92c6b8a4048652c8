"""Figures of the Snakes and Ladders end-to-end experiments (bench/e2e_snl.py), drawn from result rows only.
Throughput is decode tokens/s of the engine's steps; a speedup is over the autoregressive line of the same set
and run. Every panel names its acceptance (oracle at alpha, or measured with the PNG drafter); oracle lines are
drawn at their designed acceptance with the measured tokens/s of the same steps as markers, and the paper's
numbers apart (``plots/designed.py``, docs/design.md, "Drafting and acceptance")."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ssmspec.plots.designed import (DESIGNED, MEASURED_MARK, has_designed, rerun_note, speedup, tokens_per_s,
                                    within_note)
from ssmspec.plots.style import ok_rows, provenance

COLORS = {"autoregressive": "0.55", "joint_attainment": "tab:orange", "activation_replay": "tab:blue"}
SHORT = {"autoregressive": "autoregressive", "joint_attainment": "joint", "activation_replay": "ARP"}
PAPER_FIG4_GAIN = 0.29  # seed 001 Fig. 4: up to +29% throughput at the best draft count
PAPER = "paper, measured acceptance (Mamba-2, A10G, PNG drafter)"


def _finish(fig, df: pd.DataFrame, title: str, out: Path, note: str = "") -> None:
    fig.suptitle(f"{title}\n{provenance(df)}", fontsize=9)
    if note:
        fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=6, color="0.3")
    fig.tight_layout(rect=(0, 0.03 * (note.count("\n") + 1) if note else 0, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)


def line_labels(data: pd.DataFrame) -> pd.DataFrame:
    """Rows whose ``line`` names the drafter that drafted: rows written before lines were named so called the
    oracle's D chains of S "PNG(S,D)" (the prompt n-gram drafter's notation); their ``drafter`` column says oracle."""
    if "drafter" not in data.columns:
        return data
    oracle = (data["drafter"] == "oracle") & data["line"].str.contains("PNG(", regex=False)
    return data.assign(line=data["line"].where(~oracle, data["line"].str.replace("PNG(", "oracle(", regex=False)))


def acceptance_note(data: pd.DataFrame) -> str:
    """'oracle alpha=0.51' / 'measured (png)' from the speculative rows."""
    spec = data[data["drafts"] > 0]
    kinds = sorted(set(spec["acceptance"].dropna()))
    parts = []
    if "oracle" in kinds:
        modes = sorted(set(spec["oracle"].dropna())) if "oracle" in spec.columns else []
        modes += sorted(f"{d} draws" for d in set(spec["draws"].dropna())) if "draws" in spec.columns else []
        parts.append("oracle alpha=" + "/".join(f"{a:.2f}" for a in sorted(set(spec["alpha"].dropna())))
                     + (f" ({', '.join(modes)})" if modes else ""))
    if "measured" in kinds:
        parts.append("measured acceptance (PNG drafter)")
    return ", ".join(parts)


def tab5_table(df: pd.DataFrame) -> pd.DataFrame:
    """(line x set) table of tokens/s and speedup, measured and (where the rows have them) designed, for the README."""
    data = line_labels(ok_rows(df))
    values = [c for c in ("tokens_per_s", "tokens_per_s_designed", "speedup", "speedup_designed") if c in data.columns]
    return data.pivot_table(index=["model", "line"], columns="set", values=values, sort=False)


def plot_snl_tab5(df: pd.DataFrame, out: Path) -> None:
    """Per model: grouped bars of tokens/s per prompt set and line (at the designed acceptance for oracle lines,
    measured tokens/s as markers), each labelled with its speedup over autoregressive; the paper's Table 5
    speedups in a panel of their own; skipped sets are named with why."""
    if "status" not in df.columns or ok_rows(df).empty:
        raise ValueError("snl_tab5_e2e: no measured rows to plot")
    data = line_labels(ok_rows(df))
    models = list(dict.fromkeys(data["model"]))
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(7.5 * len(models) + 4.5, 4.6), squeeze=False,
                             gridspec_kw=dict(width_ratios=[7.5] * len(models) + [4.5]))
    for ax, model in zip(axes[0], models):
        g = data[data["model"] == model]
        designed = has_designed(g)
        sets = list(dict.fromkeys(g["set"]))
        lines = list(dict.fromkeys(g["line"]))
        w = 0.8 / len(lines)
        x = np.arange(len(sets))
        for i, line in enumerate(lines):
            pts = g[g["line"] == line].set_index("set").reindex(sets)
            strategy = str(pts["strategy"].dropna().iloc[0])
            xi = x + (i - (len(lines) - 1) / 2) * w
            bars = ax.bar(xi, tokens_per_s(pts).fillna(0), w, color=COLORS.get(strategy, "C2"), label=line)
            spec = pts["drafts"].fillna(0) > 0
            if designed and spec.any():
                ax.scatter(xi[spec.to_numpy()], pts["tokens_per_s"][spec], marker="o", s=12, color="k", zorder=3,
                           label=MEASURED_MARK if i == len(lines) - 1 else None)
            for bar, (_, r), up in zip(bars, pts.iterrows(), speedup(pts)):
                if pd.isna(up) or r["drafts"] == 0:
                    continue
                acc = (f"{r['expected_accepted']:.2f} designed / {r['mean_accepted']:.2f} measured acc" if designed
                       else f"{r['mean_accepted']:.2f} acc")
                ax.annotate(f"{up:.2f}x\n{acc}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=5)
        skipped = df[(df["model"] == model) & (df["status"] == "skipped")].reindex(columns=["set", "reason"])
        notes = [f"{s}: skipped, " + ("not on disk (python -m ssmspec.data.fetch)" if "ssmspec.data.fetch" in str(r)
                                      else str(r)[:80])
                 for s, r in dict(zip(skipped["set"], skipped.get("reason", skipped["set"]))).items() if s not in sets]
        ax.set_xticks(x, sets)
        ax.margins(y=0.35)
        what = f", tokens/s at the {DESIGNED}" if designed else ""
        ax.set(ylabel="decode tokens / s", title=f"{model}: {acceptance_note(g)}, batch "
               f"{'/'.join(str(int(b)) for b in sorted(set(g['batch'])))}, {int(g['new_tokens'].iloc[0])} new tokens"
               f"{what}")
        ax.title.set_fontsize(7)
        ax.legend(fontsize=6, loc="upper left")
        if notes:
            ax.text(0.99, 0.98, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=6,
                    bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
    _paper_tab5(axes[0][-1], df)
    note = "\n".join(t for t in (within_note(data), rerun_note(df)) if t)
    _finish(fig, df, "Snakes and Ladders Table 5: end-to-end decode throughput, 2 drafts of 6 tokens a sequence",
            out, note=note)


def paper_tab5(df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """{strategy: {set: tokens/s}} of seed 001's Table 5, as the benchmark wrote it beside each row
    (``paper_tokens_per_s``, skipped rows included), in the rows' order."""
    if "paper_tokens_per_s" not in df.columns:
        return {}
    table: dict[str, dict[str, float]] = {}
    for r in df.dropna(subset=["paper_tokens_per_s"]).itertuples():
        table.setdefault(r.strategy, {}).setdefault(r.set, float(r.paper_tokens_per_s))
    return table


def _paper_tab5(ax, df: pd.DataFrame) -> None:
    """Seed 001's Table 5 speedups per set and strategy (its own panel: measured acceptance, other hardware)."""
    tab = paper_tab5(df)
    if "autoregressive" not in tab:
        ax.set_axis_off()
        ax.set_title(f"{PAPER}: no paper_tokens_per_s in these rows", fontsize=7)
        return
    sets = list(tab["autoregressive"])
    strategies = [s for s in tab if s != "autoregressive"]
    w = 0.8 / len(strategies)
    for i, strategy in enumerate(strategies):
        ups = [tab[strategy][s] / tab["autoregressive"][s] for s in sets]
        bars = ax.bar(np.arange(len(sets)) + (i - (len(strategies) - 1) / 2) * w, ups, w,
                      color=COLORS.get(strategy, "C2"), label=f"{SHORT.get(strategy, strategy)} + PNG(6,2)")
        for bar, up in zip(bars, ups):
            ax.annotate(f"{up:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=6)
    ax.set_xticks(np.arange(len(sets)), sets)
    ax.margins(y=0.25)
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(PAPER, fontsize=7)
    ax.legend(fontsize=6, loc="upper left")


def fig4_best(data: pd.DataFrame) -> pd.DataFrame:
    """Per (model, strategy, batch): the draft count with the highest tokens/s (at the designed acceptance where the
    rows have it, ``plots/designed.py``) and its gain over autoregressive (draft count 0 included: a gain of 0
    means speculation does not pay at that batch)."""
    out = []
    data = data.assign(value=tokens_per_s(data))
    for (model, batch), g in data.groupby(["model", "batch"], sort=True):
        ar = g[g["drafts"] == 0]
        if ar.empty:
            continue
        for strategy, s in g[g["drafts"] > 0].groupby("strategy", sort=False):
            best = pd.concat([ar, s]).sort_values("value", ascending=False).iloc[0]
            out.append(dict(model=model, strategy=strategy, batch=int(batch), best_drafts=int(best["drafts"]),
                            tokens_per_s=float(best["value"]), ar_tokens_per_s=float(ar["tokens_per_s"].iloc[0]),
                            gain=float(best["value"] / ar["tokens_per_s"].iloc[0] - 1.0)))
    return pd.DataFrame(out)


def plot_snl_fig4(df: pd.DataFrame, out: Path) -> None:
    """Per model, seed 001 Fig. 4's two panels: (left) the gain over autoregressive at the best draft count per
    batch and strategy, labelled with that count; (right) tokens/s vs drafts per sequence, a line per batch."""
    data = line_labels(ok_rows(df))
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
        left.axhline(0, color="0.5", lw=0.8)
        left.set_xticks(x, [str(v) for v in batches])
        left.margins(y=0.25)
        lo, hi = left.get_ylim()
        left.set_ylim(min(lo, 0.0), max(hi, 10.0))  # all gains 0 (no draft count pays): a readable 0-10% axis
        if not b.empty and (b["best_drafts"] == 0).all():
            left.text(0.5, 0.5, "no draft count beats autoregressive at any batch", transform=left.transAxes,
                      ha="center", va="center", fontsize=8, color="0.3")
        designed = has_designed(g)
        left.set(xlabel="batch size", ylabel="throughput gain at the best draft count (%)",
                 title=f"{model}: {acceptance_note(g)}" + (f"\ngains at the {DESIGNED}" if designed else ""))
        left.title.set_fontsize(8)
        left.text(0.01, 0.98, f"{PAPER}: up to +{PAPER_FIG4_GAIN:.0%}", transform=left.transAxes, ha="left",
                  va="top", fontsize=6, bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
        left.legend(fontsize=7, loc="upper right")
        cmap = plt.get_cmap("viridis")
        for j, batch in enumerate(batches):
            color = cmap(j / max(len(batches) - 1, 1))
            ar = g[(g["batch"] == batch) & (g["drafts"] == 0)]
            for strategy, style in zip(strategies, ("-", "--", ":")):
                pts = pd.concat([ar, g[(g["batch"] == batch) & (g["strategy"] == strategy)]]).sort_values("drafts")
                right.plot(pts["drafts"], tokens_per_s(pts), style, marker="o", ms=3, color=color,
                           label=f"B={batch} {SHORT.get(strategy, strategy)}")
                if designed:
                    spec = pts[pts["drafts"] > 0]
                    right.scatter(spec["drafts"], spec["tokens_per_s"], marker="x", s=10, color=color, zorder=3)
        right.set_yscale("log")
        right.set_xticks(sorted({int(v) for v in g["drafts"]}))
        if designed:
            right.scatter([], [], marker="x", color="k", label=MEASURED_MARK)
        spec = g[(g["drafts"] > 0) & (g["acceptance"] == "measured")]
        accepted = ("\nmeasured accepted drafts per step, mean over batches:\n" + ", ".join(
            f"D={int(d)} {a:.2f}" for d, a in spec.groupby("drafts")["mean_accepted"].mean().items())) if len(spec) else ""
        right.set(xlabel="drafts per sequence (0 = autoregressive)",
                  ylabel="decode tokens / s" + (" (curves: designed acceptance)" if designed else ""),
                  title=f"S = {int(g[g['drafts'] > 0]['S'].max()) if (g['drafts'] > 0).any() else 0} tokens per draft, "
                        f"{int(g['new_tokens'].iloc[0])} new tokens per sequence{accepted}")
        right.title.set_fontsize(8)
        right.grid(alpha=0.3, which="both")
        right.legend(fontsize=5, ncol=2, loc="best")
    note = "\n".join(t for t in (within_note(data), rerun_note(df)) if t)
    _finish(fig, df, "Snakes and Ladders Fig. 4: multi-sequence speculation, throughput vs drafts per sequence", out,
            note=note)
