"""Figures of the kernel experiments, drawn from result rows only (bench/kernels.py, bench/kernels_replay.py).

Times are medians with p20-p80 error bars; speedups are ratios of medians measured in the same run.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance


def _err(g: pd.DataFrame):
    return [(g["ms_p50"] - g["ms_p20"]).clip(lower=0), (g["ms_p80"] - g["ms_p50"]).clip(lower=0)]


def _finish(fig, df: pd.DataFrame, title: str, out: Path) -> None:
    fig.suptitle(f"{title}\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _need(df: pd.DataFrame, what: str) -> pd.DataFrame:
    data = ok_rows(df)
    if data.empty:
        raise ValueError(f"{what}: no measured rows to plot")
    return data


def _base_ms(data: pd.DataFrame, **keys) -> tuple[float | None, str]:
    """Median of the standard-decode unit: mamba_ssm's (Mamba-2) or fla's (GDN rows) single-token kernel,
    ours where it is missing."""
    for impl, label in (("ssu_mamba_ssm", "mamba_ssm"), ("ssu_fla", "fla"), ("ssu_ours", "ours")):
        g = data[data["impl"] == impl]
        for k, v in keys.items():
            g = g[g[k] == v]
        if len(g):
            return float(g["ms_p50"].iloc[0]), label
    return None, ""


def plot_kernel_parity(df: pd.DataFrame, out: Path) -> None:
    """Left: ms per call vs batch (ours, mamba_ssm). Right: speedup mamba_ssm / ours with the 0.95 goal."""
    data = _need(df, "kernel_parity")
    main = data[data["impl"].isin(["ours", "mamba_ssm"])]
    models = list(dict.fromkeys(main["model"]))
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for (ax, axr), model in zip(axes, models):
        m = main[main["model"] == model]
        for impl, g in m.groupby("impl"):
            g = g.sort_values("batch")
            ax.errorbar(g["batch"], g["ms_p50"] * 1e3, yerr=[e * 1e3 for e in _err(g)], marker="o", capsize=2,
                        label=impl)
            for _, r in g.iterrows():
                if r.get("hbm_fraction") is not None and pd.notna(r.get("hbm_fraction")):
                    ax.annotate(f"{r['hbm_fraction']:.0%}", (r["batch"], r["ms_p50"] * 1e3), fontsize=6,
                                textcoords="offset points", xytext=(3, 3))
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="us per call (HBM fraction)", title=model)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        piv = m.pivot_table(index="batch", columns="impl", values="ms_p50")
        if {"ours", "mamba_ssm"} <= set(piv.columns):
            axr.plot(piv.index, piv["mamba_ssm"] / piv["ours"], marker="o", label="mamba_ssm time / ours")
        axr.axhline(0.95, color="r", ls="--", lw=1, label="goal 0.95")
        axr.set(xscale="log", xlabel="batch", ylabel="speed relative to mamba_ssm", title=f"{model}: parity")
        axr.legend(fontsize=7)
        axr.grid(True, alpha=0.3)
    _finish(fig, data, "Single-token state update: ours vs mamba_ssm", out)


def plot_snl_tab1(df: pd.DataFrame, out: Path) -> None:
    """One panel per (model, batch): ms vs L per implementation (log scale)."""
    data = _need(df, "snl_tab1_kernels")
    keys = list(dict.fromkeys(zip(data["model"], data["batch"])))
    cols = len({b for _, b in keys})
    models = list(dict.fromkeys(data["model"]))
    fig, axes = plt.subplots(len(models), cols, figsize=(3.2 * cols, 3.0 * len(models)), squeeze=False)
    batches = sorted({b for _, b in keys})
    for i, model in enumerate(models):
        for j, bsz in enumerate(batches):
            ax = axes[i][j]
            g0 = data[(data["model"] == model) & (data["batch"] == bsz)]
            for impl, g in g0.groupby("impl"):
                g = g.sort_values("L")
                ax.errorbar(g["L"], g["ms_p50"], yerr=_err(g), marker="o", capsize=2, label=impl)
            ax.set(yscale="log", xlabel="L tokens", ylabel="ms", title=f"{model}, batch {bsz}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    _finish(fig, data, "Multi-token SSM update (seed 001, Table 1)", out)


def plot_replay_buffer(df: pd.DataFrame, out: Path) -> None:
    """Left: us per decode step vs R (replay) with the single-token kernels as lines. Right: measured
    speedup over mamba_ssm's kernel vs the byte bound per R."""
    data = _need(df, "replay_fig7_buffer")
    models = list(dict.fromkeys(data["model"]))
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for (ax, axr), model in zip(axes, models):
        m = data[data["model"] == model]
        rep = m[m["impl"] == "replay"].sort_values("R")
        ax.errorbar(rep["R"], rep["ms_p50"] * 1e3, yerr=[e * 1e3 for e in _err(rep)], marker="o", capsize=2,
                    label="replay (output-only)")
        fused = m[m["impl"] == "replay-fused"].sort_values("R")
        if len(fused):  # GDN: the one-token call through the fused multi-token launches
            ax.plot(fused["R"], fused["ms_p50"] * 1e3, marker="x", ls="--", lw=1, label="replay, fused form")
        for impl, ls in (("ssu_mamba_ssm", "--"), ("ssu_fla", "-."), ("ssu_ours", ":")):
            g = m[m["impl"] == impl]
            if len(g):
                ax.axhline(g["ms_p50"].iloc[0] * 1e3, ls=ls, color="k", lw=1, label=impl)
        ax.set(xscale="log", xlabel="buffer size R", ylabel="us per step", title=f"{model}, batch {m['batch'].iloc[0]}")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        base, label = _base_ms(m)
        if base is not None:
            axr.plot(rep["R"], base / rep["ms_p50"], marker="o", label=f"measured (vs {label})")
            if len(fused):
                axr.plot(fused["R"], base / fused["ms_p50"], marker="x", ls="--", lw=1, label="fused form")
        axr.plot(rep["R"], rep["bound_speedup"], marker="s", ls="--", label="byte bound")
        goal = 1.7 if "family" in m.columns and (m["family"] == "gdn").any() else 1.8  # GDN: issue 11, P9
        axr.axhline(goal, color="r", lw=1, ls=":", label=f"goal {goal}x")
        axr.set_xscale("log", base=2)
        axr.set(xlabel="buffer size R", ylabel="speedup over single-token kernel", title=f"{model}: speedup")
        axr.legend(fontsize=7)
        axr.grid(True, which="both", alpha=0.3)
    _finish(fig, data, "ReplaySSM output-only decode vs buffer size (seed 000, Fig. 7)", out)


