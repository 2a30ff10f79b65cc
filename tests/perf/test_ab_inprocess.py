"""benchmarks/ab_inprocess.py: a base revision and a candidate, each run from its own tree.

Two short runs each (1 pair, 5 rounds of the in-process peers workload): the working tree
against HEAD ends on one final model; a candidate patched to average differently does not, and
the tool says so. They need git and this repository's history (a clean clone has both).
"""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = [
    pytest.mark.perf,
    pytest.mark.skipif(
        shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and this repository's history"
    ),
]


def _ab(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "ab.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ab_inprocess.py"), "--pairs", "1", "--rounds", "5", "--out", str(out)]
    done = subprocess.run([*cmd, *args], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _changed(report: dict) -> bool:
    statuses = [r["status"] for side in report["runs"].values() for r in side]
    assert statuses == ["completed"] * 2
    return not report["same_final_model"]


def test_the_working_tree_against_head_ends_on_one_model(tmp_path):
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "fedelastic"], capture_output=True, text=True)
    if dirty.stdout.strip():
        pytest.skip("fedelastic/ has uncommitted changes: they may change results")
    report = _ab(tmp_path)
    assert not _changed(report)
    assert {"round_ms", "round_mean_ms", "train_wall_ms", "train_cpu_ms", "gap_ms", "run_wall_s"} <= set(report["summary"])
    assert all(r["round_ms"] > 0 and r["train_cpu_ms"] > 0 for side in report["runs"].values() for r in side)


@pytest.mark.ray
def test_the_ray_backend_runs_both_trees_and_compares_their_models(tmp_path):
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "fedelastic"], capture_output=True, text=True)
    if dirty.stdout.strip():
        pytest.skip("fedelastic/ has uncommitted changes: they may change results")
    report = _ab(tmp_path, "--backend", "ray")
    assert report["backend"] == "ray" and not _changed(report)
    assert set(report["summary"]) == {"round_ms", "round_mean_ms", "run_wall_s", "startup_s", "tree_cpu_s"}
    for r in (r for side in report["runs"].values() for r in side):
        assert 0 < r["startup_s"] < r["run_wall_s"] and r["tree_cpu_s"] > 0


def test_a_patch_that_changes_the_average_is_reported(tmp_path):
    path = "fedelastic/sim/aggregate.py"
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{path}"], capture_output=True, text=True, check=True).stdout
    line = "        new_state[name] = merged.astype(current.dtype, copy=False)\n"
    assert line in old
    new = old.replace(line, line.replace("merged.astype", "(merged * 1.001).astype"))
    patch = tmp_path / "scaled.diff"
    patch.write_text("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")))
    report = _ab(tmp_path, "--patch", str(patch))
    assert _changed(report)
    assert report["candidate"] == str(patch)
