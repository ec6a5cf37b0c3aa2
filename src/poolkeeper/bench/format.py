"""Number formatting shared by the bench, compare and replay tables."""
from __future__ import annotations

from typing import Optional


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)}B"
            return f"{n:.4g}{unit}" if n != int(n) else f"{int(n)}{unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


def fmt_ns(ns: Optional[float]) -> str:
    if ns is None:
        return "-"
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.3g} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.3g} ms"
    return f"{ns / 1e9:.3g} s"


def fmt_rate(r: Optional[float]) -> str:
    if r is None:
        return "-"
    if r >= 1e6:
        return f"{r / 1e6:.3g}M"
    if r >= 1e3:
        return f"{r / 1e3:.3g}k"
    return f"{r:.3g}"


def fmt_ratio(r: Optional[float]) -> str:
    if r is None:
        return "-"
    if r == float("inf"):
        return "∞"
    if abs(r) >= 100:
        return f"{r:.0f}×"
    if abs(r) >= 0.1:
        return f"{r:.2f}×"
    return f"{r:.2g}×"


__all__ = ["fmt_bytes", "fmt_ns", "fmt_rate", "fmt_ratio"]
