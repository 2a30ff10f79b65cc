"""The Ray processes a run started, recorded in its folder, and the clean-up of those a killed run left.

A run that starts its own local Ray cluster writes ``ray_processes.json`` in its run folder: the
driver's PID and start time, and the PID and start time of every process of the cluster (the
GCS, the raylet, Ray's agents, the workers), rewritten as the cluster grows. A run that ends
normally shuts its cluster down and removes the file. After a kill -9 of the driver, Ray's agents
may outlive it (they are reparented to init and keep running); the next run, or ``--resume`` of
that run, calls :func:`clean_leftovers`, which kills the recorded processes still running, and
only those: same host, a dead driver, and each process's PID *and* start time as recorded (a PID
the system has since reused for another process is left alone).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

RECORD = "ray_processes.json"


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, as text); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def descendants(roots: list[int]) -> dict[int, str]:
    """pid -> start time of every live descendant of ``roots`` (and the roots); {} without /proc."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # an exited process not yet reaped is gone already
            children.setdefault(int(fields[1]), []).append(int(entry))
            started[int(entry)] = fields[19]
    found: dict[int, str] = {}
    stack = [r for r in roots if r in started]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = started[pid]
            stack.extend(children.get(pid, ()))
    return found


def alive(procs: dict[int, str]) -> dict[int, str]:
    """The processes of ``procs`` still running (same pid and start time, not a zombie)."""
    return {pid: start for pid, start in procs.items() if start_time(pid) == start}


def reap(procs: dict[int, str], wait_s: float) -> None:
    """Wait up to ``wait_s`` for the processes of ``procs`` to exit, then kill those still running."""
    deadline = time.monotonic() + wait_s
    while (procs := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def record(run_dir: Path, procs: dict[int, str]) -> None:
    """Write (or extend) ``run_dir``'s record of the Ray processes this driver started."""
    path = Path(run_dir) / RECORD
    known = _read(path)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": start_time(os.getpid())}
    mine = known.get("driver") == me
    merged = {**(known.get("processes", {}) if mine else {}), **{str(p): s for p, s in procs.items()}}
    tmp = path.with_name(RECORD + ".tmp")
    tmp.write_text(json.dumps({"driver": me, "processes": merged}))
    os.replace(tmp, path)


def stop_recorded(run_dir: Path, wait_s: float = 3.0) -> None:
    """At the end of this driver's run: wait up to ``wait_s`` for the recorded processes to exit
    (Ray's workers exit on their own a moment after ``ray.shutdown``), kill those still running,
    and remove the record. Only a record of this driver is acted on."""
    path = Path(run_dir) / RECORD
    doc = _read(path)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": start_time(os.getpid())}
    procs = doc.get("processes")
    if doc.get("driver") == me and isinstance(procs, dict):
        reap({int(p): s for p, s in procs.items() if str(p).isdigit()}, wait_s)
    forget(run_dir)


def forget(run_dir: Path) -> None:
    """Remove the record (the run shut its cluster down)."""
    try:
        (Path(run_dir) / RECORD).unlink()
    except OSError:
        pass


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def clean_leftovers(run_dir: Path) -> list[int]:
    """Kill the recorded Ray processes of ``run_dir``'s run if its driver is dead; returns their PIDs.

    Nothing is killed when the record is from another host, when its driver still runs, or for a
    process whose start time differs from the recorded one. The record is removed afterwards.
    """
    path = Path(run_dir) / RECORD
    doc = _read(path)
    driver, procs = doc.get("driver"), doc.get("processes")
    if not isinstance(driver, dict) or not isinstance(procs, dict) or driver.get("host") != socket.gethostname():
        return []
    if isinstance(driver.get("pid"), int) and start_time(driver["pid"]) == driver.get("started"):
        return []  # the driver still runs: its cluster is in use
    killed = []
    for pid, started in procs.items():
        if str(pid).isdigit() and start_time(int(pid)) == started:
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except OSError:
                pass
    forget(run_dir)
    return killed


def clean_all_leftovers(output_dir: Path) -> list[int]:
    """:func:`clean_leftovers` for every run folder under ``output_dir`` (``<name>/<run id>``) holding a record."""
    killed: list[int] = []
    for path in Path(output_dir).glob(f"*/*/{RECORD}"):
        killed += clean_leftovers(path.parent)
    return killed
