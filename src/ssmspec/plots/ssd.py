"""Figures of the SSD prefill scan experiments (bench/ssd.py), drawn from result rows only.

Times are medians with p20-p80 error bars; a speedup is mamba_ssm's median over ours, both from the same run.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.kernels import _err, _finish, _need

GOAL = 1.6  # P10: ours at least 1.6x faster than mamba_ssm at 32K tokens


def _label(model: str, m: pd.DataFrame) -> str:
    r = m.iloc[0]
    return f"{model} (H={r['H']}, P={r['P']}, N={r['N']}, G={r['G']}), batch {r['batch']}"


def speedup_axis(axr, has_peer: bool, goal: float, title: str) -> None:
    """The frame of a speedup-over-mamba_ssm panel (log2 sequence length): a note when the run has no mamba_ssm
    rows, the goal at 32K, parity, labels, legend and grid."""
    if not has_peer:
        axr.text(0.5, 0.5, "no mamba_ssm rows in this run", ha="center", va="center", transform=axr.transAxes)
    axr.axhline(goal, color="r", ls="--", lw=1, label=f"goal {goal}x at 32K")
    axr.axhline(1.0, color="k", lw=0.8)
    axr.set_xscale("log", base=2)
    axr.set(xlabel="sequence length", ylabel="speedup over mamba_ssm", title=title)
    axr.legend(fontsize=7)
    axr.grid(True, which="both", alpha=0.3)


def plot_ssd_fwd(df: pd.DataFrame, out: Path) -> None:
    """Per mixer size and batch: left, ms vs seqlen (log-log) for ours and mamba_ssm with the HBM fraction at
    each point; right, the speedup mamba_ssm / ours vs seqlen with the 1.6x goal."""
    data = _need(df, "ssd_kernel_fwd")
    keys = list(dict.fromkeys(zip(data["model"], data["batch"])))
    fig, axes = plt.subplots(len(keys), 2, figsize=(10, 3.4 * len(keys)), squeeze=False)
    for (ax, axr), (model, bsz) in zip(axes, keys):
        m = data[(data["model"] == model) & (data["batch"] == bsz)]
        for impl, g in m.groupby("impl"):
            g = g.sort_values("seqlen")
            label = impl if impl != "ours" else f"ours ({'/'.join(sorted(set(g['backend'])))})"
            ax.errorbar(g["seqlen"], g["ms_p50"], yerr=_err(g), marker="o", capsize=2, label=label)
            for _, r in g.iterrows():
                if pd.notna(r.get("hbm_fraction")):
                    ax.annotate(f"{r['hbm_fraction']:.0%}", (r["seqlen"], r["ms_p50"]), fontsize=6,
                                textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="sequence length", ylabel="ms per scan (HBM fraction)", title=_label(model, m))
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        piv = m.pivot_table(index="seqlen", columns="impl", values="ms_p50")
        has_peer = {"ours", "mamba_ssm"} <= set(piv.columns)
        if has_peer:
            sp = (piv["mamba_ssm"] / piv["ours"]).dropna()
            axr.plot(sp.index, sp.values, marker="o", label="mamba_ssm time / ours")
            for L, v in sp.items():
                axr.annotate(f"{v:.2f}x", (L, v), fontsize=6, textcoords="offset points", xytext=(3, 3))
        speedup_axis(axr, has_peer, GOAL, f"{model}: speedup")
    _finish(fig, data, "SSD prefill scan: one Triton kernel vs mamba_chunk_scan_combined (seed 004)", out)


def plot_ssd_blockt(df: pd.DataFrame, out: Path) -> None:
    """One panel per (mixer, batch, seqlen): ms vs BLOCK_T, a line per (num_warps, BLOCK_P), mamba_ssm as a
    dashed line; block sizes that did not fit are marked on the x axis. A sweep over segment lengths puts the
    segments a chain is cut into on the x axis instead, a line per (BLOCK_T, num_warps, BLOCK_P)."""
    data = _need(df, "ssd_kernel_blockt")
    keys = list(dict.fromkeys(zip(data["model"], data["batch"], data["seqlen"])))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    failed = df[df["status"] == "failed"] if "status" in df.columns else df.iloc[:0]
    for ax, (model, bsz, L) in zip(axes[0], keys):
        m = data[(data["model"] == model) & (data["batch"] == bsz) & (data["seqlen"] == L)]
        ours = m[m["impl"] == "ours"]
        by_seg = "segments" in ours.columns and ours["segments"].nunique() > 1
        xcol, group = ("segments", ["block_t", "num_warps", "block_p"]) if by_seg else ("block_t", ["num_warps", "block_p"])
        for key, g in ours.groupby(group):
            g = g.sort_values(xcol)
            name = ", ".join(f"{k}={int(v)}" for k, v in zip(group, key))
            ax.errorbar(g[xcol], g["ms_p50"], yerr=_err(g), marker="o", capsize=2, label=f"ours, {name}")
        base = m[m["impl"] == "mamba_ssm"]
        if len(base):
            ax.axhline(base["ms_p50"].iloc[0], color="k", ls="--", lw=1, label="mamba_ssm")
        f = failed[(failed["model"] == model) & (failed["batch"] == bsz) & (failed["seqlen"] == L)]
        f = f[f["impl"] == "ours"] if len(f) else f
        for bt in sorted(set(f["block_t"])) if len(f) and not by_seg else []:
            ax.axvline(bt, color="r", ls=":", lw=1)
            ax.annotate("does not fit", (bt, 0.02), xycoords=("data", "axes fraction"), fontsize=6, color="r",
                        rotation=90)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="segments per chain (programs per sequence, head and P block)" if by_seg
               else "BLOCK_T (tokens per tile)", ylabel="ms per scan", title=f"L={L}: {_label(model, m)}")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=6)
        ax.grid(True, which="both", alpha=0.3)
    _finish(fig, data, "SSD prefill scan: block-size sweep (seed 004)", out)
