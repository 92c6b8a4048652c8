"""Figures of ``saguaro_e2e`` and ``saguaro_fig6_backoff`` (bench/saguaro_e2e.py, bench/saguaro_backoff.py), from
results only.

``saguaro_e2e``: per trained pair, draft length, prompt set and temperature, emitted tokens/s vs batch of autoregressive,
synchronous and asynchronous speculation (backup draft, backup ngram; dashed: the draft on a GPU of its own), and
below it the async lines' speedup over synchronous speculation and their cache hit rate. ``saguaro_fig6_backoff``:
tokens/s vs batch of async with backup draft, with backup ngram, and the backoff line (the line ``backoff_choice``
picked at each batch from that batch's measurements), a vertical mark where the choice flips and a mark at the
measured crossing of the two lines, the title saying whether they agree. Both MEASURED on a trained pair; titles say so (``plots/style.py``).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from ssmspec.plots.saguaro import save
from ssmspec.plots.style import ok_rows, provenance

_STYLE = {"autoregressive": ("#555555", "o", "-"), "sync draft_model": ("#4c72b0", "s", "-"),
          "async backup=draft": ("#dd8452", "^", "-"), "async backup=ngram": ("#55a868", "v", "-"),
          "sync png": ("#8172b3", "x", ":"), "backoff": ("#c44e52", "D", "--"),
          "async backup=draft, draft on cuda:1": ("#dd8452", "^", "--"),
          "async backup=ngram, draft on cuda:1": ("#55a868", "v", "--")}


def _pair_line(d: pd.DataFrame) -> str:
    pairs = [f"{t} / {dr}" for t, dr in dict.fromkeys(zip(d["target"], d["draft"]))]
    r = d.iloc[0]
    return (f"MEASURED acceptance: trained pair{'s' if len(pairs) > 1 else ''} {'; '.join(pairs)} "
            f"(train run {r['train_run']} {r['train_key']}), S = {_S_note(d)}, {r['dtype']}, {r['timing']}")


def _S_note(d: pd.DataFrame) -> str:
    """The draft length of the rows, or the list of them the run swept."""
    Ss = sorted(set(d["sweep_S"].dropna().astype(int))) if "sweep_S" in d.columns else []
    return ", ".join(map(str, Ss)) if len(Ss) > 1 else str(int(d["S"].max()))


def _families(d: pd.DataFrame) -> list:
    """The pairs' families in row order ([None] for rows without the column: one pair)."""
    return list(dict.fromkeys(d["family"])) if "family" in d.columns else [None]


def _of(d: pd.DataFrame, family) -> pd.DataFrame:
    return d if family is None else d[d["family"] == family]


def _fanout_note(d: pd.DataFrame) -> str:
    a = d[d["drafter"] == "async_draft"]
    if not len(a):
        return ""
    r = a.iloc[0]
    how = "optimal_fanout, fitted on the first half" if str(r["fanout_from"]).startswith("optimal") else "stated"
    return f"fan-out {list(r['fanout'])} ({how})"


def _line(ax, t: pd.DataFrame, label: str, y: str, *, faint: bool = False) -> None:
    color, marker, ls = _STYLE.get(label, ("#888888", "x", "-"))
    t = t.sort_values("batch")
    ax.plot(t["batch"], t[y], marker=marker, color=color, ls=ls, label=f"{label} (backoff input)" if faint else label,
            alpha=0.35 if faint else 1.0, lw=0.9 if faint else 1.5)


def _batch_axis(ax, ylabel: str) -> None:
    """A panel's log2 batch axis, its y label, grid and legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _draft_lengths(p: pd.DataFrame) -> list:
    """The draft-length groups of a pair's rows in row order ([None] for rows without ``sweep_S``: one S)."""
    return list(dict.fromkeys(p["sweep_S"].dropna().astype(int))) if "sweep_S" in p.columns else [None]


def _of_S(p: pd.DataFrame, S) -> pd.DataFrame:
    return p if S is None else p[p["sweep_S"] == S]


def e2e_panels(d: pd.DataFrame) -> list[tuple]:
    """The panels of the e2e figure: (family or None, draft length or None, prompt set, temperature), in row
    order. A figure row pair per (family, draft length), a column per (set, temperature)."""
    panels = []
    for family in _families(d):
        p = _of(d, family)
        for S in _draft_lengths(p):
            q = _of_S(p, S)
            panels += [(family, S, name, T) for name, T in dict.fromkeys(zip(q["set"], q["temperature"]))]
    return panels


