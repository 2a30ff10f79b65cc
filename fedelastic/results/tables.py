"""Result tables appended row by row to CSV and to a Parquet dataset folder, written safely.

A table's appends are all or nothing (:class:`_Table`); files of a run folder are never written
through a symbolic link put in their place (:func:`open_no_link`, :func:`fresh`).
"""

from __future__ import annotations

import csv
import errno
import functools
import os
import shutil
from pathlib import Path

import pandas as pd


def open_no_link(path: Path, mode: str, **kw):
    """Open a result file of the run folder for appending (``"a"``) or rewriting in place (``"r+b"``),
    never through a symbolic link put in its place (the link's target, outside the run folder,
    would be written): such a link is an OSError naming the file."""
    flags = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "r+b": os.O_RDWR}[mode]
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link in place of a result file; not written through", str(path)) from None
        raise
    return os.fdopen(fd, mode, **kw)


def fresh(path: Path) -> Path:
    """``path`` with nothing at it (a temporary file about to be written): a link put there is removed, not followed."""
    path.unlink(missing_ok=True)
    return path


def fresh_folder(path: Path) -> Path:
    """``path`` as a new empty folder: whatever was there (a killed writer's leftovers) is removed, a link not followed."""
    _remove(path)
    path.mkdir()
    return path


def _write_atomic(path: Path, text: str) -> None:
    tmp = fresh(path.with_name(path.name + ".tmp"))
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _Table:
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
        self._typed: dict[tuple, object] = {}  # value types of an append's columns -> its Arrow schema (_write_part)
        self._column_set: frozenset[str] = frozenset()
        self.direct_parts = 0  # parts built without pandas (see _write_part)
        _settle_swap(self.parquet)  # a swap a kill cut short: finished or undone
        # never overwrite a part already there (a resumed run's table that was not reloaded)
        self._parts = len(list(self.parquet.glob("part-*.parquet"))) if self.parquet.is_dir() else 0

    def load(self, keep) -> list[dict]:
        """Read back an earlier run's rows (resume), keeping those where ``keep(row)``, and rewrite both files.

        The rewrite is a database's: the kept rows are written under temporary names in the run
        folder, then renamed over the old files (the CSV first, then the Parquet folder, swapped
        through ``.<name>.parquet.old``), so a kill at any instant leaves the old table or the new
        one, never less; the next load finishes or undoes a swap it finds half done. The Parquet
        folder is the table (its parts are renamed into place after the CSV rows are appended);
        one with no part, or parts with no column, reads as empty.
        """
        frame = read_parquet_table(self.parquet)  # a swap a kill cut short was settled when the table was opened
        rows = [r for r in frame.to_dict("records") if keep(r)]
        final_csv, final_parquet = self.csv, self.parquet
        new_csv = final_csv.with_name(f".{final_csv.name}.new")
        new_parquet = final_parquet.with_name(f".{final_parquet.name}.new")
        _remove(new_csv)
        _remove(new_parquet)
        self.columns = list(frame.columns) if rows else None  # no row kept: the first append names them
        self._column_set = frozenset(self.columns or ())
        self.rows, self.n_rows, self._parts = [], 0, 0
        self._set_schema(None)
        self.csv, self.parquet = new_csv, new_parquet
        try:
            if rows:
                self.append(rows)
        finally:
            self.csv, self.parquet = final_csv, final_parquet
        if rows:
            os.replace(new_csv, final_csv)
        else:
            final_csv.unlink(missing_ok=True)
        _swap_in(new_parquet if rows else None, final_parquet)
        return rows

    def _write_part(self, rows: list[dict], merge: bool = False, folder: Path | None = None) -> tuple[Path, Path]:
        """Write ``rows`` as a hidden temporary part (in ``folder``: as its first part); returns (temporary, final).

        The part is exactly what ``pd.DataFrame(rows, columns=...).to_parquet(index=False,
        schema=...)`` writes, with the earlier parts' schema (``merge``: none, types as pandas
        infers them). Building that DataFrame, and pyarrow's
        conversion from it, cost ~5 ms an append, so once an append's per-column value
        types (its *signature*) have been written that way without any cast, appends with the same
        signature build the Arrow columns straight from the values, with that append's schema
        (pandas' metadata included): the same bytes. Anything the fast path cannot convert, or a
        new signature, goes through pandas.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        if folder is None:
            self.parquet.mkdir(exist_ok=True)
            if self.parquet.is_symlink():  # a link put in place of the folder: its parts would go elsewhere
                raise OSError(errno.ELOOP, "a symbolic link in place of a result folder; not written through", str(self.parquet))
        final = folder / "part-000001.parquet" if folder is not None else self.parquet / f"part-{self._parts + 1:06d}.parquet"
        tmp = fresh(final.with_name(f".{final.name}.tmp"))
        assert self.columns is not None
        values = [[row.get(c, _MISSING) for row in rows] for c in self.columns]  # DataFrame(rows, columns=...)
        signature = tuple(frozenset(map(type, column)) for column in values)
        table = None
        schema = None if merge else self._typed.get(signature)
        if schema is not None:
            try:
                arrays = [pa.array(v, type=f.type, from_pandas=True) for v, f in zip(values, schema)]
                table = pa.Table.from_arrays(arrays, schema=schema)
                self.direct_parts += 1
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                table = None  # e.g. an int beyond int64: pandas decides, as it always did
        if table is None:
            frame = pd.DataFrame(rows, columns=self.columns)
            table = pa.Table.from_pandas(frame, schema=None if merge else self._schema, preserve_index=False)
            if not merge and _plain(frame, table.schema):
                self._typed[signature] = table.schema
        try:
            pq.write_table(table, tmp, compression="snappy")  # as pandas' to_parquet
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
            self._column_set = frozenset(self.columns)
        for row in rows:  # csv.DictWriter's check, before anything is written
            if not row.keys() <= self._column_set:
                wrong = [repr(k) for k in row if k not in self._column_set]
                raise ValueError("dict contains fields not in fieldnames: " + ", ".join(wrong))
        new = not self.csv.exists()
        size = 0 if new else self.csv.stat().st_size
        tmp, merged = None, None
        try:
            try:  # the earlier parts' types (e.g. an all-empty column takes their string type)
                tmp, final = self._write_part(rows)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                # the types changed (a column that was all empty gets values, ints get a NaN): one
                # part holding every row, typed as one frame of all rows would be, in a new folder
                # swapped in for the old one once whole (a kill leaves the old or the new, never both)
                every = pd.read_parquet(self.parquet).to_dict("records") + rows
                merged = fresh_folder(self.parquet.with_name(f".{self.parquet.name}.merged"))
                tmp, final = self._write_part(every, merge=True, folder=merged)
            with open_no_link(self.csv, "a", newline="") as fh:
                writer = csv.writer(fh)
                if new:
                    writer.writerow(self.columns)
                writer.writerows([[row.get(c, "") for c in self.columns] for row in rows])
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            if merged is not None:
                _remove(merged)
            if self.csv.exists():
                with open_no_link(self.csv, "r+b") as fh:
                    fh.truncate(size)
            raise
        if merged is not None:  # the merged folder replaces the old one: it is complete before the old goes
            _swap_in(merged, self.parquet)
            self._parts = 1
        else:
            self._parts += 1
        if self._schema is None or merged is not None:
            import pyarrow.parquet as pq

            self._set_schema(pq.read_schema(self.parquet / f"part-{self._parts:06d}.parquet"))
        self.n_rows += len(rows)
        if self.keep_rows:
            self.rows.extend(rows)
        elif self.keep_last:
            self.rows = rows[-1:]

    def _set_schema(self, schema) -> None:
        """The parts' schema changed: what pandas makes of each signature may change with it.

        A signature that pandas typed exactly as the new schema (metadata included) keeps its
        entry: given that schema, pandas types it so again. So the first part's signature, whose
        types became the table's, takes the fast path from the second append on.
        """
        self._schema = schema
        keep = schema is not None
        self._typed = {sig: s for sig, s in self._typed.items() if keep and s.equals(schema, check_metadata=True)}

    def frame(self) -> pd.DataFrame:
        if not self.keep_rows:
            return pd.read_parquet(self.parquet) if self.parquet.exists() else pd.DataFrame(columns=self.columns)
        return pd.DataFrame(self.rows, columns=self.columns)


_MISSING = float("nan")  # a key a row lacks: what pd.DataFrame(rows, columns=...) puts there
# pandas dtypes whose Arrow column _write_part may build from the values directly
_PLAIN_DTYPES = {"int64": "int64", "float64": "double", "bool": "bool", "str": "large_string"}


@functools.cache  # once per process: later runs in it find the writer set up
def warm_up() -> None:
    """The Parquet writer's imports and first conversion, made now on a one-row table in memory.

    The first table written in a process pays ~25 ms that later ones do not: pyarrow's Parquet
    modules are imported, and pandas' Arrow-backed strings and pyarrow's Parquet writer and
    reader set themselves up on first use. A run's first rows are written while its first round
    trains (write-behind), where that cost would slow round 1: the runner calls this at start-up,
    beside Ray's start where there is one. It writes nothing to disk.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pd.DataFrame([{"int": 0, "float": 0.0, "str": "", "bool": False}])
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buffer, compression="snappy")
    pq.read_schema(pa.BufferReader(buffer.getvalue()))


