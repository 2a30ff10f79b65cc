"""Results that reach disk as the run goes, and the end-of-run report.

A run folder holds ``config.toml`` (the resolved scenario), ``versions.json``, ``clients.csv``
and ``clients.parquet`` (one row per client per round), ``rounds.csv`` and ``rounds.parquet``
(one row per round), ``status.json``, and at the end a figure and a summary. CSV rows are
appended and flushed as they are written; each ``.parquet`` is a folder that gains one part file
per write (written atomically; ``pd.read_parquet`` reads the folder as one table), so a killed
run leaves every written round readable and a write does not grow with the run. During a run
the rows are written behind, while a later round trains, the rounds of each
``simulation.write_every_s`` together (:class:`Recorder`).
"""

from __future__ import annotations

import csv
import errno
import functools
import json
import os
import platform
import queue
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd
import tomli_w

PACKAGES = ("fedelastic", "flwr", "ray", "torch", "numpy", "pandas", "seaborn", "scikit-learn")


def package_versions() -> dict[str, str]:
    import fedelastic

    out = {"python": platform.python_version(), "fedelastic_path": str(Path(fedelastic.__file__).resolve().parent)}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        out["git"] = sha.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        out["git"] = "unknown"
    return out


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning|Timeout)\w*)(:.*)?$")
HEARTBEAT_S = 10.0  # status.json's heartbeat period while a run is alive
# final states, and the exit code of `fedelastic run` for each (see docs/reference/status.md)
FINAL_STATES = ("completed", "completed_with_errors", "failed", "diverged")


_WRAPPERS = ("ClientAppException", "RayTaskError", "RayActorError", "The above exception", "During handling")


def one_line(text: str, limit: int = 300) -> str:
    """A clean one-line summary of an error text: no ANSI codes, no traceback.

    Picks the last ``SomeError: message`` line with a message that is not one of Flower's or
    Ray's wrappers (the innermost cause, in Python's and Ray's traceback formats), else the
    last non-empty line.
    """
    lines = [ln.strip().rstrip("'>").strip() for ln in _ANSI.sub("", str(text)).splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln]
    if not lines:
        return "unknown error"
    picked = lines[-1]
    for ln in reversed(lines):
        m = _EXC_LINE.match(ln)
        if m and (m.group(3) or "").strip(": ") and not any(w in ln for w in _WRAPPERS):
            picked = ln
            break
    if picked.startswith(("flwr.", "ray.")):  # Flower/Ray class paths: keep the class name
        picked = picked.split(":", 1)[0].split(".")[-1] + (":" + picked.split(":", 1)[1] if ":" in picked else "")
    return picked if len(picked) <= limit else picked[: limit - 3] + "..."


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
        # never overwrite a part already there (a resumed run's table that was not reloaded)
        self._parts = len(list(self.parquet.glob("part-*.parquet"))) if self.parquet.is_dir() else 0

    def load(self, keep) -> list[dict]:
        """Read back an earlier run's rows (resume), keeping those where ``keep(row)``, and rewrite both files."""
        if not self.parquet.exists():
            return []
        frame = pd.read_parquet(self.parquet)
        self.columns = list(frame.columns)
        self._column_set = frozenset(self.columns)
        rows = [r for r in frame.to_dict("records") if keep(r)]
        self.rows, self.n_rows, self._parts = [], 0, 0
        self._set_schema(None)
        self.csv.unlink(missing_ok=True)
        _remove(self.parquet)
        if rows:
            self.append(rows)
        return rows

    def _write_part(self, rows: list[dict], merge: bool = False) -> tuple[Path, Path]:
        """Write ``rows`` as a hidden temporary part; returns (temporary, final).

        The part is exactly what ``pd.DataFrame(rows, columns=...).to_parquet(index=False,
        schema=...)`` writes, with the earlier parts' schema (``merge``: none, types as pandas
        infers them). Building that DataFrame, and pyarrow's
        conversion from it, cost ~5 ms an append (issue 10), so once an append's per-column value
        types (its *signature*) have been written that way without any cast, appends with the same
        signature build the Arrow columns straight from the values, with that append's schema
        (pandas' metadata included): the same bytes. Anything the fast path cannot convert, or a
        new signature, goes through pandas.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.parquet.mkdir(exist_ok=True)
        if self.parquet.is_symlink():  # a link put in place of the folder: its parts would go elsewhere
            raise OSError(errno.ELOOP, "a symbolic link in place of a result folder; not written through", str(self.parquet))
        final = self.parquet / f"part-{self._parts + 1:06d}.parquet"
        tmp = fresh(self.parquet / f".{final.name}.tmp")
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
        tmp, merged = None, False
        try:
            try:  # the earlier parts' types (e.g. an all-empty column takes their string type)
                tmp, final = self._write_part(rows)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                # the types changed (a column that was all empty gets values, ints get a NaN): one
                # part holding every row, typed as one frame of all rows would be
                every = pd.read_parquet(self.parquet).to_dict("records") + rows
                tmp, final = self._write_part(every, merge=True)
                merged = True
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
            if self.csv.exists():
                with open_no_link(self.csv, "r+b") as fh:
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
    trains (write-behind), so that cost slowed round 1; the runner calls this at start-up, beside
    Ray's start where there is one (issue 10). It writes nothing to disk.
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


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped is a zombie: dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _status_fault(doc) -> str:
    """What is wrong with a parsed status.json (a key and what was expected), or '' if nothing."""
    if not isinstance(doc, dict):
        return f"expected a JSON object, got {type(doc).__name__}"
    if not isinstance(doc.get("status"), str):
        return f"key 'status': expected a string, got {doc.get('status')!r}"
    for key in ("heartbeat", "started", "rounds_done", "pid"):
        value = doc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"key '{key}': expected a number, got {value!r}"
    return ""


def read_status(run_dir: str | Path) -> dict:
    """A run's status.json; a 'running' run whose process is gone, or whose heartbeat stopped, reads 'dead'."""
    path = Path(run_dir) / "status.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {"status": "missing"}
    except (OSError, ValueError) as exc:
        return {"status": "unreadable", "error": one_line(str(exc))}
    wrong = _status_fault(doc)
    if wrong:
        return {"status": "unreadable", "error": wrong}
    if doc.get("status") == "running":
        same_host = doc.get("host") == socket.gethostname()
        gone = same_host and isinstance(doc.get("pid"), int) and not _pid_alive(doc["pid"])
        silent = time.time() - float(doc.get("heartbeat", 0)) > 6 * HEARTBEAT_S
        if gone or silent:
            doc = {**doc, "status": "dead", "was": "running"}
    return doc


