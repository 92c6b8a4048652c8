"""Figures of the STree experiments (bench/tree.py), drawn from result rows only.

Times are medians with p20-p80 error bars; ratios are of medians measured in the same run. Memory is the
allocator peak per call where the run measured it (CUDA), else the bytes of the tensors each form allocates.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance

GOAL_SPEEDUP, GOAL_MEMORY = 2.0, 0.5  # P8 at depth 6: packed vs unrolled


def memory_column(df: pd.DataFrame) -> tuple[str, str]:
    """('peak_bytes', label) when every measured row has an allocator peak, else ('alloc_bytes', label)."""
    if "peak_bytes" in df.columns and df["peak_bytes"].notna().all():
        return "peak_bytes", "peak allocated per call (MiB)"
    return "alloc_bytes", "bytes of the tensors a call allocates (MiB)"


def plot_stree_fig3(df: pd.DataFrame, out: Path) -> None:
    """Per model and batch: ms per forward vs tree depth, memory vs depth, and the packed-vs-unrolled ratios
    (unrolled time / packed time, packed memory / unrolled memory) with the P8 goal lines."""
    data = ok_rows(df)
    if data.empty:
        raise ValueError("stree_fig3_tree_forward: no measured rows to plot")
    mem, mem_label = memory_column(data)
    keys = list(dict.fromkeys(zip(data["model"], data["batch"])))
    fig, axes = plt.subplots(len(keys), 3, figsize=(14, 3.4 * len(keys)), squeeze=False)
    for (ax_t, ax_m, ax_r), (model, bsz) in zip(axes, keys):
        g = data[(data["model"] == model) & (data["batch"] == bsz)]
        for impl, s in g.groupby("impl", sort=False):
            s = s.sort_values("depth")
            err = [(s["ms_p50"] - s["ms_p20"]).clip(lower=0), (s["ms_p80"] - s["ms_p50"]).clip(lower=0)]
            ax_t.errorbar(s["depth"], s["ms_p50"], yerr=err, marker="o", capsize=2, label=impl)
            ax_m.plot(s["depth"], s[mem] / 2 ** 20, marker="o", label=impl)
        ax_t.set(yscale="log", xlabel="tree depth (levels)", ylabel="ms per tree forward", title=f"{model}, batch {bsz}")
        ax_m.set(yscale="log", xlabel="tree depth (levels)", ylabel=mem_label, title="memory")
        t = g.pivot_table(index="depth", columns="impl", values="ms_p50")
        m = g.pivot_table(index="depth", columns="impl", values=mem)
        if {"packed", "unrolled"} <= set(t.columns):
            ax_r.plot(t.index, t["unrolled"] / t["packed"], marker="o", label="unrolled time / packed time")
            ax_r.plot(m.index, m["packed"] / m["unrolled"], marker="s", label="packed memory / unrolled memory")
        ax_r.axhline(GOAL_SPEEDUP, color="r", ls="--", lw=1, label=f"goal: >= {GOAL_SPEEDUP:g}x faster")
        ax_r.axhline(GOAL_MEMORY, color="m", ls=":", lw=1, label=f"goal: <= {GOAL_MEMORY:g}x memory")
        ax_r.set(yscale="log", xlabel="tree depth (levels)", ylabel="ratio", title="packed vs unrolled (P8)")
        for ax in (ax_t, ax_m, ax_r):
            ax.set_xticks(sorted(g["depth"].unique()))
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"STree Fig. 3: full binary tree forward, packed vs unrolled\n{provenance(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


PAPER_TAB1 = {"stree": [2.04, 1.47, 1.37, 1.26], "vanilla_sd": [1.37, 1.15, 1.13, 1.06]}  # 2.3B, 7B, 13B, 23B
PAPER_TAB1_PARAMS = [2.3e9, 7e9, 13e9, 23e9]


def plot_stree_sizes(df: pd.DataFrame, out: Path) -> None:
    """STree Table 1: left, ms per model call vs parameters per line; right, overhead over autoregressive vs
    parameters, with the paper's numbers (RTX 3090) as open markers. Skipped sizes are named in the title."""
    rows = ok_rows(df)
    skipped = sorted(set(df.loc[df["status"] != "ok", "model"])) if "status" in df.columns else []
    fig, (ax, axr) = plt.subplots(1, 2, figsize=(11, 4))
    for k, (line, g) in enumerate(rows.groupby("line", sort=False)):
        g = g.sort_values("params")
        tokens = int(g["tokens"].iloc[0])
        ax.errorbar(g["params"], g["ms_p50"], yerr=[g["ms_p50"] - g["ms_p20"], g["ms_p80"] - g["ms_p50"]],
                    marker="o", color=f"C{k}", capsize=2, label=f"{line} ({tokens} tokens)")
        if line != "autoregressive":
            axr.plot(g["params"], g["overhead"], marker="o", color=f"C{k}", label=f"{line} (measured)")
            for x, y, m in zip(g["params"], g["overhead"], g["model"]):
                axr.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if line in PAPER_TAB1:
                axr.plot(PAPER_TAB1_PARAMS, PAPER_TAB1[line], marker="s", mfc="none", ls=":", color=f"C{k}",
                         label=f"{line} (paper, RTX 3090)")
    for a in (ax, axr):
        a.set_xscale("log")
        a.set_xlabel("parameters")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    ax.set(ylabel="ms per model call (batch 1)", title="latency per model call")
    axr.axhline(1.0, color="k", lw=0.8)
    axr.set(ylabel="time / autoregressive time", title="overhead over autoregressive")
    note = f" (skipped, does not fit: {', '.join(skipped)})" if skipped else ""
    fig.suptitle(f"STree Table 1: model-call latency vs model size{note}\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_stree_unrolled(df: pd.DataFrame, out: Path) -> None:
    """STree Table 2: per N, tokens/s (left) and memory (right) vs beams M, packed vs unrolled; the packed /
    unrolled speed ratio and memory ratio are annotated. Memory: the allocator peak on CUDA, else the plan."""
    rows = ok_rows(df)
    trees = rows[rows["form"].isin(["packed", "unrolled"])] if "form" in rows.columns else rows.iloc[0:0]
    mem = "peak_bytes" if "peak_bytes" in trees.columns and trees["peak_bytes"].notna().all() else "planned_bytes"
    fig, (ax, axm) = plt.subplots(1, 2, figsize=(11, 4))
    ar = rows[rows["line"] == "autoregressive"]
    for k, (N, g) in enumerate(trees.groupby("steps")):
        for form, ls in (("packed", "-"), ("unrolled", "--")):
            f = g[g["form"] == form].sort_values("beams")
            ax.plot(f["beams"], f["tokens_per_s"], marker="o", ls=ls, color=f"C{k}", label=f"{form}, N={int(N)}")
            axm.plot(f["beams"], f[mem] / 2**20, marker="o", ls=ls, color=f"C{k}", label=f"{form}, N={int(N)}")
        p, u = (g[g["form"] == x].set_index("beams") for x in ("packed", "unrolled"))
        for M in p.index.intersection(u.index):
            ax.annotate(f"{p.loc[M, 'tokens_per_s'] / u.loc[M, 'tokens_per_s']:.2f}x", (M, p.loc[M, "tokens_per_s"]),
                        textcoords="offset points", xytext=(3, 4), fontsize=7, color=f"C{k}")
            axm.annotate(f"{p.loc[M, mem] / u.loc[M, mem]:.2f}x", (M, p.loc[M, mem] / 2**20),
                         textcoords="offset points", xytext=(3, -10), fontsize=7, color=f"C{k}")
    if len(ar):
        ax.axhline(float(ar["tokens_per_s"].median()), color="gray", lw=0.8, label="autoregressive")
    skipped = df[df["status"] != "ok"] if "status" in df.columns else df.iloc[0:0]
    ax.set(xlabel="beams M", ylabel="tokens / s", title="speed (packed / unrolled annotated)")
    axm.set(xlabel="beams M", ylabel=f"{'peak allocated' if mem == 'peak_bytes' else 'planned'} MiB beside weights",
            title="memory (packed / unrolled annotated)")
    axm.set_yscale("log")
    for a in (ax, axm):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    note = f"; {len(skipped)} point(s) skipped or out of memory" if len(skipped) else ""
    acc = trees.iloc[0] if len(trees) else None
    stated = f"forced oracle per branch, alpha {acc['alpha']}, rank decay {acc['rank_decay']}" if acc is not None else ""
    fig.suptitle(f"STree Table 2: beam trees, packed vs unrolled ({stated}{note})\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
