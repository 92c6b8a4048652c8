"""Figures of STree measured on the trained pairs (bench/stree_trained.py): tokens/s and tau (accepted + 1) of
vanilla SD (a chain) and STree (a static tree) against the share of attention layers of the target
(``stree_tab5_hybrid_ratio``) or the draft's distillation steps (``stree_tab6_draft_training``), one line style per
temperature, autoregressive tokens/s for reference; the paper's table in a panel of its own (measured on other
models and hardware: not comparable point for point). Every acceptance drawn here is measured, never designed."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.style import ok_rows, provenance

PAPER = "paper (seed 003, RTX 3090; other models, measured acceptance)"
# Seed 003 Table 5 (Mamba2-Llama3, temperature 1): attention share -> {line: (tokens/s, tau)}
PAPER_TAB5 = {0.5: {"AR": (39.71, 1.0), "SD": (46.56, 1.47), "STree": (49.04, 1.84)},
              0.25: {"AR": (41.65, 1.0), "SD": (47.69, 1.45), "STree": (48.08, 1.77)},
              0.0: {"AR": (43.79, 1.0), "SD": (53.72, 1.57), "STree": (55.32, 2.00)}}
# Seed 003 Table 6 (MambaInLlama-8B): draft distillation steps -> {line: (tokens/s, speedup, tau)}
PAPER_TAB6 = {12000: {"SD": (44.52, 1.21, 1.34), "STree": (42.96, 1.19, 1.51)},
              48000: {"SD": (53.11, 1.24, 1.56), "STree": (58.65, 1.36, 2.02)},
              264000: {"SD": (56.49, 1.42, 1.68), "STree": (64.30, 1.62, 2.23)}}
COLORS = {"AR": "0.5", "SD": "C0", "STree": "C3"}
STYLES = ["-", "--", ":", "-."]  # per temperature, in increasing order


def kind(line: str) -> str:
    """'AR', 'SD' (a chain) or 'STree' (a tree) of a row's ``line``."""
    return "AR" if line == "autoregressive" else "SD" if str(line).startswith("chain") else "STree"


def _data(df: pd.DataFrame, what: str, x: str) -> pd.DataFrame:
    data = ok_rows(df)
    if data.empty or x not in data.columns:
        raise ValueError(f"{what}: no measured rows with {x} to plot (its rows come from bench.trained)")
    data = data[data["batch"] == data["batch"].min()].copy()
    data["kind"] = data["line"].map(kind)
    return data


def _sweep(axes, data: pd.DataFrame, x: str, scale: float) -> None:
    """tokens/s (axes[0]), tau (axes[1]) and speedup over autoregressive (axes[2]) against ``x`` per line kind and
    temperature."""
    temps = sorted(data["temperature"].unique())
    for t, style in zip(temps, STYLES * len(temps)):
        for k in ("AR", "SD", "STree"):
            g = data[(data["temperature"] == t) & (data["kind"] == k)].sort_values(x)
            if g.empty:
                continue
            kw = dict(marker="o", ms=4, color=COLORS[k], label=f"{k}, T = {t:g}")
            axes[0].plot(g[x] * scale, g["tokens_per_s"], style, **kw)
            if k != "AR":
                axes[1].plot(g[x] * scale, g["tau"], style, **kw)
                if "speedup" in g.columns:
                    axes[2].plot(g[x] * scale, g["speedup"], style, **kw)
    axes[2].axhline(1.0, color=COLORS["AR"], lw=0.8)
    for ax, ylabel, title in zip(axes, ("decode tokens / s", "tau (mean accepted + 1)", "speedup over autoregressive"),
                                 ("tokens/s over the engine's step times", "tau, measured: what the trained draft "
                                  "earns", "speedup over autoregressive (same pair, temperature)")):
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)


def _finish(fig, df: pd.DataFrame, title: str, out: Path) -> None:
    shown = df.copy()
    if "train_run" in shown.columns:  # one weights entry per pair would fill the line: name the run and the count
        keys = shown["train_key"].nunique() if "train_key" in shown.columns else 1
        shown["weights"] = f"trained {'/'.join(sorted(set(shown['train_run'].dropna())))} ({keys} pairs)"
    if "set" in shown.columns:  # where the timed tokens come from (bench/tree_prompts.py)
        title += (f" -- {'/'.join(sorted(set(shown['set'])))} prompts, {int(shown['prompts'].max())} x "
                  f"{int(shown['prompt_len'].max())} tokens")
    fig.suptitle(f"{title}\n{provenance(shown)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_hybrid_ratio(df: pd.DataFrame, out: Path) -> None:
    """Table 5: against the share of attention layers of the trained target (%); the paper's speedups and tau."""
    data = _data(df, "stree_tab5_hybrid_ratio", "attention_share")
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    _sweep(axes, data, "attention_share", 100.0)
    for ax in axes[:3]:
        ax.set_xlabel("attention layers of the target (%)")
        ax.set_xticks(sorted(data["attention_share"].unique() * 100.0))
    shares = sorted(PAPER_TAB5)
    for k in ("SD", "STree"):
        ups = [PAPER_TAB5[s][k][0] / PAPER_TAB5[s]["AR"][0] for s in shares]
        axes[3].plot([s * 100 for s in shares], ups, marker="s", color=COLORS[k], label=f"{k} speedup")
        for s, up in zip(shares, ups):
            axes[3].annotate(f"tau {PAPER_TAB5[s][k][1]:.2f}", (s * 100, up), fontsize=6, color=COLORS[k],
                             xytext=(3, 3), textcoords="offset points")
    axes[3].set(xlabel="attention layers of Mamba2-Llama3 (%)", ylabel="speedup over autoregressive")
    axes[3].set_title(f"{PAPER}, temperature 1", fontsize=7)
    axes[3].legend(fontsize=6)
    axes[3].grid(alpha=0.3)
    _finish(fig, df, "STree Table 5, measured on trained pairs: SD chain vs STree tree vs the target's share of "
                     "attention layers", out)


def plot_draft_training(df: pd.DataFrame, out: Path) -> None:
    """Table 6: against the draft's distillation steps (log axis); the paper's speedups and tau."""
    data = _data(df, "stree_tab6_draft_training", "draft_steps")
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    _sweep(axes, data, "draft_steps", 1.0)
    steps = sorted(data["draft_steps"].unique())
    for ax in axes[:3]:
        ax.set_xscale("log")
        ax.set_xticks(steps, [str(int(s)) for s in steps])
        ax.minorticks_off()
        ax.set_xlabel("distillation steps of the draft (the target is the same)")
    paper = sorted(PAPER_TAB6)
    for k in ("SD", "STree"):
        ups = [PAPER_TAB6[s][k][1] for s in paper]
        axes[3].plot(paper, ups, marker="s", color=COLORS[k], label=f"{k} speedup")
        for s, up in zip(paper, ups):
            axes[3].annotate(f"tau {PAPER_TAB6[s][k][2]:.2f}", (s, up), fontsize=6, color=COLORS[k], xytext=(3, 3),
                             textcoords="offset points")
    axes[3].set_xscale("log")
    axes[3].set_xticks(paper, [f"{s // 1000}K" for s in paper])
    axes[3].minorticks_off()
    axes[3].set(xlabel="distillation steps of the draft", ylabel="speedup over autoregressive")
    axes[3].set_title(f"{PAPER}, MambaInLlama-8B", fontsize=7)
    axes[3].legend(fontsize=6)
    axes[3].grid(alpha=0.3)
    _finish(fig, df, "STree Table 6, measured on trained pairs: SD chain vs STree tree vs the draft's training", out)