class _Writer:
    """One thread that runs the jobs handed to it, in order; after a job fails it runs no more."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="fedelastic-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    job()
            except BaseException as exc:  # noqa: BLE001 (handed to the driver's thread: Recorder.flush)
                self.error = exc
            finally:
                self._jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def wait(self) -> None:
        self._jobs.join()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


@dataclass(eq=False)
class _Kept:
    """A write kept for the background writer: rows for a table (merged with that table's other
    kept rows when handed over) or a job."""

    table: _Table | None = None
    rows: list[dict] = field(default_factory=list)
    after: Callable[[list[dict]], None] = lambda rows: None
    job: Callable[[], None] | None = None
    newest_only: bool = False
    done: bool = False


class Recorder:
    """Writes one run's results into ``folder`` as the run goes.

    ``status.json`` carries the PID, host and a heartbeat (rewritten every ``HEARTBEAT_S`` while
    the process lives), so :func:`read_status` tells a killed run from a running one. Every
    client error goes to ``errors.log`` in full; the tables keep one clean line.

    Writes are made in the caller's thread, or, after :meth:`write_behind`, in order on one
    background thread, beside the next round's training: a round's writes are kept until
    :meth:`hand_over` (called as the next round is sent: with the writer busy while the driver
    works, the driver's thread would wait for the GIL), then written while that round trains.
    With ``write_behind(every_s)``, a hand-over less than ``every_s`` after the previous one keeps
    the writes for a later one: the rows of the rounds kept meanwhile are appended as one part
    per table, and only the newest of the kept checkpoints is written (after those rows: the
    checkpoint on disk is never ahead of the rows). A killed run then loses at most the rounds
    finished in the last ``every_s`` seconds, which resuming trains again. :meth:`add_clients`
    first waits for everything handed over before it, so at most one hand-over waits to be
    written, and raises the error of a write that failed; :meth:`flush` writes and waits for all
    of it, and a final :meth:`status`, :meth:`finish` and :meth:`close` do too.
    """

    def __init__(self, folder: str | Path, config: dict, *, resume: bool = False, planned_rounds: int | None = None):
        self.folder = Path(folder)
        if not resume:
            self.folder.mkdir(parents=True, exist_ok=True)
            if any(self.folder.iterdir()):
                raise FileExistsError(f"{self.folder} is not empty")
        self.clients = _Table(self.folder, "clients", keep_rows=False)  # the driver keeps counts, not rows
        self._errors: dict[str, int] = {}
        self._rejected = 0  # client rows whose update was rejected as non-finite (their error counted in _errors too)
        self.divergence: dict | None = None  # {"round", "reason"} of the first round that diverged (the server sets it)
        # rounds are recorded in order: the latest row tells how far the run got
        self.rounds = _Table(self.folder, "rounds", keep_rows=False, keep_last=True)
        self.tasks = _Table(self.folder, "tasks", keep_rows=False)  # continual runs: accuracy per task per round
        self.started = time.time()
        self.planned_rounds = planned_rounds
        self.empty_rounds: list[int] = []
        self.allow_empty_rounds = False
        self._state = "running"
        self._extra: dict = {}
        self.notes: dict = {}  # figures the runtime adds to every status document (e.g. actors_replaced)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._writer: _Writer | None = None
        self._kept: list[_Kept] = []  # writes not handed over yet (write_behind)
        self._every_s = 0.0  # write_behind: the shortest time between two hand-overs
        self._next_hand_over = 0.0  # time.monotonic() from which a hand-over gives the writer its writes
        if not resume:
            (self.folder / "config.toml").write_text(tomli_w.dumps(config))
            (self.folder / "versions.json").write_text(json.dumps(package_versions(), indent=2))
        self.status("running")
        self._beat = threading.Thread(target=self._heartbeat, name="fedelastic-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write_status()
            except OSError:
                pass  # a full disk: the next round's write reports it

    def counts(self) -> dict:
        """Client rows, failed ones, rejected ones (non-finite updates) and the distinct error messages with their counts."""
        errors = dict(self._errors)
        total = self.clients.n_rows
        failed = sum(errors.values())
        return {
            "client_results": total,
            "clients_failed": failed - self._rejected,
            "clients_rejected": self._rejected,
            "failure_rate": failed / total if total else 0.0,
            "errors": errors,
            "empty_rounds": list(self.empty_rounds),
        }

    def _write_status(self) -> None:
        with self._lock:
            trained = [r["round"] for r in self.rounds.rows if r.get("round", 0) > 0]
            doc = {
                "status": self._state,
                "rounds_done": max(trained, default=0),
                "rounds_planned": self.planned_rounds,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": self.started,
                "heartbeat": time.time(),
                "elapsed_s": time.time() - self.started,
                **self.counts(),
                **self.notes,
                **self._extra,
            }
            _write_atomic(self.folder / "status.json", json.dumps(doc, indent=2))

    def write_behind(self, every_s: float = 0.0) -> None:
        """From now on, write on a background thread, handing writes over at most every ``every_s`` seconds (see the class docstring)."""
        if self._writer is None:
            self._writer = _Writer()
        self._every_s = every_s

    def write(self, job: Callable[[], None], *, newest_only: bool = False) -> None:
        """Run ``job`` (a write) now, or keep it for :meth:`hand_over` (:meth:`write_behind`).

        ``newest_only``: a job that makes an earlier kept ``newest_only`` job pointless (the
        checkpoint, which replaces the file): of those handed over together, the last one runs.
        """
        if self._writer is None:
            job()
        else:
            self._kept.append(_Kept(job=job, newest_only=newest_only))

    def _append(self, table: _Table, rows: list[dict], after: Callable[[list[dict]], None] = lambda rows: None) -> None:
        """Append ``rows`` to ``table`` now, or keep them for :meth:`hand_over`; ``after(rows)`` once they
        are written (and the status file, for round rows: it tells how far the run got)."""
        if self._writer is None:
            table.append(rows)
            after(rows)
            if table is self.rounds:
                self.status("running")
        else:
            self._kept.append(_Kept(table=table, rows=rows, after=after))

    def hand_over(self, *, force: bool = False) -> None:
        """Give the writes kept so far to the background writer, as one batch; unless ``force``,
        not before ``every_s`` (:meth:`write_behind`) has passed since the previous hand-over."""
        if self._writer is None or not self._kept:
            return
        now = time.monotonic()
        if not force and now < self._next_hand_over:
            return
        kept = self._kept
        self._writer.submit(lambda: self._write_batch(kept))
        self._kept = []  # after: a hand-over cut short by Ctrl-C is given again, and each write runs once (_Kept.done)
        self._next_hand_over = now + self._every_s

    def _write_batch(self, kept: list[_Kept]) -> None:
        """On the writer: each table's kept rows as one append, then the jobs (of the ``newest_only``
        ones only the last), each kept write once."""
        kept = [k for k in kept if not k.done]
        for k in kept:
            k.done = True
        tables: dict[_Table, list[_Kept]] = {}
        for k in kept:
            if k.table is not None:
                tables.setdefault(k.table, []).append(k)
        for table, chunks in tables.items():
            table.append([row for k in chunks for row in k.rows])
            for k in chunks:
                k.after(k.rows)
        if self.rounds in tables:
            self.status("running")  # once for the batch
        jobs = [k for k in kept if k.job is not None]
        last_newest = max((i for i, k in enumerate(jobs) if k.newest_only), default=-1)
        for i, k in enumerate(jobs):
            if not k.newest_only or i == last_newest:
                k.job()

    def flush(self) -> None:
        """Make every write kept or handed over; raise the error of one that failed."""
        self.flush_quietly()
        if self._writer is not None and self._writer.error is not None:
            raise self._writer.error

    def flush_quietly(self, failing: BaseException | None = None) -> None:
        """Make every write kept or handed over, stopping at one that fails (for a run that fails already).

        A failed write is not raised but logged to errors.log and noted on ``failing`` (the run's
        own error), so that neither is lost.
        """
        if self._writer is not None:
            self.hand_over(force=True)
            self._writer.wait()
            error = self._writer.error
            if failing is not None and error is not None and error is not failing:
                with suppress(OSError):
                    self.log_error(f"writing results failed:\n{type(error).__name__}: {error}")
                failing.add_note(f"writing results also failed: {type(error).__name__}: {error}")

    def status(self, state: str, **extra) -> None:
        if state != "running":
            self.flush_quietly()  # the final state describes every row written
        self._state, self._extra = state, extra
        if state != "running":
            self._stop.set()
        self._write_status()

    def finish(self, max_failure_rate: float = 0.0) -> dict:
        """Write the final status from what was recorded; returns the status document's counts and verdict.

        'diverged' (with ``divergence``: its first round and reason) if :attr:`divergence` is set,
        else 'completed_with_errors' if a client failed or was rejected or a round was empty, else 'completed'.
        """
        self.flush_quietly()
        counts = self.counts()
        errors = bool(counts["clients_failed"] or counts["clients_rejected"] or counts["empty_rounds"])
        state = "completed_with_errors" if errors else "completed"
        over = counts["failure_rate"] > max_failure_rate or bool(counts["empty_rounds"])
        extra: dict = {"max_failure_rate": max_failure_rate, "over_threshold": errors and over}
        if self.divergence is not None:
            state, extra["divergence"] = "diverged", dict(self.divergence)
        self.status(state, **extra)
        return {"status": state, **extra, **counts}

    def log_error(self, text: str) -> None:
        with open_no_link(self.folder / "errors.log", "a") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{_ANSI.sub('', text).rstrip()}\n")

    def add_clients(self, rows: list[dict]) -> None:
        for row in rows:
            if row.get("error"):
                self.log_error(f"round {row.get('round')} partition {row.get('partition_id')}:\n{row['error']}")
                row["error"] = one_line(row["error"])
        rows = [dict(row) for row in rows]  # the caller may go on using its rows

        def count(rows: list[dict]) -> None:
            for row in rows:
                if row.get("error"):
                    self._errors[row["error"]] = self._errors.get(row["error"], 0) + 1
                    self._rejected += row.get("status") == "rejected"

        if self._writer is not None:  # the writes handed over are done, or their error is raised
            if not self._every_s:  # async: several aggregations may come without a launch between them
                self.hand_over()
            self._writer.wait()
            if self._writer.error is not None:
                raise self._writer.error
        self._append(self.clients, rows, count)

    def reload(self, keep) -> None:
        """Resume: keep an earlier run's client and round rows where ``keep(row)``."""
        self._errors, self._rejected = {}, 0
        for row in self.clients.load(keep):
            if isinstance(row.get("error"), str) and row["error"]:
                self._errors[row["error"]] = self._errors.get(row["error"], 0) + 1
                self._rejected += row.get("status") == "rejected"
        self.rounds.load(keep)
        self.tasks.load(keep)  # continual runs: the accuracy matrix rows, also keyed by round

    def add_tasks(self, rows: list[dict]) -> None:
        self._append(self.tasks, [dict(row) for row in rows])

    def add_round(self, row: dict) -> None:
        def note_empty(rows: list[dict]) -> None:
            for row in rows:
                trained = (
                    row.get("clients", 0) - row.get("clients_failed", 0) - row.get("clients_not_fitting", 0)
                    - row.get("clients_no_steps", 0) - row.get("clients_rejected", 0)
                )
                if row.get("round", 0) > 0 and trained <= 0 and not self.allow_empty_rounds:
                    self.empty_rounds.append(int(row["round"]))

        self._append(self.rounds, [dict(row)], note_empty)  # a copy: a progress callback may change the caller's row

    def close(self) -> None:
        self.flush_quietly()
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        self._stop.set()


