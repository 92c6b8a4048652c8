"""Designed beside measured acceptance in the end-to-end figures (``bench/designed.py``).

docs/design.md, "Drafting and acceptance": a designed acceptance (the oracle's law) and a measured one (a real
drafter, or a paper's table) never share a line of a figure. The figures therefore draw, per line, the tokens/s at the designed
acceptance as the bar or curve, the measured tokens/s of the same steps as separate markers, and a paper's
numbers in a panel of their own labelled with their hardware. Rows written before the designed fields existed
(``tokens_per_s_designed``) are drawn as measured only, with one line naming the rerun command.
"""
from __future__ import annotations

import pandas as pd

DESIGNED = "designed acceptance (oracle)"
MEASURED_MARK = "measured (the steps' accepted counts)"


def _oracle_rows(rows: pd.DataFrame) -> pd.DataFrame:
    ok = rows[rows["status"] == "ok"] if "status" in rows.columns else rows
    return ok[ok["acceptance"] == "oracle"] if "acceptance" in ok.columns else ok.iloc[0:0]


def has_designed(rows: pd.DataFrame) -> bool:
    """Whether the measured oracle rows among ``rows`` carry the designed fields."""
    spec = _oracle_rows(rows)
    return (not spec.empty and "tokens_per_s_designed" in rows.columns
            and bool(spec["tokens_per_s_designed"].notna().all()))


def predates(rows: pd.DataFrame) -> bool:
    """Oracle rows without the designed fields: written before they existed."""
    return not _oracle_rows(rows).empty and not has_designed(rows)


def rerun_note(df: pd.DataFrame) -> str:
    """'' or the line that says the rows predate the designed fields, and how to rerun them."""
    if not predates(df):
        return ""
    exp = str(df["experiment"].iloc[0]) if "experiment" in df.columns else "<id>"
    prof = str(df["profile"].iloc[0]) if "profile" in df.columns else "<profile>"
    return (f"these rows predate designed acceptance (measured only, not comparable with designed numbers); rerun: "
            f"python -m ssmspec run experiment={exp} profile={prof} --save-reference")


def tokens_per_s(rows: pd.DataFrame) -> pd.Series:
    """Designed tokens/s where the rows have them (oracle lines, and lines without drafts), else measured."""
    if "tokens_per_s_designed" not in rows.columns:
        return rows["tokens_per_s"]
    return rows["tokens_per_s_designed"].where(rows["tokens_per_s_designed"].notna(), rows["tokens_per_s"])


def speedup(rows: pd.DataFrame) -> pd.Series:
    """Designed speedup over autoregressive where present, else measured."""
    if "speedup_designed" not in rows.columns:
        return rows.get("speedup", pd.Series(index=rows.index, dtype=float))
    return rows["speedup_designed"].where(rows["speedup_designed"].notna(), rows.get("speedup"))


def within_note(rows: pd.DataFrame) -> str:
    """'measured mean accepted within 2% of designed on n/m oracle rows (worst gap +x.x%)', or ''."""
    if "accepted_gap" not in rows.columns:
        return ""
    spec = rows[rows["accepted_gap"].notna()]
    if spec.empty:
        return ""
    worst = spec["accepted_gap"].iloc[spec["accepted_gap"].abs().argmax()]
    tol = spec["accepted_tolerance"].dropna() if "accepted_tolerance" in spec.columns else spec.iloc[0:0]
    within = f"within {tol.max():.0%}" if len(tol) else "within tolerance"  # rows before the field: no number
    return (f"measured mean accepted {within} of designed on "
            f"{int(spec['accepted_within'].sum())}/{len(spec)} "
            f"oracle rows (largest gap {100 * worst:+.1f}%)")
