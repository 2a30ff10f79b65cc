"""The Ray processes a run starts are recorded in its folder; the next run cleans up after a killed one (only ours)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedelastic.runtime import orphans
from tests.support import ROOT, small_scenario_dict


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # noqa: S603


def _write(run_dir: Path, driver: dict, procs: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / orphans.RECORD).write_text(json.dumps({"driver": driver, "processes": procs}))


def _dead_driver() -> dict:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603
    gone.wait()
    return {"host": socket.gethostname(), "pid": gone.pid, "started": "1"}


def test_a_dead_drivers_recorded_processes_are_killed_and_a_reused_pid_is_spared(tmp_path):
    ours, other = _sleeper(), _sleeper()
    try:
        procs = {str(ours.pid): orphans.start_time(ours.pid), str(other.pid): "12345"}  # other: a PID reused since
        _write(tmp_path / "runs" / "tiny" / "r1", _dead_driver(), procs)
        assert orphans.clean_all_leftovers(tmp_path / "runs") == [ours.pid]
        assert ours.wait(timeout=60) == -signal.SIGKILL
        assert other.poll() is None
        assert not (tmp_path / "runs" / "tiny" / "r1" / orphans.RECORD).exists()
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


@pytest.mark.parametrize("whose", ["live driver", "other host"])
def test_a_live_drivers_or_another_hosts_processes_are_left_alone(tmp_path, whose):
    proc = _sleeper()
    try:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": orphans.start_time(os.getpid())}
        driver = me if whose == "live driver" else {**_dead_driver(), "host": "elsewhere"}
        _write(tmp_path / "run", driver, {str(proc.pid): orphans.start_time(proc.pid)})
        assert orphans.clean_leftovers(tmp_path / "run") == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_record_grows_for_its_driver_and_starts_over_for_another(tmp_path):
    orphans.record(tmp_path, {1: "a"})
    orphans.record(tmp_path, {2: "b"})
    assert json.loads((tmp_path / orphans.RECORD).read_text())["processes"] == {"1": "a", "2": "b"}
    doc = json.loads((tmp_path / orphans.RECORD).read_text())
    doc["driver"]["pid"] += 1
    (tmp_path / orphans.RECORD).write_text(json.dumps(doc))
    orphans.record(tmp_path, {3: "c"})
    assert json.loads((tmp_path / orphans.RECORD).read_text())["processes"] == {"3": "c"}


@pytest.mark.ray
@pytest.mark.slow
def test_after_a_kill_9_of_a_ray_driver_the_next_run_leaves_no_orphan(tmp_path):
    import tomli_w

    from fedelastic.fl.runner import run_scenario
    from fedelastic.scenario import parse_scenario

    raw = small_scenario_dict(
        tmp_path, server={"rounds": 50}, simulation={"backend": "ray", "num_cpus_per_client": 1, "write_every_s": 0}
    )
    (tmp_path / "s.toml").write_text(tomli_w.dumps(raw))
    cli = [sys.executable, "-c", "from fedelastic.cli import main; raise SystemExit(main())"]
    driver = subprocess.Popen([*cli, "run", str(tmp_path / "s.toml")], cwd=ROOT, stdout=subprocess.DEVNULL)  # noqa: S603
    try:
        record = _wait_for_record(tmp_path / "runs" / "tiny", driver)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    procs = json.loads(record.read_text())["processes"]
    assert len(procs) >= 3  # the GCS, the raylet, Ray's agents and workers were recorded
    run_scenario(
        parse_scenario(
            {**raw, "simulation": {"backend": "inprocess", "write_every_s": 0}, "server": {"rounds": 1}}, src="s.toml"
        )
    )
    assert orphans.alive({int(p): s for p, s in procs.items()}) == {}  # the next run left none of them running
    assert not record.exists()


def _wait_for_record(runs: Path, driver: subprocess.Popen) -> Path:
    """The Ray record of the driver's run once its first round is done (polled; the driver's exit ends the wait)."""
    while driver.poll() is None:
        found = [p for p in runs.glob(f"*/{orphans.RECORD}") if (p.parent / "rounds.csv").is_file()]
        if found and len((found[0].parent / "rounds.csv").read_text().splitlines()) >= 3:  # header, round 0, round 1
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"the run ended (exit {driver.returncode}) before its first round")
