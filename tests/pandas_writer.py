"""A results writer that goes through pandas for every append, kept as a test oracle.

``_Table.append`` builds its Parquet parts without pandas for rows whose value types it has
already seen written; its files must stay byte for byte what this pandas writer writes. Only the
parts of ``_Table`` that write (``__init__``, ``_write_part``, ``append``) are copied, unchanged.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pandas as pd


class PandasTable:
    """One table appended row by row to CSV and to a Parquet dataset folder.

    ``<name>.parquet`` is a folder of part files, one per append (``part-000001.parquet``, ...),
    which ``pd.read_parquet`` reads as one table; an append writes only its own rows, so the cost
    of a round does not grow with the run. When an append's column types differ from the earlier
    parts' (a column that was all empty gets values), the parts are merged into one, so the folder
    always reads back as one consistent table. An append is all or nothing: if the disk fails
    (full, read-only) the CSV is cut back to its previous length and no temporary part is left
    behind, so CSV and Parquet always agree. ``keep_rows=False`` keeps only a row count in memory
    (and, with ``keep_last``, the latest row), so the driver's memory does not grow with the run.
    """

    def __init__(self, folder: Path, name: str, keep_rows: bool = True, keep_last: bool = False):
        self.csv, self.parquet = folder / f"{name}.csv", folder / f"{name}.parquet"
        self.keep_rows, self.keep_last = keep_rows, keep_last
        self.rows: list[dict] = []
        self.n_rows = 0
        self.columns: list[str] | None = None
        self._schema = None  # the parts' Arrow schema
        # never overwrite a part already there (a resumed run's table that was not reloaded)
        self._parts = len(list(self.parquet.glob("part-*.parquet"))) if self.parquet.is_dir() else 0

    def _write_part(self, frame: pd.DataFrame, schema=None) -> tuple[Path, Path]:
        """Write ``frame`` (cast to ``schema`` if given) as a hidden temporary part; returns (temporary, final)."""
        self.parquet.mkdir(exist_ok=True)
        final = self.parquet / f"part-{self._parts + 1:06d}.parquet"
        tmp = self.parquet / f".{final.name}.tmp"
        try:
            frame.to_parquet(tmp, index=False, schema=schema)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, final

    def append(self, rows: list[dict]) -> None:
        import pyarrow as pa

        if not rows:
            return
        if self.columns is None:
            self.columns = list(rows[0])
        new = not self.csv.exists()
        size = 0 if new else self.csv.stat().st_size
        frame = pd.DataFrame(rows, columns=self.columns)
        tmp, merged = None, False
        try:
            try:  # the earlier parts' types (e.g. an all-empty column takes their string type)
                tmp, final = self._write_part(frame, self._schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                # the types changed (a column that was all empty gets values, ints get a NaN): one
                # part holding every row, typed as one frame of all rows would be
                every = pd.read_parquet(self.parquet).to_dict("records") + rows
                tmp, final = self._write_part(pd.DataFrame(every, columns=self.columns))
                merged = True
            with self.csv.open("a", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=self.columns)
                if new:
                    writer.writeheader()
                writer.writerows(rows)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            if self.csv.exists():
                with self.csv.open("r+b") as fh:
                    fh.truncate(size)
            raise
        if merged:  # the merged part replaces the old ones: it is complete before they go
            for part in self.parquet.glob("part-*.parquet"):
                if part != final:
                    part.unlink()
            final.rename(self.parquet / "part-000001.parquet")
            self._parts = 1
        else:
            self._parts += 1
        if self._schema is None or merged:
            import pyarrow.parquet as pq

            self._schema = pq.read_schema(self.parquet / f"part-{self._parts:06d}.parquet")
        self.n_rows += len(rows)
        if self.keep_rows:
            self.rows.extend(rows)
        elif self.keep_last:
            self.rows = rows[-1:]

