"""A run's ``status.json`` read back, its final states, and error texts cut to one clean line.

:func:`read_status` reports a ``running`` run whose process is gone, or whose heartbeat (rewritten
every :data:`HEARTBEAT_S` while a run is alive) stopped, as ``dead``; an unreadable or malformed
file reads ``unreadable`` with the fault. :func:`one_line` keeps the innermost cause of a
Flower/Ray traceback.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

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
