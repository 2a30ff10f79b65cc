"""A Ray cluster of several nodes on this machine, started with Ray's own ``ray start``.

:class:`LocalCluster` starts a head (``ray start --head`` on a free port) and worker nodes
(``ray start --address``), each with the CPUs asked for, in a temporary folder of its own: the
cluster's address file is written there, not in ``/tmp/ray``, so a plain ``ray.init()`` elsewhere
on the machine does not join it. :meth:`LocalCluster.stop` kills exactly the processes of this
cluster (those naming its folder, and their descendants): ``ray stop`` would stop every Ray on the
machine. Used by the tests and ``benchmarks/cluster_ratio.py``; a real cluster is started by its
operator (see the cluster how-to).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .orphans import descendants, start_time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ancestors() -> set[int]:
    """This process and its ancestors."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def _ray_cli(*args: str) -> list[str]:
    """Ray's CLI run by this interpreter (a venv's ``bin/ray`` need not be on PATH)."""
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()", *args]


class LocalCluster:
    """A head and ``len(worker_cpus)`` worker nodes on this machine; a context manager that stops them."""

    def __init__(self, head_cpus: int = 1, worker_cpus: tuple[int, ...] = (1,)):
        self.head_cpus, self.worker_cpus = head_cpus, worker_cpus
        self.folder = tempfile.mkdtemp(prefix="fe-ray-")  # short: Ray's socket paths must fit in 107 bytes
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def _start(self, *args: str) -> None:
        common = ("--disable-usage-stats", "--include-dashboard=false") if "--head" in args else ()
        done = subprocess.run(  # noqa: S603 (Ray's CLI, our arguments)
            _ray_cli("start", *args, f"--temp-dir={self.folder}", "--node-ip-address=127.0.0.1", *common),
            capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_ADDRESS": ""},
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")

    def start(self) -> LocalCluster:
        try:
            self._start("--head", f"--port={self.port}", f"--num-cpus={self.head_cpus}")
            for cpus in self.worker_cpus:
                self._start(f"--address={self.address}", f"--num-cpus={cpus}")
        except BaseException:
            self.stop()
            raise
        return self

    def processes(self) -> dict[int, str]:
        """pid -> start time of every live process of this cluster."""
        roots, mine = [], _ancestors()  # not this process, nor a shell that named the folder to start it
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in mine:
                try:
                    cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if self.folder.encode() in cmd:
                    roots.append(int(entry))
        return descendants(roots)

    def stop(self) -> None:
        """Kill every process of this cluster (and wait until none is left), then remove its folder."""
        for _ in range(50):
            procs = self.processes()
            if not procs:
                break
            for pid, started in procs.items():
                if start_time(pid) == started:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.1)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
