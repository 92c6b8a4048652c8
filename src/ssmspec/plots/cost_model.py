"""Figure of the ``cost_model`` experiment (bench/cost_model.py), drawn from result rows only."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import NullLocator

from ssmspec.plots.style import provenance

STYLE = {"policy": dict(marker="*", ms=11, color="k"), "best_fixed": dict(marker="s", ms=6, color="C3"),
         "nearest_fitted": dict(marker="^", ms=7, color="C0")}
NAMES = {"policy": "policy (cost model)", "best_fixed": "best single fixed setting (fit)",
         "nearest_fitted": "best at the nearest fitted batch"}


def _batches(values) -> str:
    return ", ".join(str(int(v)) for v in values)


def _batch_ticks(ax, batches) -> None:
    """Log x axis labelled at exactly these batch sizes."""
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sorted(batches), [str(int(b)) for b in sorted(batches)])


def _acceptance(m: pd.DataFrame, split) -> str:
    """'oracle alpha 0.7', or for a measured run the alpha measured on the fit prompts and which prompts scored."""
    if split.get("acceptance") != "measured":
        return f"oracle alpha {split['alpha']}"
    fit, held = list(split["fit_prompts"]), list(split["eval_prompts"])
    return (f"{split['drafter']} drafter, alpha {split['alpha']:.3f} MEASURED on {split['set']} prompts "
            f"{min(fit)}-{max(fit)} (fit), scored on {min(held)}-{max(held)} (held out)")


def plot_cost_model(df: pd.DataFrame, out: Path) -> None:
    """Per model: left, each chooser's score at every held-out batch (mean over the evaluation seeds, their
    range as the bar, each seed a dot) with the goal line and the fitted batches marked; right, tokens/s of
    every setting at the held-out batches (mean over seeds) with each chooser's picks."""
    if "kind" not in df.columns or not (df["kind"] == "split").any():
        profile = ", ".join(sorted({str(p) for p in df.get("profile", pd.Series(["<profile>"])).dropna()}))
        raise ValueError(f"these cost_model rows predate held-out scoring (no kind: split row) and cannot be drawn; "
                         f"rerun: python -m ssmspec run experiment=cost_model profile={profile} --save-reference")
    splits = df[df["kind"] == "split"]
    models = list(dict.fromkeys(splits["model"]))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 5.2 * len(models)), squeeze=False)
    for (ax, axt), model in zip(axes, models):
        m = df[df["model"] == model]
        split = splits[splits["model"] == model].iloc[0]
        fitted = list(split["fit_batches"])
        summ = m[m["kind"] == "batch_summary"]
        rng = m[m["kind"] == "range"].set_index("chooser")
        scored = m[m["kind"].isin(["policy", "baseline"])]
        goal = float(split["goal_at_batch"])  # the criterion the scoring applied (bench/cost_model_scoring.py)
        choosers = list(rng.index)  # one range row per chooser, in the scoring's order
        for k, name in enumerate(choosers):
            g = summ[summ["chooser"] == name].sort_values("batch")
            x = g["batch"] * (1 + 0.04 * (k - 1))  # side by side at each batch
            r = rng.loc[name]
            label = (f"{NAMES[name]}: geomean {r['geomean_score']:.3f} (sd over seeds {r['geomean_sd']:.3f}), worst "
                     f"{r['worst_score']:.3f} at {int(r['worst_batch'])}")
            ax.errorbar(x, g["score_mean"], yerr=[g["score_mean"] - g["score_min"], g["score_max"] - g["score_mean"]],
                        ls="-", lw=1, capsize=2, label=label, **STYLE[name])
            s = scored[scored["chooser"] == name]
            ax.plot(s["batch"] * (1 + 0.04 * (k - 1)), s["score"], ".", color=STYLE[name]["color"], alpha=0.4, ms=4)
        for f in fitted:
            ax.axvline(f, color="0.6", ls=":", lw=0.8)
        ax.axhline(goal, color="r", ls="--", lw=0.8, label=f"goal: mean >= {goal}")
        pol = rng.loc["policy"]
        ax.set_title(f"{model}: score at each held-out batch (mean, range and seeds)\npolicy vs best fixed: "
                     f"{pol['vs_best_fixed']} ({pol['ratio_to_best_fixed']:.3f}x), vs nearest fitted: "
                     f"{pol['vs_nearest_fitted']} ({pol['ratio_to_nearest_fitted']:.3f}x)", fontsize=8)
        ax.set(xlabel="batch (held out; dotted: fitted)", ylabel="tokens/s of the pick / of the fastest setting")
        _batch_ticks(ax, fitted + list(split["heldout_batches"]))
        lo = min(float(summ["score_min"].min()), goal)
        ax.set_ylim(lo - 0.03, 1.01)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16))  # below: the bars reach 0.5

        ev = m[(m["kind"] == "measure") & (m["phase"] == "eval") & (m["status"] == "ok")]
        mean = ev.groupby(["setting", "batch"], sort=False)["tokens_per_s"].mean().reset_index()
        for k, (label, g) in enumerate(mean.groupby("setting", sort=False)):
            g = g.sort_values("batch")
            S = int(m.loc[m["setting"] == label, "S"].dropna().iloc[0])
            axt.plot(g["batch"], g["tokens_per_s"], lw=1, color=f"C{k % 10}", ls="-" if S == 0 else "--", marker=".",
                     label=label)
        table = mean.set_index(["setting", "batch"])["tokens_per_s"]
        for name in choosers:
            picks = scored[scored["chooser"] == name][["batch", "setting"]].drop_duplicates()
            axt.plot(picks["batch"], [table[(s, b)] for b, s in zip(picks["batch"], picks["setting"])], ls="none",
                     fillstyle="none", label=f"pick: {NAMES[name]}", **STYLE[name])
        _batch_ticks(axt, split["heldout_batches"])
        axt.set(yscale="log", xlabel="held-out batch", ylabel="tokens / s (mean over eval seeds)",
                title=f"{model}: every fixed setting\n{_acceptance(m, split)}")
        axt.title.set_fontsize(8)
        axt.legend(fontsize=6, ncol=2)
        acc = m[m["kind"] == "acceptance"] if "per_setting" in m.columns else m.iloc[0:0]
        if len(acc):  # the measured alpha's law beside what each setting accepted on the fit prompts
            per = acc.iloc[0]["per_setting"]
            held = ev.groupby("setting")["mean_accepted"].mean()  # unweighted over batches and seeds
            axt.text(0.0, -0.2, "accepted drafts per step: measured on the fit prompts / predicted by alpha / measured "
                     "on the held-out prompts\n" + "\n".join(f"{k}: {v['measured']:.2f} / {v['predicted']:.2f} / "
                                                             f"{held.get(k, float('nan')):.2f}" for k, v in per.items()),
                     transform=axt.transAxes, ha="left", va="top", fontsize=6,
                     bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))
        for a in (ax, axt):
            a.grid(True, alpha=0.3)
    first = splits.iloc[0]
    fig.suptitle(f"cost_model: choosers scored only on held-out batches {_batches(first['heldout_batches'])} "
                 f"(fitted: {_batches(first['fit_batches'])}, seed {int(first['fit_seed'])}), evaluation seeds "
                 f"{_batches(first['eval_seeds'])}\n{provenance(df)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
