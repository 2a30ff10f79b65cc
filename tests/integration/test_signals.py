"""A run stopped by a signal (Ctrl-C, or SIGTERM from a scheduler or ``timeout``) ends like a run
stopped by the user: the finished rounds on disk, ``status.json`` 'failed' with the reason, the
documented exit code (130 for SIGINT, 143 for SIGTERM), and no abort at interpreter exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import tomli_w

from fedelastic.cli import main
from fedelastic.results.recorder import read_status
from tests.support import small_scenario_dict

CASES = {"SIGINT": (130, "interrupted (KeyboardInterrupt)"), "SIGTERM": (143, "stopped by SIGTERM")}


def _scenario(tmp: Path, rounds: int, write_every_s: float, backend: str = "inprocess") -> Path:
    raw = small_scenario_dict(
        tmp, fleet={"raspberry_pi_4": 2, "jetson_nano": 2}, data={"partitioner": "iid"},
        model={"name": "small_cnn", "options": {}}, train={"strategy": "full", "local_epochs": 1, "max_steps": 8},
        server={"rounds": rounds}, simulation={"backend": backend, "write_every_s": write_every_s},
    )  # fmt: skip
    raw["fleet"] = {"raspberry_pi_4": 2, "jetson_nano": 2}  # replaced, not merged
    path = tmp / "scn.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _start(path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each round's progress line as it is printed
    cli = [sys.executable, "-m", "fedelastic.cli", "run", str(path), "--run-id", "stopped"]
    # Ctrl-C's default action in the child: a shell without job control starts background commands
    # with SIGINT ignored, and the child would inherit that (the run then finishes, exit 0)
    return subprocess.Popen(
        cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def _stop_after_round(proc: subprocess.Popen, n: int, signame: str) -> tuple[int, str]:
    """Send ``signame`` once the progress line of round ``n`` is printed; the exit code and stderr."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.split()[:2] == ["round", str(n)]:
            break
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate()
    return proc.returncode, err


def _assert_stopped(run_dir: Path, code: int, err: str, signame: str, at_least: int) -> int:
    expected_code, reason = CASES[signame]
    assert code == expected_code, err
    assert "terminate called" not in err and "Traceback" not in err, err
    assert f"continue with `fedelastic run --resume {run_dir}`" in err, err  # the folder itself, named
    status = read_status(run_dir)
    assert status["status"] == "failed" and status["error"] == reason, status
    rounds = pd.read_csv(run_dir / "rounds.csv")["round"].tolist()
    assert rounds == list(range(len(rounds))) and rounds[-1] >= at_least, rounds
    assert status["rounds_done"] == rounds[-1]
    clients = pd.read_csv(run_dir / "clients.csv")
    assert len(clients) == 4 * rounds[-1] and clients["round"].max() == rounds[-1]  # 4 clients a round, all written
    return rounds[-1]


@pytest.mark.slow
@pytest.mark.parametrize("signame", list(CASES))
def test_a_signal_after_round_2_writes_the_rounds_marks_the_run_and_exits_with_its_code(tmp_path, signame):
    path = _scenario(tmp_path, rounds=8, write_every_s=0)
    code, err = _stop_after_round(_start(path), 2, signame)
    run_dir = tmp_path / "runs" / "tiny" / "stopped"
    _assert_stopped(run_dir, code, err, signame, at_least=2)
    assert main(["run", "--resume", str(run_dir)]) == 0  # a stopped run resumes
    assert pd.read_csv(run_dir / "rounds.csv")["round"].tolist() == list(range(9))


@pytest.mark.slow
def test_sigterm_writes_the_rounds_kept_for_a_later_write(tmp_path):
    """With ``write_every_s = 3600`` the rounds since the first write are only in memory: SIGTERM writes them."""
    path = _scenario(tmp_path, rounds=30, write_every_s=3600)
    code, err = _stop_after_round(_start(path), 4, "SIGTERM")
    _assert_stopped(tmp_path / "runs" / "tiny" / "stopped", code, err, "SIGTERM", at_least=4)


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_on_ray_writes_the_rounds_and_exits_143(tmp_path):
    """``ray.init`` sets its own SIGTERM handler (``sys.exit``); the command takes SIGTERM back after it."""
    path = _scenario(tmp_path, rounds=8, write_every_s=0, backend="ray")
    code, err = _stop_after_round(_start(path), 2, "SIGTERM")
    _assert_stopped(tmp_path / "runs" / "tiny" / "stopped", code, err, "SIGTERM", at_least=2)
