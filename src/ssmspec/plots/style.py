"""Shared look of the figures: a title line naming what the numbers were measured on, and how they print a size."""
from __future__ import annotations

from ssmspec.units import fmt_bytes  # noqa: F401  (the figures' byte labels)


def provenance(df) -> str:
    """'<device> · <dtype> · <weights> weights · <profile> profile' from result columns (those present), and for rows
    measured on a trained pair (``pair: trained``) which pair and that the acceptance is measured."""
    parts = []
    for col, fmt in (("device_name", "{}"), ("dtype", "{}"), ("weights", "{} weights"), ("profile", "{} profile")):
        if col in df.columns:
            vals = sorted({str(v) for v in df[col].dropna()})
            if vals:
                parts.append(fmt.format("/".join(vals)))
    if "pair" in df.columns and (df["pair"] == "trained").any():
        fams = sorted({str(v) for v in df.loc[df["pair"] == "trained", "family"].dropna()}) if "family" in df else []
        parts.append(f"acceptance MEASURED on the trained {'/'.join(fams)} pair (no oracle)")
    return " · ".join(parts)


def ok_rows(df):
    """Rows that hold a measurement (drops status skipped / oom)."""
    return df[df["status"] == "ok"] if "status" in df.columns else df
