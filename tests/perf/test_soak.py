"""A short soak (150 rounds, in-process): the driver's memory and open descriptors do not grow with
the rounds. The 2,000-round soak, in-process and on Ray, with write times: ``benchmarks/soak.py``
(``benchmarks/studies/soak.md``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.perf


def test_a_long_run_holds_its_memory_and_descriptors(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--rounds", "150", "--early", "50",
           "--backends", "inprocess", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [s] = json.loads(out.read_text())["summary"]
    assert s["status"] == "completed" and s["rounds"] == 150
    assert abs(s["rss_change"]) < 0.05, s  # RSS at round 150 within 5% of round 50's
    assert s["fds"][1] <= s["fds"][0] and s["max_fds"] <= s["fds"][0] + 2, s  # no descriptor leak