def plot_accuracy(rounds: pd.DataFrame, clients: pd.DataFrame, path: Path) -> None:
    """Accuracy against simulated time, and per device class the emulated train time per round.

    Draws what it can from any run: no rounds, no client rows, or NaN/inf/zero times leave an
    empty (labelled) panel rather than an error.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns

    timeline = "dispatch_s" in clients.columns and clients.dispatch_s.notna().any()
    fig, axes = plt.subplots(1, 3 if timeline else 2, figsize=(17 if timeline else 11, 4))
    finite = lambda col: np.isfinite(rounds.get(col, pd.Series(dtype=float)).astype(float))  # noqa: E731
    # NaN accuracy: a round that server.evaluate_every skipped
    curve = rounds[finite("sim_time_s") & finite("test_accuracy")] if len(rounds) else rounds
    if len(curve):
        sns.lineplot(data=curve, x="sim_time_s", y="test_accuracy", marker="o", ax=axes[0])
    acc = curve["test_accuracy"].astype(float) if len(curve) else pd.Series(dtype=float)
    acc = acc[np.isfinite(acc)]
    span = f" (range {acc.min():.4f} to {acc.max():.4f})" if len(acc) else ""
    axes[0].set(xlabel="simulated time (s)", ylabel="global test accuracy", title=f"accuracy vs simulated time{span}")
    axes[0].set_ylim(0.0, 1.02)  # from 0: a flat line near chance must not look like a collapse
    times = clients.get("emulated_train_time_s", pd.Series(dtype=float)).astype(float) if len(clients) else None
    ok = clients[np.isfinite(times) & (times > 0)] if times is not None else clients
    if len(ok):
        hue_order = sorted(ok.device_class.unique())  # the timeline colours classes in this order
        sns.barplot(data=ok, x="device", y="emulated_train_time_s", hue="device_class", hue_order=hue_order, ax=axes[1])
        axes[1].tick_params(axis="x", rotation=30)
        axes[1].set_yscale("log")
    else:
        axes[1].text(0.5, 0.5, "no client trained", ha="center", va="center", transform=axes[1].transAxes)
    axes[1].set(xlabel="", ylabel="emulated train time per round (s)", title="per-device train time")
    if timeline:
        plot_timeline(rounds, clients, axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(rounds: pd.DataFrame, clients: pd.DataFrame, ax, first_rounds: int = 3) -> None:
    """A Gantt chart of the simulated clock over the first rounds: one line per client.

    Each trip shows its download (light), local training (dark) and upload (light); trips whose
    update did not count are hatched. Dotted lines mark the aggregations.
    """
    from matplotlib.patches import Patch

    end = float(rounds.loc[rounds["round"] <= first_rounds, "sim_time_s"].max())
    shown = clients[clients.dispatch_s.notna() & (clients.dispatch_s < end)]
    ids = sorted(shown.partition_id.unique())
    colors = {c: f"C{i}" for i, c in enumerate(sorted(shown.device_class.unique()))}
    for _, r in shown.iterrows():
        y = ids.index(r.partition_id)
        stop = r.arrival_s if r.arrival_s == r.arrival_s else r.finish_s  # NaN arrival: it went offline
        hatch = None if r.counted else "///"
        phases = ((r.dispatch_s, r.start_s, 0.35), (r.start_s, r.finish_s, 0.9), (r.finish_s, stop, 0.35))
        for a, b, alpha in phases:
            if b > a:
                ax.barh(y, b - a, left=a, height=0.7, color=colors[r.device_class], alpha=alpha, hatch=hatch)
    for t in rounds.loc[(rounds["round"] > 0) & (rounds.sim_time_s <= end), "sim_time_s"]:
        ax.axvline(t, color="k", linestyle=":", linewidth=0.8)
    labels = dict(zip(shown.partition_id, shown.device))
    ax.set_yticks(range(len(ids)), [f"{p} {labels[p]}" for p in ids], fontsize=7)
    ax.set(xlabel="simulated time (s)", title=f"timeline of the first {first_rounds} aggregations")
    handles = [Patch(color=c, label=k) for k, c in colors.items()] + [
        Patch(fill=False, hatch="///", label="not counted")
    ]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