def plot_e2e(df: pd.DataFrame, out: Path) -> None:
    """tokens/s and async speedup over sync + hit rate vs batch: per (pair, draft length) two figure rows (tokens/s
    above the speedups), a column per (set, T)."""
    d = ok_rows(df)
    d = d[d["kind"] == "e2e"] if "kind" in d.columns else d.iloc[0:0]
    if not len(d):
        raise ValueError("saguaro_e2e: no e2e rows to plot")
    panels = e2e_panels(d)
    groups = list(dict.fromkeys((f, S) for f, S, _, _ in panels))
    cols = list(dict.fromkeys((name, T) for _, _, name, T in panels))
    fig, axes = plt.subplots(2 * len(groups), len(cols), figsize=(4.8 * len(cols), 7.6 * len(groups)),
                             squeeze=False)
    for family, S, name, T in panels:
        row, col = 2 * groups.index((family, S)), cols.index((name, T))
        p = _of_S(_of(d, family), S)
        p = p[(p["set"] == name) & (p["temperature"] == T)]
        top, low = axes[row][col], axes[row + 1][col]
        for label in dict.fromkeys(p["line"]):
            _line(top, p[p["line"] == label], label, "tokens_per_s")
        a = p[p["drafter"] == "async_draft"]
        for label in dict.fromkeys(a["line"]):
            t = a[a["line"] == label].sort_values("batch")
            _line(low, t, f"{label}", "speedup_vs_sync")
            color = _STYLE.get(label, ("#888888",))[0]
            low.plot(t["batch"], t["hit_rate"], color=color, ls=":", marker=".", label=f"{label}: cache hit rate")
        low.axhline(1.0, color="#999999", lw=0.8)
        pair = "" if family is None else f"{p.iloc[0]['target']} / {p.iloc[0]['draft']}: "
        draft_len = "" if S is None else f", S = {S}"
        top.set_title(f"{pair}{name}, T = {T:g}{draft_len}\n{_fanout_note(p)}", fontsize=8)
        _batch_axis(top, "emitted tokens/s")
        _batch_axis(low, "async / sync tokens/s (solid); hit rate (dotted)")
    for row in range(2 * len(groups)):  # a (pair, S) group without some (set, T): its panels stay empty
        for col in range(len(cols)):
            if not axes[row][col].has_data():
                axes[row][col].set_axis_off()
    save(fig, out, f"SSD end to end: autoregressive, synchronous and asynchronous speculation (MEASURED)\n"
          f"{_pair_line(d)}\n{provenance(df)}", 1 - 0.08 / len(groups))


def plot_backoff(df: pd.DataFrame, out: Path) -> None:
    """tokens/s vs batch of the two async lines and the backoff line, one panel per (set, T), flip and crossing
    marked."""
    d = ok_rows(df)
    if "kind" not in d.columns or not (d["kind"] == "backoff").any():
        raise ValueError("saguaro_fig6_backoff: no backoff rows to plot")
    lines, choice, summary = d[d["kind"] == "line"], d[d["kind"] == "backoff"], d[d["kind"] == "backoff_summary"]
    panels = list(dict.fromkeys(zip(choice["set"], choice["temperature"])))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 4.6), squeeze=False)
    for ax, (name, T) in zip(axes[0], panels):
        p = lines[(lines["set"] == name) & (lines["temperature"] == T)]
        for label in dict.fromkeys(p["line"]):
            t = p[p["line"] == label]
            _line(ax, t, label, "tokens_per_s", faint=bool((t["role"] == "input").any()))
        c = choice[(choice["set"] == name) & (choice["temperature"] == T)]
        _line(ax, c, "backoff", "tokens_per_s")
        s = summary[(summary["set"] == name) & (summary["temperature"] == T)]
        note = ""
        if len(s):
            r = s.iloc[0]
            flip, cross = r["flip_batch"], r["crossing_batch"]
            if pd.notna(flip):
                th = r["threshold_at_flip"]
                ax.axvline(flip, color=_STYLE["backoff"][0], ls="--", lw=1,
                           label=f"backoff flips at B = {int(flip)} (backoff_threshold there: "
                                 f"{'none' if pd.isna(th) else int(th)})")
            if pd.notna(cross):
                ax.axvline(cross, color="#333333", ls=":", lw=1, label=f"measured crossing at B = {int(cross)}")
            note = (f"flip {'none' if pd.isna(flip) else int(flip)} vs crossing "
                    f"{'none' if pd.isna(cross) else int(cross)}: {'AGREE' if r['agree'] else 'DISAGREE'}")
        ax.set_title(f"{name}, T = {T:g}: {note}\n{_fanout_note(p)}", fontsize=8)
        _batch_axis(ax, "emitted tokens/s")
    save(fig, out, f"Saguaro Fig. 6: batch-size-aware backoff (slow draft backup vs n-gram backup) (MEASURED)\n"
          f"{_pair_line(lines if len(lines) else d)}\n{provenance(df)}", 0.9)
