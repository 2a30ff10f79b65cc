"""Do two sets of run folders hold the same tables? The before/after check of a restructure.

    python benchmarks/same_tables.py BEFORE_DIR AFTER_DIR

Every ``*.csv`` under BEFORE_DIR is compared with the file at the same relative path under
AFTER_DIR field by field, as text (the bytes of each field, row by row), and every ``*.parquet``
table as a pandas frame (values and dtypes); columns that differ between identical runs are left
out: ``host_*`` (the host's own time), ``wall_s`` and ``run_dir`` (the folder the runs were kept in).
Make the two sets with the same runs, e.g. ``benchmarks/scenarios.py --reduced --keep DIR`` run by
the old and by the new code. Prints each file that differs and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import pandas as pd

VARYING = ("wall_s", "run_dir")  # besides host_*: columns identical runs need not share


def kept(columns) -> list:
    return [c for c in columns if not str(c).startswith("host_") and c not in VARYING]


def same_csv(a: Path, b: Path) -> bool:
    ra, rb = list(csv.reader(a.open(newline=""))), list(csv.reader(b.open(newline="")))
    if not ra or not rb:
        return ra == rb
    ia = [i for i, c in enumerate(ra[0]) if c in kept(ra[0])]
    ib = [i for i, c in enumerate(rb[0]) if c in kept(rb[0])]
    return [[r[i] for i in ia] for r in ra] == [[r[i] for i in ib] for r in rb]


def same_parquet(a: Path, b: Path) -> bool:
    fa, fb = pd.read_parquet(a), pd.read_parquet(b)
    return kept(fa.columns) == kept(fb.columns) and fa[kept(fa.columns)].equals(fb[kept(fb.columns)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    files = sorted(p for p in args.before.rglob("*") if p.suffix == ".csv" or (p.suffix == ".parquet" and p.is_dir()))
    differ = []
    for a in files:
        b = args.after / a.relative_to(args.before)
        if not b.exists() or not (same_csv if a.suffix == ".csv" else same_parquet)(a, b):
            differ.append(a.relative_to(args.before))
    csvs = sum(p.suffix == ".csv" for p in files)
    print(f"{len(files)} tables compared ({csvs} CSV as text, {len(files) - csvs} Parquet as frames): {len(differ)} differ")
    for rel in differ:
        print(f"  differs: {rel}")
    return 1 if differ or not files else 0


if __name__ == "__main__":
    sys.exit(main())
