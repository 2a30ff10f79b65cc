"""Quantities with units and sources, as device profiles write them.

A quantity in a profile is an inline table ``{ value = 25.6, unit = "GB/s", source = "..." }``.
:func:`to_si` converts it to the base unit of its dimension (bytes, FLOP/s, OP/s, B/s, bit/s,
s, W, J, a plain ratio ``"1"`` or a count of tensor elements).
"""

from __future__ import annotations

import math

# dimension -> unit -> factor to the dimension's base unit
UNITS: dict[str, dict[str, float]] = {
    "bytes": {"B": 1.0, "KB": 1e3, "KiB": 1024.0, "MB": 1e6, "MiB": 1024.0**2, "GB": 1e9, "GiB": 1024.0**3},
    "flops": {"FLOP/s": 1.0, "MFLOP/s": 1e6, "GFLOP/s": 1e9, "TFLOP/s": 1e12},
    # integer throughput: one MAC counts as two operations
    "ops": {"OP/s": 1.0, "MOP/s": 1e6, "GOP/s": 1e9, "TOP/s": 1e12, "MMAC/s": 2e6, "GMAC/s": 2e9},
    "bandwidth": {"B/s": 1.0, "MB/s": 1e6, "GB/s": 1e9},
    "bitrate": {"bit/s": 1.0, "kbit/s": 1e3, "Mbit/s": 1e6, "Gbit/s": 1e9},
    "time": {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9},
    "power": {"W": 1.0, "mW": 1e-3},
    "energy": {"J": 1.0, "mJ": 1e-3, "uJ": 1e-6, "nJ": 1e-9, "pJ": 1e-12},
    "ratio": {"1": 1.0, "%": 0.01},
    "count": {"elements": 1.0, "K elements": 1e3, "M elements": 1e6},
}


def si(value: float, unit: str) -> str:
    """``value`` (in ``unit``) with an SI prefix and 3 significant digits: ``si(5.32e12, "FLOP/s")``
    is ``"5.32 TFLOP/s"``, ``si(25.6e9, "B/s")`` is ``"25.6 GB/s"``; a non-finite value is ``"n/a"``."""
    if value != value or value in (float("inf"), float("-inf")):
        return "n/a"
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(value) < 999.5 or prefix == "P":
            return f"{value:.3g} {prefix}{unit}"
        value /= 1000
    raise AssertionError("unreachable")


def to_si(value: float, unit: str, dimension: str) -> float:
    """Convert ``value`` in ``unit`` to the base unit of ``dimension``; KeyError if not allowed."""
    return float(value) * UNITS[dimension][unit]


def fmt_bytes(n: float) -> str:
    """A byte count in decimal units (``1.5 MB``); ``n/a`` when unknown (NaN, e.g. a device whose every client failed)."""
    if not math.isfinite(n):
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