def plot_replay_speedup(df: pd.DataFrame, out: Path) -> None:
    """Bars: kernel speedup of replay decode over the library's (mamba_ssm / fla for GDN rows) and our
    single-token kernel, per model and R."""
    data = _need(df, "replay_fig6_speedup")
    rows = []
    for model, m in data.groupby("model", sort=False):
        for _, r in m[m["impl"] == "replay"].iterrows():
            for impl in ("ssu_mamba_ssm", "ssu_fla", "ssu_ours"):
                g = m[m["impl"] == impl]
                if len(g):
                    rows.append(dict(model=model, R=r["R"], over="ssu_ours" if impl == "ssu_ours" else "library",
                                     speedup=g["ms_p50"].iloc[0] / r["ms_p50"], bound=r["bound_speedup"]))
    sp = pd.DataFrame(rows)
    if sp.empty:
        raise ValueError("replay_fig6_speedup: no replay/baseline pairs to plot")
    steps = data[data["impl"].isin(["step_autoregressive", "step_replay"])]
    if len(steps):
        fig, (ax, axs) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [2, 1]})
        _step_speedup(axs, steps)
    else:
        fig, ax = plt.subplots(figsize=(8, 3.6))
    keys = list(dict.fromkeys(zip(sp["model"], sp["R"])))
    pos = {key: i for i, key in enumerate(keys)}  # a bar sits at its (model, R) even where a baseline is missing
    labels = [f"{m}\nR={int(R)}" for m, R in keys]
    width = 0.27
    for k, (over, label) in enumerate((("library", "mamba_ssm / fla"), ("ssu_ours", "ssu_ours"))):
        s = sp[sp["over"] == over]
        ax.bar([pos[key] + (k - 1) * width for key in zip(s["model"], s["R"])], s["speedup"], width,
               label=f"over {label}")
    b = sp.drop_duplicates(["model", "R"])
    ax.bar([pos[key] + width for key in zip(b["model"], b["R"])], b["bound"], width, label="byte bound", alpha=0.5)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("SSM kernel speedup")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    _finish(fig, data, "ReplaySSM standard decode: kernel and whole-step speedup (seed 000, Fig. 6)", out)


