"""Cost of writing a round's results as the run grows (issue 10).

    python benchmarks/results_append.py [--rounds 200] [--clients 500]

Writes ``--clients`` client rows per round for ``--rounds`` rounds (columns like a real
``clients`` table) two ways, interleaved round by round in one process:

(a) ``rewrite``: the writer before issue 10: every round the whole table rewritten to one
    Parquet file (and the CSV appended), all rows kept in memory;
(b) ``append``: ``fedelastic.results.recorder._Table`` now: one part file per round in the
    ``clients.parquet`` folder (and the CSV appended), rows not kept.

Reports the write time of rounds 1, R/2 and R (median of the 5 rounds around each) and checks
that both read back as equal frames.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedelastic.results.recorder import _Table  # noqa: E402


class Rewrite:
    """The pre-issue-10 writer, reduced to its write path."""

    def __init__(self, folder: Path):
        self.csv, self.parquet = folder / "clients.csv", folder / "clients.parquet"
        self.rows: list[dict] = []

    def append(self, rows: list[dict]) -> None:
        new = not self.csv.exists()
        tmp = self.parquet.with_suffix(".parquet.tmp")
        pd.DataFrame(self.rows + rows, columns=list(rows[0])).to_parquet(tmp, index=False)
        with self.csv.open("a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.parquet)
        self.rows.extend(rows)


def client_rows(rnd: int, n: int, rng: np.random.Generator) -> list[dict]:
    return [
        {
            "round": rnd, "partition_id": int(p), "node_id": int(p) + 1000, "device": "jetson_tx2",
            "device_class": "mid", "strategy": "full", "fits": True, "error": None,
            "num_examples": int(rng.integers(10, 200)), "train_loss": float(rng.random()),
            "emulated_train_time_s": float(rng.random() * 10), "peak_memory_mb": float(rng.random() * 500),
            "energy_j": float(rng.random() * 50), "params_trained": 6000, "host_time_s": float(rng.random()),
        }
        for p in rng.choice(10 * n, n, replace=False)
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--clients", type=int, default=500)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp, "rewrite"), Path(tmp, "append")
        a.mkdir()
        b.mkdir()
        writers: dict = {"rewrite": Rewrite(a), "append": _Table(b, "clients", keep_rows=False)}
        times: dict[str, list[float]] = {k: [] for k in writers}
        for rnd in range(1, args.rounds + 1):
            rows = client_rows(rnd, args.clients, rng)
            for name, writer in writers.items():
                t0 = time.perf_counter()
                writer.append([dict(r) for r in rows])
                times[name].append(time.perf_counter() - t0)
        pd.testing.assert_frame_equal(pd.read_parquet(a / "clients.parquet"), pd.read_parquet(b / "clients.parquet"))
        marks = [1, args.rounds // 2, args.rounds]
        print(f"{args.clients} client rows per round, {args.rounds} rounds; write time per round (ms, median of 5)")
        print(f"{'writer':10s}" + "".join(f"{'round ' + str(m):>12s}" for m in marks) + f"{'total s':>10s}")
        for name, ts in times.items():
            cells = [1000 * float(np.median(ts[max(0, m - 3) : m + 2])) for m in marks]
            print(f"{name:10s}" + "".join(f"{c:12.1f}" for c in cells) + f"{sum(ts):10.2f}")
        print("both read back as equal frames")


if __name__ == "__main__":
    main()
