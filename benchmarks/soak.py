"""Soak: a 2,000-round run of a small scenario, in-process and on Ray. Does anything grow?

    python benchmarks/soak.py                       # 2,000 rounds, both backends (fresh process each)
    python benchmarks/soak.py --rounds 150 --early 50 --backends inprocess   # the test's size

The scenario: the trust review's scenario B (two Raspberry Pi 4s and a Jetson Nano, digits IID,
``small_cnn``, ``full``, one step a round), every round written on its own
(``simulation.write_every_s = 0``) so each round's write can be timed. Recorded per round, in the
driver: its RSS, its open file descriptors, the run folder's size on disk, and how long the
background writer took for that round's rows, status and checkpoint. Compared at round 100 and at
the last round: RSS (goal: within 5%), descriptors (goal: no growth), and the median write time of
the 20 rounds up to each (goal: flat). Writes ``benchmarks/results/soak.json``; the page is
``benchmarks/studies/soak.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import rss_bytes  # noqa: E402 (a sibling script)


def scenario(rounds: int, backend: str, out: str) -> dict:
    return {
        "name": f"soak_{backend}",
        "seed": 0,
        "output_dir": out,
        "fleet": {"raspberry_pi_4": 2, "jetson_nano": 1},
        "data": {"dataset": "digits", "partitioner": "iid"},
        "model": {"name": "small_cnn"},
        "train": {"strategy": "full", "local_epochs": 1, "max_steps": 1},
        "server": {"rounds": rounds},
        "simulation": {"backend": backend, "write_every_s": 0},
    }


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def worker(rounds: int, backend: str) -> dict:
    """One soak run in this process; per-round records."""
    import fedelastic as fe
    from fedelastic.results.recorder import Recorder

    writes: dict[int, float] = {}  # round -> seconds the writer spent on its batch
    real = Recorder._write_batch

    def timed(self, kept):
        start = time.perf_counter()
        real(self, kept)
        rows = [r for k in kept if k.table is self.rounds for r in k.rows]
        if rows:
            writes[int(rows[-1]["round"])] = time.perf_counter() - start

    Recorder._write_batch = timed
    out = Path(tempfile.mkdtemp(prefix="fedelastic-soak-"))
    records: list[dict] = []
    folder: list[Path] = []

    def progress(row: dict) -> None:
        rnd = int(row["round"])
        if rnd % 10 and rnd < rounds:
            return
        if not folder:
            folder.append(next(out.glob("*/*")))
        records.append({"round": rnd, "rss_bytes": rss_bytes(), "fds": len(os.listdir("/proc/self/fd")),
                        "folder_bytes": folder_bytes(folder[0]), "t": time.perf_counter()})

    start = time.perf_counter()
    result = fe.run(scenario(rounds, backend, str(out)), progress=progress)
    return {"backend": backend, "rounds": rounds, "status": result.status["status"], "wall_s": time.perf_counter() - start,
            "records": records, "writes": {str(k): v for k, v in sorted(writes.items())}}


def summary(doc: dict, early: int = 100) -> dict:
    rows = {r["round"]: r for r in doc["records"]}
    last = max(rows)
    writes = {int(k): v for k, v in doc["writes"].items()}

    def write_ms(upto: int) -> float:
        window = [v for k, v in writes.items() if upto - 20 < k <= upto]
        return 1e3 * statistics.median(window) if window else float("nan")

    a, b = rows[early], rows[last]
    return {
        "backend": doc["backend"], "status": doc["status"], "rounds": last, "wall_s": doc["wall_s"],
        "rss_mb": [a["rss_bytes"] / 1e6, b["rss_bytes"] / 1e6], "rss_change": b["rss_bytes"] / a["rss_bytes"] - 1,
        "fds": [a["fds"], b["fds"]], "max_fds": max(r["fds"] for r in doc["records"] if r["round"] >= early),
        "folder_mb": [a["folder_bytes"] / 1e6, b["folder_bytes"] / 1e6],
        "write_ms": [write_ms(early), write_ms(last)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--backends", nargs="+", default=["inprocess", "ray"])
    ap.add_argument("--early", type=int, default=100, help="the round compared with the last (default %(default)s)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.rounds, args.worker)))
        return
    docs = []
    for backend in args.backends:  # a fresh process each: nothing carried from one to the other
        proc = subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--worker", backend],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"{backend}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        docs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    summaries = [summary(d, args.early) for d in docs]
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "load_average_1m_at_end": os.getloadavg()[0],
                                          "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
                                          "summary": summaries, "runs": docs}, indent=1))
    for s in summaries:
        print(f"{s['backend']:9s} {s['status']}: {s['rounds']} rounds in {s['wall_s']:.0f} s; RSS {s['rss_mb'][0]:.1f} -> "
              f"{s['rss_mb'][1]:.1f} MB ({s['rss_change']:+.1%}); fds {s['fds'][0]} -> {s['fds'][1]} (max {s['max_fds']}); "
              f"folder {s['folder_mb'][0]:.2f} -> {s['folder_mb'][1]:.2f} MB; write {s['write_ms'][0]:.2f} -> "
              f"{s['write_ms'][1]:.2f} ms")


if __name__ == "__main__":
    main()