def _plain(frame: pd.DataFrame, schema) -> bool:
    """Whether pyarrow built ``schema`` from ``frame`` without a cast: every column a plain dtype, kept as it is."""
    for dtype, name in zip(frame.dtypes, frame.columns):
        arrow = _PLAIN_DTYPES.get(str(dtype))
        if arrow is None or str(schema.field(name).type) != arrow:
            return False
    return True


def read_parquet_table(path: Path) -> pd.DataFrame:
    """A table's Parquet folder (or file) as a DataFrame; an empty one (no columns) when it does not
    exist, holds no part, or its parts hold no column (a run killed before its first rows)."""
    if not path.exists() or (path.is_dir() and not any(path.glob("part-*.parquet"))):
        return pd.DataFrame()
    frame = pd.read_parquet(path)
    return frame if len(frame.columns) else pd.DataFrame()


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def _swap_in(new: Path | None, final: Path) -> None:
    """Put the folder ``new`` in place of ``final`` (None: remove ``final``), through ``_old(final)``:
    at every instant one of ``final`` and ``_old(final)`` holds a whole table (:func:`_settle_swap`)."""
    old = _old(final)
    _remove(old)
    if final.exists():
        os.replace(final, old)
    if new is not None:
        os.replace(new, final)
    _remove(old)


def _settle_swap(final: Path) -> None:
    """Finish or undo a :func:`_swap_in` that a kill cut short: the old folder comes back if the new
    one never arrived, and is removed if it did."""
    old = _old(final)
    if old.exists():
        if final.exists():
            _remove(old)
        else:
            os.replace(old, final)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