def _step_speedup(ax, steps: pd.DataFrame) -> None:
    """Whole engine step: autoregressive ms / replay ms per model, with the P5 goal and the paper's range."""
    names, vals = [], []
    for model, m in steps.groupby("model", sort=False):
        ar, rep = m[m["impl"] == "step_autoregressive"], m[m["impl"] == "step_replay"]
        if len(ar) and len(rep):
            names.append(f"{model}\nR={int(rep['R'].iloc[0])}, batch {int(rep['batch'].iloc[0])}")
            vals.append(ar["ms_p50"].iloc[0] / rep["ms_p50"].iloc[0])
    bars = ax.bar(range(len(vals)), vals, color="C2")
    ax.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax.axhspan(1.20, 1.48, color="k", alpha=0.1, label="paper 1.20-1.48x")
    ax.axhline(1.45, color="r", lw=1, ls=":", label="goal P5 1.45x")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("whole-step speedup")
    ax.set_title("engine step, replay over autoregressive", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def plot_verify_cost(df: pd.DataFrame, out: Path) -> None:
    """Cost of one verify step relative to the standard decode kernel vs S: snapshot, and replay per R as a
    band over accepted counts (line: the mean over accepted counts)."""
    data = _need(df, "replay_fig9_verify_cost")
    models = list(dict.fromkeys(data["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        m = data[data["model"] == model]
        base, label = _base_ms(m)
        if base is None:
            raise ValueError("replay_fig9_verify_cost: no standard decode rows (ssu_*) to normalize by")
        for impl, color in (("snapshot", "C3"), ("fla_recurrent", "C5"), ("fla_chunk", "C6")):  # fla: GDN rows
            g = m[m["impl"] == impl].sort_values("S")
            if len(g):
                ax.plot(g["S"], g["ms_p50"] / base, marker="o", color=color, label=impl)
        rep = m[m["impl"] == "replay"]
        for k, (R, g) in enumerate(rep.groupby("R")):
            rel = g.assign(rel=g["ms_p50"] / base).groupby("S")["rel"]
            lo, hi, mean = rel.min(), rel.max(), rel.mean()
            ax.fill_between(lo.index, lo.values, hi.values, alpha=0.2, color=f"C{k}")
            ax.plot(mean.index, mean.values, marker="s", color=f"C{k}", label=f"replay R={int(R)} (band: accepted 0..S)")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        if "family" in m.columns and (m["family"] == "gdn").any():  # issue 11, P9: replay at S = 6 <= 1.2x
            ax.axhline(1.2, color="r", lw=1, ls=":", label="goal 1.2x at S = 6")
        ax.set(xlabel="S drafts", ylabel=f"cost / standard decode ({label})", title=f"{model}, batch {m['batch'].iloc[0]}")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    _finish(fig, data, "Verify kernel cost relative to standard decode (seed 000, Fig. 9)", out)
