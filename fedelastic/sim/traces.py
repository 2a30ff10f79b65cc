"""Trace files of the fleet: availability windows and link rates per client, read and checked, and
FedScale's client availability traces imported into the availability format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .availability import TraceAvailability

TRACE_AVAILABILITY_COLUMNS = ("client_id", "start_s", "end_s")
TRACE_NETWORK_COLUMNS = ("client_id", "uplink_bit_per_s", "downlink_bit_per_s")


def _read_table(path: str | Path, columns: tuple[str, ...], what: str, src: str | None = None, key: str = ""):
    """The trace table at ``path``; a file that is missing or of another kind is an error naming the
    scenario ``src`` and its ``key`` (a fault inside the file names the file and the column)."""
    import pandas as pd

    path = Path(path)
    where, key = (src, key) if src else (str(path), "file")
    if not path.exists():
        raise ConfigError(where, key, f"an existing {what} file (.csv or .parquet)", str(path))
    if path.suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif path.suffix == ".csv":
        frame = pd.read_csv(path)
    else:
        raise ConfigError(where, key, f"a {what} file ending in .csv or .parquet", str(path))
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ConfigError(path, missing[0], f"columns {list(columns)} (missing)", list(frame.columns))
    for col in columns[1:]:
        values = pd.to_numeric(frame[col], errors="coerce")
        bad = values.isna() | ~np.isfinite(values.fillna(-1)) | (values.fillna(-1) < 0)
        if bad.any():
            raise ConfigError(path, col, "finite non-negative numbers", frame[col][bad].iloc[0])
        frame[col] = values.astype(float)
    return frame


def load_availability_trace(
    path: str | Path, num_clients: int, period_s: float = 0.0, *, src: str | None = None
) -> TraceAvailability:
    """Read online windows from a CSV or Parquet file with columns ``client_id, start_s, end_s``.

    Clients are taken in sorted ``client_id`` order: partition ``p`` gets the ``p``-th one. The
    windows repeat every ``period_s`` (0: the largest ``end_s`` in the file).
    """
    frame = _read_table(path, TRACE_AVAILABILITY_COLUMNS, "availability trace", src, "availability.trace")
    bad = frame[frame.end_s <= frame.start_s]
    if len(bad):
        raise ConfigError(path, "end_s", "end_s > start_s in every row", f"row {bad.index[0] + 2}")
    ids = sorted(frame.client_id.unique(), key=str)
    if len(ids) < num_clients:
        raise ConfigError(path, "client_id", f"at least {num_clients} clients (the fleet's size)", len(ids))
    period = period_s or float(frame.end_s.max())
    if frame.end_s.max() > period:
        raise ConfigError(path, "end_s", f"windows within the period {period} s", float(frame.end_s.max()))
    windows = []
    for cid in ids[:num_clients]:
        rows = frame[frame.client_id == cid].sort_values("start_s")
        spans = list(zip(rows.start_s.tolist(), rows.end_s.tolist()))
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ConfigError(path, "start_s", f"non-overlapping windows for client {cid!r}", s1)
        windows.append(spans)
    return TraceAvailability(windows, period)


def fedscale_windows(traces: dict) -> list[tuple[object, float, float]]:
    """Online windows ``(client_id, start_s, end_s)`` from FedScale's client availability traces.

    FedScale keeps, per client, lists ``active`` and ``inactive`` (window ``i`` is
    ``[active[i], inactive[i]]``) repeating every ``finish_time`` seconds. Clients' periods differ;
    ours is one period for all, so each client's windows are repeated with its own period up to
    the longest ``finish_time`` and cut there (that becomes the trace's period).
    """
    horizon = max(float(t["finish_time"]) for t in traces.values())
    rows = []
    for cid, t in traces.items():
        period = float(t["finish_time"])
        if period <= 0 or len(t["active"]) != len(t["inactive"]):
            raise ValueError(f"FedScale trace of client {cid!r}: needs finish_time > 0 and as many active as inactive")
        base = 0.0
        while base < horizon:
            for start, end in zip(t["active"], t["inactive"]):
                lo, hi = base + float(start), min(base + float(end), horizon)
                if hi > lo:
                    rows.append((cid, lo, hi))
            base += period
    return rows


def import_fedscale_availability(pickle_path: str | Path, out_path: str | Path) -> float:
    """Convert a FedScale availability pickle (``{client_id: {active, inactive, finish_time}}``) to our CSV/Parquet.

    Returns the period (the longest ``finish_time``): give it as ``[availability] period_s``, since
    the last window in the file may end before it. Unpickling runs code from the file: use it
    only on files you trust.
    """
    import pickle

    import pandas as pd

    with open(pickle_path, "rb") as fh:
        traces = pickle.load(fh)  # noqa: S301 - a file the user chose to import
    frame = pd.DataFrame(fedscale_windows(traces), columns=list(TRACE_AVAILABILITY_COLUMNS))
    out_path = Path(out_path)
    frame.to_parquet(out_path, index=False) if out_path.suffix == ".parquet" else frame.to_csv(out_path, index=False)
    return max(float(t["finish_time"]) for t in traces.values())


def load_network_trace(path: str | Path, num_clients: int, *, src: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(uplink, downlink) in bit/s per partition, from columns ``client_id, uplink_bit_per_s, downlink_bit_per_s``."""
    frame = _read_table(path, TRACE_NETWORK_COLUMNS, "network trace", src, "network.trace")
    if frame.client_id.duplicated().any():
        raise ConfigError(
            path, "client_id", "one row per client", frame.client_id[frame.client_id.duplicated()].iloc[0]
        )
    frame = frame.sort_values("client_id", key=lambda c: c.astype(str))
    if len(frame) < num_clients:
        raise ConfigError(path, "client_id", f"at least {num_clients} clients (the fleet's size)", len(frame))
    if (frame.uplink_bit_per_s[:num_clients] <= 0).any() or (frame.downlink_bit_per_s[:num_clients] <= 0).any():
        raise ConfigError(path, "uplink_bit_per_s", "positive link rates")
    return (
        frame.uplink_bit_per_s.to_numpy()[:num_clients].copy(),
        frame.downlink_bit_per_s.to_numpy()[:num_clients].copy(),
    )
