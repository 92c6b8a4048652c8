"""Shared look of the figures: a title line naming what the numbers were measured on, and how they print a size."""
from __future__ import annotations


def provenance(df) -> str:
    """'<device> · <dtype> · <weights> weights · <profile> profile' from result columns (those present)."""
    parts = []
    for col, fmt in (("device_name", "{}"), ("dtype", "{}"), ("weights", "{} weights"), ("profile", "{} profile")):
        if col in df.columns:
            vals = sorted({str(v) for v in df[col].dropna()})
            if vals:
                parts.append(fmt.format("/".join(vals)))
    return " · ".join(parts)


def fmt_bytes(n: float) -> str:
    """'512 B', '3.0 KiB', ... 'TiB': a byte count as the figures label it (the engine's messages print the same
    way, ``engine/memory.py``; plots import nothing outside plots/)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def ok_rows(df):
    """Rows that hold a measurement (drops status skipped / oom)."""
    return df[df["status"] == "ok"] if "status" in df.columns else df
