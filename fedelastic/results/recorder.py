"""Results that reach disk as the run goes (:class:`Recorder`), and the end-of-run report.

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

import json
import os
import platform
import queue
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomli_w

# the pieces of a run folder, re-exported here: this module's API
from .plots import plot_accuracy as plot_accuracy
from .plots import plot_timeline as plot_timeline
from .status import _ANSI, HEARTBEAT_S, one_line
from .status import FINAL_STATES as FINAL_STATES
from .status import read_status as read_status
from .tables import _Table, _write_atomic, fresh_folder, open_no_link
from .tables import fresh as fresh
from .tables import warm_up as warm_up

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
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent.parent
        )
        out["git"] = sha.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        out["git"] = "unknown"
    return out


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

    def __init__(
        self,
        folder: str | Path,
        config: dict,
        *,
        resume: bool = False,
        planned_rounds: int | None = None,
        files: dict[str, str] | None = None,
    ):
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
        if resume:
            self.status("running")
        else:
            self._fill(config, files or {})
        self._beat = threading.Thread(target=self._heartbeat, name="fedelastic-heartbeat", daemon=True)
        self._beat.start()

    def _fill(self, config: dict, files: dict[str, str]) -> None:
        """Fill the new, empty run folder whole or not at all: ``config.toml``, ``versions.json``,
        ``files`` (name -> text) and the first ``status.json`` are written into a hidden folder
        beside it, which is then renamed onto the empty one (a rename may replace an empty folder,
        atomically). A start killed before the rename leaves the folder empty, which a new start
        with the same ``--run-id`` takes (:func:`fedelastic.fl.runner.new_run_dir`)."""
        staging = fresh_folder(self.folder.with_name(f".{self.folder.name}.new"))
        final, self.folder = self.folder, staging
        try:
            (staging / "config.toml").write_text(tomli_w.dumps(config))
            (staging / "versions.json").write_text(json.dumps(package_versions(), indent=2))
            for name, text in files.items():
                (staging / name).write_text(text)
            self.status("running")
        finally:
            self.folder = final
        os.rename(staging, final)

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
