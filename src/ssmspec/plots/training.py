"""Training curves of ``python -m ssmspec train``, read from the cache entry's ``train_log.jsonl`` only."""
from __future__ import annotations

from pathlib import Path

import pandas as pd


def plot_training_curves(log_file: Path, out: Path) -> None:
    """Validation loss (solid) and mean training loss since the previous evaluation (dashed) against tokens
    seen, one colour per model; targets' losses are cross-entropy, drafts' the KL to their target (nats)."""
    import matplotlib.pyplot as plt

    df = pd.read_json(log_file, lines=True)
    kinds = [("target", "cross-entropy (nats/token)"), ("draft", "KL to the target (nats/token)")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (kind, ylabel) in zip(axes, kinds):
        part = df[df["model"].str.endswith(kind)]
        for i, (name, g) in enumerate(part.groupby("model", sort=True)):
            color = f"C{i}"
            ax.plot(g["tokens"], g["val_loss"], "-o", ms=3, color=color, label=f"{name} validation")
            t = g.dropna(subset=["train_loss"])
            ax.plot(t["tokens"], t["train_loss"], "--", color=color, alpha=0.6, label=f"{name} training")
        ax.set_xlabel("tokens seen")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{kind}s")
        if not part.empty:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
