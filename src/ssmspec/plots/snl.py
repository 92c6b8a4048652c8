"""Figures of the Snakes and Ladders step-time experiments (bench/steps_snl.py), drawn from result rows only.

Times are medians of engine steps with p20-p80 error bars; ``overhead`` is a row's median over the
autoregressive median of the same model measured in the same run. Memory is the allocator's peak (weights
included) where the run measured it (CUDA), else weights + the strategy's cache bytes.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance

COLORS = {"autoregressive": "0.4", "activation_replay": "tab:blue", "joint_attainment": "tab:orange"}
LABELS = {"autoregressive": "autoregressive", "activation_replay": "ARP", "joint_attainment": "joint"}


def _rows(df: pd.DataFrame, exp_id: str) -> pd.DataFrame:
    data = ok_rows(df)
    if data.empty:
        raise ValueError(f"{exp_id}: no measured rows to plot")
    return data


def _err(s: pd.DataFrame) -> list:
    return [(s["ms_p50"] - s["ms_p20"]).clip(lower=0), (s["ms_p80"] - s["ms_p50"]).clip(lower=0)]


def memory_gib(df: pd.DataFrame) -> tuple[pd.Series, str]:
    """(GiB per row, label): the allocator peak when every row has one, else weights + cache bytes."""
    if "peak_allocated_bytes" in df.columns and df["peak_allocated_bytes"].notna().all():
        return df["peak_allocated_bytes"] / 2 ** 30, "peak allocated (GiB)"
    return (df["weights_bytes"] + df["cache_bytes"]) / 2 ** 30, "weights + cache bytes (GiB)"


def plot_snl_tab2(df: pd.DataFrame, out: Path) -> None:
    """Per model: ms per joint-attainment step for every (scan, copy) variant, the autoregressive step as a
    line, each bar labelled with its overhead over autoregressive."""
    data = _rows(df, "snl_tab2_ablation")
    models = list(dict.fromkeys(data["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(8 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        g = data[data["model"] == model]
        ar = g[g["strategy"] == "autoregressive"]
        ja = g[g["strategy"] == "joint_attainment"].sort_values("ms_p50", ascending=False)
        xs = range(len(ja))
        bars = ax.bar(xs, ja["ms_p50"], yerr=_err(ja), capsize=3,
                      color=["tab:orange" if j else "tab:red" for j in ja["jit_copy"]])
        for bar, ov in zip(bars, ja["overhead"]):
            ax.annotate(f"{ov:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=7)
        labels = [v + (f"\n(paper: {p})" if isinstance(p, str) else "") for v, p in zip(ja["variant"], ja["paper_row"])]
        ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=7)
        if not ar.empty:
            ax.axhline(float(ar["ms_p50"].iloc[0]), color="0.4", ls="--", lw=1, label="autoregressive step")
        ax.set(ylabel="ms per decode step", title=f"{model}: {int(ja['num_drafts'].iloc[0])} drafts x "
               f"S = {int(ja['draft_len'].iloc[0])} (red: eager copy, orange: JIT copy)")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Snakes and Ladders Table 2: joint attainment ablation\n{provenance(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_snl_tab3(df: pd.DataFrame, out: Path) -> None:
    """Per model and draft count: ms per step vs S for ARP and joint with the autoregressive step as a line
    (top row), and the overhead over autoregressive (bottom row)."""
    data = _rows(df, "snl_tab3_verify")
    models = list(dict.fromkeys(data["model"]))
    spec = data[data["strategy"] != "autoregressive"]
    drafts = sorted(int(d) for d in spec["num_drafts"].unique())
    fig, axes = plt.subplots(2 * len(models), len(drafts), figsize=(3.6 * len(drafts), 6.4 * len(models)),
                             squeeze=False)
    for m, model in enumerate(models):
        g = data[data["model"] == model]
        ar = g[g["strategy"] == "autoregressive"]
        for j, d in enumerate(drafts):
            ax_t, ax_r = axes[2 * m, j], axes[2 * m + 1, j]
            for name, s in g[(g["strategy"] != "autoregressive") & (g["num_drafts"] == d)].groupby("strategy"):
                s = s.sort_values("draft_len")
                kw = dict(marker="o", color=COLORS.get(name), label=LABELS.get(name, name))
                ax_t.errorbar(s["draft_len"], s["ms_p50"], yerr=_err(s), capsize=2, **kw)
                ax_r.plot(s["draft_len"], s["overhead"], **kw)
            if not ar.empty:
                ax_t.axhline(float(ar["ms_p50"].iloc[0]), color="0.4", ls="--", lw=1, label="autoregressive")
            ax_r.axhline(1.0, color="0.4", ls="--", lw=1)
            ax_t.set(xlabel="S (draft tokens per chain)", ylabel="ms per decode step", title=f"{model}, {d} draft(s)")
            ax_r.set(xlabel="S (draft tokens per chain)", ylabel="step time / autoregressive step")
            for ax in (ax_t, ax_r):
                ax.legend(fontsize=7)
                ax.grid(True, alpha=0.3)
    fig.suptitle(f"Snakes and Ladders Table 3: speculative step time vs drafts x S\n{provenance(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_snl_tab4(df: pd.DataFrame, out: Path) -> None:
    """Against model size (parameters): ms per step, overhead over autoregressive, and memory, per strategy."""
    data = _rows(df, "snl_tab4_scaling").copy()
    data["gib"], mem_label = memory_gib(data)
    data["bparams"] = data["params"] / 1e9
    fig, (ax_t, ax_r, ax_m) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, s in data.groupby("strategy", sort=False):
        s = s.sort_values("params")
        kw = dict(marker="o", color=COLORS.get(name), label=LABELS.get(name, name))
        ax_t.errorbar(s["bparams"], s["ms_p50"], yerr=_err(s), capsize=2, **kw)
        ax_r.plot(s["bparams"], s["overhead"], **kw)
        ax_m.plot(s["bparams"], s["gib"], **kw)
    spec = data[data["strategy"] != "autoregressive"]
    what = (f"{int(spec['num_drafts'].iloc[0])} draft(s) x S = {int(spec['draft_len'].iloc[0])}"
            if not spec.empty else "")
    ax_t.set(ylabel="ms per decode step", title=f"step time, {what}")
    ax_r.axhline(1.0, color="0.4", ls="--", lw=1)
    ax_r.set(ylabel="step time / autoregressive step", title="overhead of speculation")
    ax_m.set(ylabel=mem_label, title="memory")
    sizes = data.drop_duplicates("model").sort_values("params")  # one tick per model, at its size
    for ax in (ax_t, ax_r, ax_m):
        ax.set(xscale="log", xlabel="parameters (billions, log scale)")
        ax.set_xticks(list(sizes["bparams"]), [f"{m}\n{b:.3g}" for m, b in zip(sizes["model"], sizes["bparams"])],
                      fontsize=7)
        ax.minorticks_off()
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"Snakes and Ladders Table 4: step time and memory vs model size\n{provenance(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
