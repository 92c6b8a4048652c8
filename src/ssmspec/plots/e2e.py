"""Figures of the end-to-end experiments (bench/e2e.py, bench/e2e_concurrency.py), drawn from result rows only.
Throughput is emitted tokens/s of the engine's steps; ratios are of two lines measured in the same run."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ssmspec.plots.style import fmt_bytes, ok_rows, provenance

# seed 000: 3.0-3.3x snapshot's batch (Fig. 11, memory alone). Its Fig. 8 speedups (1.87-1.96x) rest on the
# acceptance its MTP drafters measured; ours on the oracle's designed one, so the figure does not quote them.
GOAL_P6 = 2.0  # replay spec / autoregressive at batch 256
GOAL_BATCH = 256
PAPER_FIG11 = (3.0, 3.3)
GOAL_P7 = 3.3  # replay spec max batch / snapshot spec max batch
GOAL_DRAFT = 1.10  # a draft model's call / its own autoregressive step at the same batch (issue 23)
COLORS = {"autoregressive": "C7", "replay": "C0", "snapshot": "C3"}
DRAFTER_COLORS = {"mtp": "C4", "draft_model": "C1", "png": "C2"}  # measured lines: '<line> + <drafter>'


def _finish(fig, df: pd.DataFrame, title: str, out: Path) -> None:
    fig.suptitle(f"{title}\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _style(line: str) -> dict:
    strategy = line.split()[0]
    spec = "spec" in line
    head, _, drafter = line.partition(" + ")
    if drafter in DRAFTER_COLORS:  # a real drafter's line (bench.measured_drafters): colour = drafter
        return dict(color=DRAFTER_COLORS[drafter], linestyle="-" if strategy == "replay" else "--",
                    marker="o" if strategy == "replay" else "s", alpha=1.0 if head.endswith("S=4") else 0.6)
    if line.endswith("+ draft"):  # the draft model's cost at the oracle's acceptance
        return dict(color="C1", linestyle=":", marker="^", alpha=1.0 if "S=4" in line else 0.7)
    return dict(color=COLORS.get(strategy, "C2"), linestyle="-" if spec or strategy == "autoregressive" else "--",
                marker="o" if spec else "s", alpha=1.0 if line.endswith("S=4") or not spec else 0.7)


def _draft_panel(ax, g: pd.DataFrame) -> None:
    """A draft model's call over its own autoregressive step at the same batch (rows' ``draft_vs_ar``)."""
    d = g[g["line"].str.endswith("+ draft")].dropna(subset=["draft_vs_ar"]) if "draft_vs_ar" in g.columns else g[:0]
    for line in dict.fromkeys(d["line"]):
        pts = d[d["line"] == line].sort_values("batch")
        ax.plot(pts["batch"], pts["draft_vs_ar"], label=line, **_style(line))
    ax.axhline(GOAL_DRAFT, color="C3", lw=0.8, ls="--", label=f"goal <= {GOAL_DRAFT:.2f}")
    worst = d["draft_vs_ar"].max() if len(d) else float("nan")
    name = d["draft"].iloc[0] if len(d) else ""
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="draft call / draft autoregressive step",
           title=f"draft {name}: a draft call costs {worst:.2f}x its autoregressive step at worst")
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)


def _acceptance(g: pd.DataFrame) -> str:
    """'acceptance: <mode> oracle, alpha = <a>' or 'acceptance: measured, PNG drafter' for a panel title: which
    drafter set the acceptance, and how the oracle's drafts were verified (forced: its kept tokens are accepted;
    compare: token comparison)."""
    spec = g[g["S"] > 0] if "S" in g.columns else g
    if spec.empty:
        return ""
    if "acceptance" in spec.columns and (spec["acceptance"] == "measured").all():
        names = list(dict.fromkeys(str(d) for d in spec["drafter"]))
        return f"acceptance: measured, {' / '.join(n.upper() for n in names)} drafter{'s' if len(names) > 1 else ''}"
    alpha = spec["alpha"].dropna()
    modes = sorted(set(spec["oracle"].dropna())) if "oracle" in spec.columns else []
    mode = f"{'/'.join(modes)} " if modes else ""
    return f"acceptance: {mode}oracle, alpha = {alpha.iloc[0]:.2f}" if len(alpha) else ""


def fig8_ratios(data: pd.DataFrame, model: str) -> dict[tuple[str, int], float]:
    """{(line, batch): tokens/s of the line / tokens/s of autoregressive} for one model's measured rows."""
    g = data[data["model"] == model]
    ar = g[g["line"] == "autoregressive"].set_index("batch")["tokens_per_s"]
    return {(r.line, int(r.batch)): r.tokens_per_s / ar[r.batch] for r in g.itertuples() if r.batch in ar.index}


