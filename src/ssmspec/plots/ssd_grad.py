"""Figure of the SSD scan's forward + backward experiment (bench/ssd_grad.py), drawn from result rows only.

Times are medians with p20-p80 error bars; the speedup is the ``speedup`` column of our rows (mamba_ssm's median
over ours, both from the same run); the backward's own time is fwdbwd - fwd of the same implementation and size.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.kernels import _err, _finish, _need
from ssmspec.plots.ssd import _label, speedup_axis

GOAL = 2.4  # P11: ours at least 2.4x faster than mamba_ssm on forward + backward at 32K tokens (seed 004: 2.42x)
STYLE = {"fwdbwd": "-", "fwd": "--"}


def plot_ssd_fwdbwd(df: pd.DataFrame, out: Path) -> None:
    """Per mixer size and batch: left, ms vs seqlen (log-log), forward + backward (solid) and forward alone (dashed)
    for ours and mamba_ssm; right, the forward + backward speedup over mamba_ssm with the 2.4x goal, the
    gradient agreement with mamba_ssm written at each point where it was measured."""
    data = _need(df, "ssd_kernel_fwdbwd")
    keys = list(dict.fromkeys(zip(data["model"], data["batch"])))
    fig, axes = plt.subplots(len(keys), 2, figsize=(10, 3.4 * len(keys)), squeeze=False)
    for (ax, axr), (model, bsz) in zip(axes, keys):
        m = data[(data["model"] == model) & (data["batch"] == bsz)]
        for (impl, phase), g in m.groupby(["impl", "phase"]):
            g = g.sort_values("seqlen")
            name = impl if impl != "ours" else f"ours ({'/'.join(sorted(set(g['backend'])))})"
            ax.errorbar(g["seqlen"], g["ms_p50"], yerr=_err(g), marker="o", capsize=2, ls=STYLE[phase],
                        label=f"{name}, {'forward + backward' if phase == 'fwdbwd' else 'forward'}")
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="sequence length", ylabel="ms per call", title=_label(model, m))
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ours = m[(m["impl"] == "ours") & (m["phase"] == "fwdbwd")].sort_values("seqlen")
        sp = ours.dropna(subset=["speedup"]) if "speedup" in ours.columns else ours.iloc[:0]
        if len(sp):
            axr.plot(sp["seqlen"], sp["speedup"], marker="o", label="mamba_ssm time / ours (forward + backward)")
            for _, r in sp.iterrows():
                note = f"{r['speedup']:.2f}x"
                if pd.notna(r.get("grad_rel_err")):
                    note += f"\ngrad rel err {r['grad_rel_err']:.1e}"
                axr.annotate(note, (r["seqlen"], r["speedup"]), fontsize=6, textcoords="offset points",
                             xytext=(3, 3))
        speedup_axis(axr, bool(len(sp)), GOAL, f"{model}: forward + backward")
    _finish(fig, data, "SSD scan forward + backward: tile-parallel backward vs mamba_chunk_scan_combined (seed 004)",
            out)
