"""Figure of ``trained_acceptance``: measured mean accepted length per drafter and S, one panel per prompt set.

Bars: one group per drafter line (draft_model S=2, png S=4, beam_tree 2x4, ...), one bar per strategy, the value
once above the group (greedy verification accepts the same drafts under every strategy, so the bars of a group
agree; when they do not, every value is printed). A line whose output differs from autoregressive decoding is
hatched and says so. A panel's title gives the draft's top-1 agreement
with the target on that set. With rows of ``kind: throughput`` (the gpu profile) a second row of panels shows,
per set, each speculative line's tokens/s over autoregressive decoding at every batch (the captured engine, the
acceptance measured on those prompts), with the issue's goal (1.5x, replay + draft_model at S = 4) drawn.
Measured on small pairs the suite trains itself: nothing here is set beside a paper's acceptance or an
oracle's designed one.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import provenance

_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
GOAL_SPEEDUP = 1.5  # issue 24: replay spec with the distilled draft at S = 4, batch 1 and 64, over autoregressive


def _line(r) -> str:
    return r["drafter"] if r["drafter"].startswith(("beam_tree", "static_tree")) else f"{r['drafter']} S={int(r['S'])}"


def _panel(ax, d: pd.DataFrame, agree: pd.DataFrame, name: str, colors: dict) -> None:
    d = d[d["drafter"] != "none"]
    lines = list(dict.fromkeys(_line(r) for _, r in d.iterrows()))
    labelled: set[str] = set()
    for i, line in enumerate(lines):
        rows = [r for _, r in d.iterrows() if _line(r) == line]
        width = 0.8 / len(rows)
        for j, r in enumerate(rows):
            s = r["strategy"]
            x = i - 0.4 + width * (j + 0.5)
            ax.bar(x, r["mean_accepted"], width, color=colors[s], hatch=None if r["exact"] else "//",
                   label=None if s in labelled else s)
            labelled.add(s)
        values = {round(float(r["mean_accepted"]), 3) for r in rows}
        text = f"{rows[0]['mean_accepted']:.2f}" if len(values) == 1 else " / ".join(f"{v:.2f}" for v in sorted(values))
        if not all(r["exact"] for r in rows):
            text += "\nNOT exact"
        ax.text(i, max(values), text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(lines)), lines, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("mean accepted draft tokens per step")
    title = f"{name}: {int(d['prompts'].iloc[0])} prompts x {int(d['new_tokens'].iloc[0])} new tokens"
    if len(agree):
        a = agree.iloc[0]
        title += (f"\ndraft top-1 = target top-1 on {100 * a['draft_target_top1']:.0f}% of {int(a['tokens'])} tokens"
                  f" (target top-1 accuracy {100 * a['target_top1_acc']:.0f}%)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, title="strategy", title_fontsize=7)


def _speed_panel(ax, t: pd.DataFrame, name: str) -> None:
    t = t[t["S"] > 0]
    lines = list(dict.fromkeys(f"{r['line']} S={int(r['S'])}" for _, r in t.iterrows()))
    batches = sorted(set(int(b) for b in t["batch"]))
    width = 0.8 / max(len(batches), 1)
    for j, bsz in enumerate(batches):
        for i, line in enumerate(lines):
            rows = [r for _, r in t.iterrows() if f"{r['line']} S={int(r['S'])}" == line and int(r["batch"]) == bsz]
            if not rows:
                continue
            r = rows[0]
            x = i - 0.4 + width * (j + 0.5)
            ax.bar(x, r["speedup_vs_ar"], width, color=_COLORS[j % len(_COLORS)], label=f"batch {bsz}" if i == 0 else None,
                   hatch=None if r["ref_match"] == 1.0 else "//")
            ax.text(x, r["speedup_vs_ar"], f"{r['speedup_vs_ar']:.2f}\n{r['mean_accepted']:.1f}", ha="center",
                    va="bottom", fontsize=6)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(GOAL_SPEEDUP, color="red", ls="--", lw=0.8, label=f"goal {GOAL_SPEEDUP}x (replay + draft_model S=4)")
    ax.set_xticks(range(len(lines)), lines, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s over autoregressive (label: x, mean accepted)")
    r = t.iloc[0] if len(t) else None
    ax.set_title(f"{name}: captured engine, {r['dtype'] if r is not None else ''}; hatched: output left the "
                 f"autoregressive engine's", fontsize=8)
    ax.legend(fontsize=7)


def _pair_label(r) -> str:
    return (f"{r['target']} ({int(r['target_params']):,} params, val loss {r['target_val_loss']:.2f}) drafted by "
            f"{r['draft']} ({int(r['draft_params']):,} params, KL {r['draft_val_kl']:.2f})")


def plot_acceptance(df: pd.DataFrame, out: Path) -> None:
    """Draw the PNG at ``out`` from the rows of one trained_acceptance run: per family of the run a row of
    acceptance panels (one per prompt set) and, with throughput rows, a row of speed panels under it."""
    decode = df[(df["kind"] == "decode") & (df["status"] == "ok")] if "kind" in df.columns else df.iloc[0:0]
    if not len(decode):
        raise ValueError("trained_acceptance: no decode rows to plot")
    fams = list(dict.fromkeys(decode["family"]))
    sets = list(dict.fromkeys(decode["set"]))
    skipped = df[(df["kind"] == "decode") & (df["status"] == "skipped")]
    drafted = decode.loc[decode["drafter"] != "none", "strategy"]
    colors = {s: _COLORS[i % len(_COLORS)] for i, s in enumerate(dict.fromkeys(drafted))}
    speed = df[(df["kind"] == "throughput") & (df["status"] == "ok")] if "kind" in df.columns else df.iloc[0:0]
    plan = []  # (family, "acceptance" | "speed") per row of panels
    for fam in fams:
        plan.append((fam, "acceptance"))
        if len(speed) and (speed["family"] == fam).any():
            plan.append((fam, "speed"))
    fig, axes = plt.subplots(len(plan), len(sets), figsize=(6.5 * len(sets), 5.0 * len(plan)), squeeze=False)
    for row_axes, (fam, what) in zip(axes, plan):
        mine = df[df["family"] == fam]
        d, a = decode[decode["family"] == fam], mine[mine["kind"] == "agreement"]
        for ax, name in zip(row_axes, sets):
            if what == "acceptance" and (d["set"] == name).any():
                _panel(ax, d[d["set"] == name], a[a["set"] == name], f"{fam}, {name}", colors)
            elif what == "speed" and ((speed["family"] == fam) & (speed["set"] == name)).any():
                _speed_panel(ax, speed[(speed["family"] == fam) & (speed["set"] == name)], f"{fam}, {name}")
            else:
                ax.set_axis_off()
    r = decode.iloc[0]
    pairs = "\n".join(_pair_label(decode[decode["family"] == f].iloc[0]) for f in fams)
    sub = f"{pairs}\ntrain run {r['train_run']} {r['train_key']}; greedy"
    if len(skipped):
        sub += "; skipped: " + ", ".join(sorted(set(skipped["set"])))
    fig.suptitle(f"Measured acceptance on small pairs the suite trained (not comparable to large models)\n{sub}\n"
                 f"{provenance(df)}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.06 + 0.02 * len(fams)) / len(plan)))
    fig.savefig(out, dpi=120)
    plt.close(fig)