def plot_fig8(df: pd.DataFrame, out: Path) -> None:
    """Tokens/s vs batch (log2), one panel per model and a line per strategy/window; points where snapshot spec
    falls below autoregressive are ringed; the best replay spec ratio at batch 256 is set against goal P6. With
    draft-model lines, a second row: a draft call over the draft model's own autoregressive step."""
    data = ok_rows(df)
    if data.empty:
        raise ValueError("replay_fig8_throughput: no measured rows to plot")
    models = list(dict.fromkeys(data["model"]))
    drafted = "draft" in data.columns and data["line"].str.endswith("+ draft").any()
    rows = 2 if drafted else 1
    fig, axes = plt.subplots(rows, len(models), figsize=(max(5.6 * len(models), 10.0), 4.2 * rows), squeeze=False)
    for i, model in enumerate(models):
        ax = axes[0][i]
        g = data[data["model"] == model]
        if drafted and g["line"].str.endswith("+ draft").any():
            _draft_panel(axes[1][i], g)
        elif drafted:
            axes[1][i].axis("off")  # this model has no draft-model lines
        ratios = fig8_ratios(data, model)
        measured = "acceptance" in g.columns and (g["acceptance"] == "measured").any()
        for line in dict.fromkeys(g["line"]):
            if line == "draft autoregressive":  # another model's throughput: its step is the lower panel's unit
                continue
            pts = g[g["line"] == line].sort_values("batch")
            label = f"{line} ({pts['mean_accepted'].mean():.2f} accepted)" if measured and pts["S"].max() else line
            ax.plot(pts["batch"], pts["tokens_per_s"], label=label, **_style(line))
            if line.startswith("snapshot"):
                below = pts[[ratios.get((line, int(b)), 1.0) < 1.0 for b in pts["batch"]]]
                ax.scatter(below["batch"], below["tokens_per_s"], s=120, facecolors="none", edgecolors="C3",
                           linewidths=1.4, label=f"{line} < autoregressive" if len(below) else None)
        below = sorted({k[1] for k, v in ratios.items() if k[0].startswith("snapshot") and v < 1.0})
        notes = [f"snapshot spec below autoregressive at batch {', '.join(map(str, below))}"] if below else []
        skipped = df[(df["model"] == model) & (df["status"] != "ok")] if "status" in df.columns else df.iloc[0:0]
        first = {}  # smallest batch that did not run -> the lines it stopped
        for line, s in skipped.groupby("line", sort=False):
            if line == "draft autoregressive":
                continue
            first.setdefault(int(s["batch"].min()), []).append(line)
        every = set(df[df["model"] == model]["line"]) - {"draft autoregressive"}
        notes += [f"{'every line' if set(ls) == every else ', '.join(ls) if len(ls) <= 2 else f'{len(ls)} lines'}: "
                  f"no fit from batch {b}" for b, ls in sorted(first.items())]
        spec = {k: v for k, v in ratios.items() if k[0].startswith("replay spec") and not k[0].endswith("+ draft")}
        at = {k: v for k, v in spec.items() if k[1] == GOAL_BATCH}
        if at:
            (line, _), best = max(at.items(), key=lambda kv: kv[1])
            mark = "met" if best >= GOAL_P6 else "missed"
            # at the oracle's designed acceptance: never set beside the paper's measured one (MTP drafters)
            notes.insert(0, f"batch {GOAL_BATCH}: {line} {best:.2f}x autoregressive at the "
                            f"{'measured' if measured else 'designed'} acceptance (goal P6 >= {GOAL_P6}x: {mark})")
        elif spec:
            (line, b), best = max(spec.items(), key=lambda kv: (kv[0][1], kv[1]))
            notes.insert(0, f"largest batch {b}: {line} {best:.2f}x autoregressive"
                            f"{' (measured acceptance)' if measured else ''} (no batch {GOAL_BATCH})")
        acc = _acceptance(g)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="batch size", ylabel="emitted tokens / s", title=f"{model}\n{acc}" if acc else model)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, loc="upper left")
        if notes:
            ax.text(0.99, 0.02, "\n".join(notes), transform=ax.transAxes, ha="right", va="bottom", fontsize=6,
                    bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
    _finish(fig, df, "ReplaySSM Fig. 8: decode throughput vs batch size", out)


def fig11_ratios(data: pd.DataFrame) -> dict[str, float]:
    """{model: max batch of replay spec / max batch of snapshot spec} from the result rows."""
    out = {}
    for model, g in data.groupby("model", sort=False):
        by = dict(zip(g["strategy"], g["max_batch"]))
        if by.get("snapshot") and "replay" in by:
            out[model] = by["replay"] / by["snapshot"]
    return out


def plot_fig11(df: pd.DataFrame, out: Path) -> None:
    """Largest decode batch under the HBM budget per model x strategy (bars, hatched where a real OOM set the
    limit rather than the plan); replay spec over snapshot spec against goal P7."""
    data = df[df["kind"] == "max_batch"] if "kind" in df.columns else df.iloc[0:0]
    if data.empty:
        raise ValueError("replay_fig11_concurrency: no max_batch rows to plot")
    models = list(dict.fromkeys(data["model"]))
    strategies = list(dict.fromkeys(data["strategy"]))
    fig, ax = plt.subplots(figsize=(max(5.0, 2.4 * len(models) + 2), 4.0))
    w = 0.8 / len(strategies)
    x = np.arange(len(models))
    for i, strategy in enumerate(strategies):
        g = data[data["strategy"] == strategy].set_index("model").reindex(models)
        bars = ax.bar(x + (i - (len(strategies) - 1) / 2) * w, g["max_batch"].fillna(0), w,
                      color=COLORS.get(strategy, "C2"), label=str(g["line"].dropna().iloc[0]))
        for bar, (_, r) in zip(bars, g.iterrows()):
            if pd.isna(r["max_batch"]):
                continue
            if r["limit"] == "oom":
                bar.set_hatch("//")
            ax.annotate(f"{int(r['max_batch'])}\n({r['limit']})", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=6)
    budget = sorted({float(v) for v in data["budget_bytes"]})
    notes = [f"{m}: replay spec {r:.2f}x snapshot spec (goal P7 >= {GOAL_P7}x: {'met' if r >= GOAL_P7 else 'missed'}; "
             f"paper {PAPER_FIG11[0]}-{PAPER_FIG11[1]}x)" for m, r in fig11_ratios(data).items()]
    ax.set_xticks(x, models)
    ax.set(ylabel="max decode batch", title="budget " + ", ".join(fmt_bytes(b) for b in budget))
    ax.margins(y=0.25)
    ax.legend(fontsize=7, loc="upper left")
    if notes:
        ax.text(0.99, 0.98, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=6,
                bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
    _finish(fig, df, "ReplaySSM Fig. 11: max decode batch under a fixed HBM budget", out)
