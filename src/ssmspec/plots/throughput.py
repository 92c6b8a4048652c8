"""Figure of ``throughput_ar``: prefill and decode tokens/s of the autoregressive loop, one row of
panels per model. Left: prefill tokens/s against context length, one line per batch size. Right:
decode tokens/s against batch size, one line per context length, and transformers' generate() on the same
architecture (crosses) where the run measured it."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def _panel(ax, df: pd.DataFrame, x: str, line: str, label: str) -> None:
    for value, g in df.groupby(line):
        g = g.sort_values(x)
        ax.plot(g[x], g["tokens_per_s"], marker="o", label=f"{label}={value}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_throughput(df: pd.DataFrame, out: Path) -> None:
    """Draw the PNG at ``out`` from the rows of one throughput_ar run."""
    data = ok_rows(df)
    models = list(dict.fromkeys(data.sort_values("params")["model"])) if len(data) else []
    if not models:
        raise ValueError("throughput_ar: no measured rows to plot")
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for i, name in enumerate(models):
        m = data[data["model"] == name]
        impl = m["impl"] if "impl" in m else pd.Series("ssmspec", index=m.index)
        hf = m[impl == "transformers"]
        m = m[impl != "transformers"]
        pre, dec = m[m["phase"] == "prefill"], m[m["phase"] == "decode"]
        ax_p, ax_d = axes[i]
        if len(pre):
            _panel(ax_p, pre, "context", "batch", "B")
        if len(dec):
            _panel(ax_d, dec, "batch", "context", "T")
        for T, g in hf.groupby("context"):  # transformers' generate() on the same weights: the user's alternative
            ax_d.plot(g["batch"], g["tokens_per_s"], "kx", markersize=8, label=f"transformers generate(), T={T}")
            ax_d.legend(fontsize=7)
        ax_p.set_title(f"{name} ({_count(m['params'].iloc[0])} params) — prefill", fontsize=9)
        ax_d.set_title(f"{name} — decode (1 token / sequence / step)", fontsize=9)
        ax_p.set_ylabel("tokens / s")
        ax_p.set_xlabel("context length T (prompt tokens)")
        ax_d.set_xlabel("batch size B")
    fig.suptitle(f"Autoregressive throughput\n{provenance(data)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
