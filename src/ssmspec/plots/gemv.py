"""Figure of ``decode_kernels`` (bench/gemv.py), drawn from result rows only.

Per model: left, the fraction of the same run's copy bandwidth each projection reaches vs M (ours and cuBLAS,
the 0.9 goal); middle, speedups vs M, ours over cuBLAS and the fused norm + GEMV over the norm kernel + cuBLAS
(ratios of medians of the same run); right (models with Mamba-2 mixers), microseconds of one mixer's decode conv
+ SSM update vs batch: fused, our two kernels, causal-conv1d + mamba_ssm's two.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.kernels import _finish, _need

GOAL = 0.9  # issue 26: the decode GEMV at >= 90% of copy bandwidth at M = 1..8


def plot_decode_kernels(df: pd.DataFrame, out: Path) -> None:
    data = _need(df, "decode_kernels")
    gemv = data[data["kind"] == "gemv"]
    conv = data[data["kind"] == "conv_ssm"]
    models = list(dict.fromkeys(data["model"]))
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 3.4 * len(models)), squeeze=False)
    for (ax, axr, axc), model in zip(axes, models):
        m = gemv[gemv["model"] == model]
        for (layer, impl), g in m[m["impl"].isin(["ours", "cublas"])].groupby(["layer", "impl"], sort=False):
            g = g.sort_values("M")
            ax.plot(g["M"], g["copy_fraction"], marker="o" if impl == "ours" else "x",
                    ls="-" if impl == "ours" else ":", label=f"{layer} {impl}")
        ax.axhline(GOAL, color="r", ls="--", lw=1, label=f"goal {GOAL}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="rows M", ylabel="fraction of copy bandwidth", title=model, ylim=(0, 1.1))
        ax.legend(fontsize=6, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
        for (layer, impl), g in m[m["impl"].isin(["ours", "fused"])].groupby(["layer", "impl"], sort=False):
            g = g.dropna(subset=["speedup"]).sort_values("M")
            label = f"{layer}: ours / cuBLAS" if impl == "ours" else f"{layer}: fused / norm + cuBLAS"
            axr.plot(g["M"], g["speedup"], marker="o" if impl == "ours" else "s", label=label)
        axr.axhline(1.0, color="k", lw=0.8)
        axr.set_xscale("log", base=2)
        axr.set(xlabel="rows M", ylabel="speedup (same run)", title=f"{model}: speedups")
        axr.legend(fontsize=6)
        axr.grid(True, which="both", alpha=0.3)
        c = conv[conv["model"] == model]
        for impl, g in c.groupby("impl", sort=False):
            g = g.sort_values("batch")
            axc.plot(g["batch"], g["ms_p50"] * 1e3, marker="o", label=impl)
        axc.set_xscale("log", base=2)
        axc.set_yscale("log")
        axc.set(xlabel="batch", ylabel="us per mixer step",
                title=f"{model}: conv + SSM update" if len(c) else f"{model}: no conv + SSM rows")
        if len(c):
            axc.legend(fontsize=6)
        axc.grid(True, which="both", alpha=0.3)
    _finish(fig, data, "Decode kernels (ops/gemv, ops/conv_ssm_update): bandwidth and speedups", out)
