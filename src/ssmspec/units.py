"""Formatting of quantities, shared by the engine's messages and the figures (depends on nothing else)."""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """'512 B', '3.0 KiB', ... 'TiB': a byte count as messages and figures print it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
