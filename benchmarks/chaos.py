"""Chaos: kill the driver with SIGKILL at random instants, resume, kill again, and check that the
final tables equal those of an uninterrupted run of the same seed (but the host-time columns).

Each *episode* starts a run (``fedelastic run SCENARIO --run-id chaos-N``) and kills it after a
random time, then resumes it (``fedelastic run --resume``) and kills that too, up to 8 times,
and then lets the last resume finish. A kill may land anywhere: while Python imports,
before the run folder is filled, between a round's rows and its checkpoint, while a resume
reloads the tables, on Ray while the cluster starts. Instants are drawn uniformly over ``span``,
the uninterrupted run's wall time (a resume's over its first half, where its start-up and the
reload of the tables are); an attempt that finishes first ends its episode, and episodes
follow each other until the case has its ``--kills`` (``--ray-kills``). A start killed before its folder is filled
is started again with the same id. The seed fixes every instant: a failure replays with the same
``--seed``.

    python benchmarks/chaos.py                         # 110 kills over the four cases
    python benchmarks/chaos.py --load 2                # the same with a second copy running at once
    python benchmarks/chaos.py --cases inprocess-sync --kills 5 --seed 7   # replay one

Writes ``benchmarks/results/chaos[_load].json``; the page is ``benchmarks/studies/chaos.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import tomli_w

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def scenario(tmp: Path, backend: str, strategy: str, rounds: int = 6) -> dict:
    """The fault tests' four-client scenario (a Pi 4 pair, a Nano, an STM32)."""
    return {
        "name": "chaos",
        "seed": 3,
        "output_dir": str(tmp / "runs"),
        "fleet": {"raspberry_pi_4": 2, "jetson_nano": 1, "stm32h743": 1},
        "data": {"partitioner": "dirichlet", "alpha": 0.5},
        "model": {"name": "small_cnn", "options": {"width": 8}},
        "train": {"strategy": strategy, "batch_size": 16, "max_steps": 3},
        "server": {"rounds": rounds},
        # rounds written one by one, so kills land between every kind of write
        "simulation": {"backend": backend, "write_every_s": 0},
    }


CASES = {
    "inprocess-sync": ("inprocess", "full"),
    "inprocess-static_elastic": ("inprocess", "static_elastic"),
    "ray-sync": ("ray", "full"),
    "ray-static_elastic": ("ray", "static_elastic"),
}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedelastic.cli", *args]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def tables_equal(a: Path, b: Path) -> str:
    """'' if run folders ``a`` and ``b`` hold equal tables (but host-time columns), else what differs."""
    for name in ("rounds", "clients"):
        frames = []
        for folder in (a, b):
            if not (folder / f"{name}.parquet").exists():
                return f"{folder / name}.parquet is missing"
            frame = pd.read_parquet(folder / f"{name}.parquet")
            frames.append(frame.drop(columns=[c for c in frame.columns if c.startswith("host_")]))
        try:
            pd.testing.assert_frame_equal(*frames)
        except AssertionError as exc:
            return f"{name}: {str(exc).splitlines()[0]}"
        texts = []
        for folder in (a, b):
            frame = pd.read_csv(folder / f"{name}.csv")
            texts.append(frame.drop(columns=[c for c in frame.columns if c.startswith("host_")]).to_csv(index=False))
        if texts[0] != texts[1]:
            return f"{name}.csv differs"
    return ""


def _status(run_dir: Path) -> str:
    path = run_dir / "status.json"
    return json.loads(path.read_text()).get("status", "?") if path.exists() else "missing"


def _rounds_done(run_dir: Path) -> int:
    path = run_dir / "status.json"
    return int(json.loads(path.read_text()).get("rounds_done") or 0) if path.exists() else 0


def episode(path: Path, run_dir: Path, reference: Path, kills: int, span_s: float, rng: random.Random, log: Path) -> dict:
    """One run killed ``kills`` times at drawn instants, resumed after each, then finished."""
    done = {"kills": 0, "kills_in_resume": 0, "kills_before_folder": 0, "kills_with_rounds": 0, "resumes": 0,
            "restarts": 0}
    start = time.perf_counter()
    code = 0
    while True:
        if _status(run_dir) == "completed":  # killed after its final status (while drawing the figure): done
            break
        resuming = (run_dir / "config.toml").exists()
        if resuming:
            cmd, done["resumes"] = _cli("run", "--resume", str(run_dir)), done["resumes"] + 1
        else:
            cmd = _cli("run", str(path), "--run-id", run_dir.name)
            done["restarts"] += run_dir.exists()
        proc = _start(cmd, log)
        if done["kills"] < kills:
            # a resume is killed in its first half (its start-up and the reload, where its windows are)
            instant = span_s * rng.random() * (0.5 if resuming else 1.0)
            try:
                code = proc.wait(timeout=instant)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                done["kills"] += 1
                done["kills_in_resume"] += resuming
                done["kills_before_folder"] += not (run_dir / "config.toml").exists()
                done["kills_with_rounds"] += _rounds_done(run_dir) > 0
                continue
        else:
            code = proc.wait(timeout=900)
        break
    status = _status(run_dir)
    wrong = "" if code == 0 and status == "completed" else f"exit {code}, status {status}"
    wrong = wrong or tables_equal(run_dir, reference)
    return {**done, "exit": code, "status": status, "tables_equal": not wrong, "problem": wrong,
            "wall_s": time.perf_counter() - start}


def run_case(name: str, kills: int, seed: int, work: Path, per_episode: int = 8) -> dict:
    """Episodes of case ``name`` until ``kills`` kills landed (at most ``per_episode`` in one)."""
    backend, strategy = CASES[name]
    tmp = work / name
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "chaos.toml"
    path.write_text(tomli_w.dumps(scenario(tmp, backend, strategy)))
    log = tmp / "log.txt"
    start = time.perf_counter()
    code = _start(_cli("run", str(path), "--run-id", "reference"), log).wait(timeout=900)
    span = time.perf_counter() - start
    reference = tmp / "runs" / "chaos" / "reference"
    if code != 0:
        raise SystemExit(f"{name}: the uninterrupted run failed (exit {code}); see {log}")
    out: list[dict] = []
    while sum(e["kills"] for e in out) < kills:
        e = len(out)
        rng = random.Random(f"{seed}/{name}/{e}")  # a replay with the same --seed draws the same instants
        run_dir = tmp / "runs" / "chaos" / f"chaos-{e}"
        left = kills - sum(x["kills"] for x in out)
        out.append(episode(path, run_dir, reference, min(per_episode, left), span, rng, log))
        r = out[-1]
        print(f"{name} episode {e}: {r['kills']} kills ({r['kills_in_resume']} in a resume, "
              f"{r['kills_before_folder']} before the folder), tables equal {r['tables_equal']} {r['problem']} "
              f"({r['wall_s']:.0f} s)", flush=True)
    return {"case": name, "reference_wall_s": span, "episodes": out}


def summarise(cases: list[dict]) -> dict:
    eps = [e for c in cases for e in c["episodes"]]
    return {
        "kills": sum(e["kills"] for e in eps),
        "kills_in_resume": sum(e["kills_in_resume"] for e in eps),
        "kills_before_folder": sum(e["kills_before_folder"] for e in eps),
        "kills_with_rounds": sum(e["kills_with_rounds"] for e in eps),
        "resumes": sum(e["resumes"] for e in eps),
        "episodes": len(eps),
        "tables_equal": sum(e["tables_equal"] for e in eps),
        "wall_s": sum(e["wall_s"] for e in eps),
        "problems": [e["problem"] for e in eps if e["problem"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--kills", type=int, default=40, help="kills per in-process case (default %(default)s)")
    ap.add_argument("--ray-kills", type=int, default=15, help="kills per Ray case (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load", type=int, default=1, help="copies of this harness at once (default %(default)s)")
    ap.add_argument("--out", default="", help="result file (default benchmarks/results/chaos[_load].json)")
    args = ap.parse_args()
    out = Path(args.out) if args.out else RESULTS / ("chaos_load.json" if args.load > 1 else "chaos.json")
    others = []
    for k in range(1, args.load):  # the background copies: same cases, other seeds, their own folders
        cmd = [sys.executable, __file__, "--cases", *args.cases, "--ray-kills", str(args.ray_kills), "--kills",
               str(args.kills), "--seed", str(args.seed + 1000 * k), "--out", str(out.with_suffix(f".copy{k}.json"))]
        others.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            run_case(name, args.ray_kills if name.startswith("ray") else args.kills, args.seed, Path(tmp))
            for name in args.cases
        ]
    copies = []
    for k, proc in enumerate(others, start=1):
        proc.wait()
        copy = out.with_suffix(f".copy{k}.json")
        copies.append(json.loads(copy.read_text()))
        copy.unlink()
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/chaos.py " + " ".join(sys.argv[1:]),
        "load": args.load,
        "load_average_1m_at_end": os.getloadavg()[0],
        "wall_s": time.perf_counter() - start,
        "by_case": {c["case"]: summarise([c]) for c in cases},
        "total": summarise(cases),
        "copies": [c["total"] for c in copies],
        "cases": cases,
    }
    out.write_text(json.dumps(doc, indent=1))
    t = doc["total"]
    print(f"{t['kills']} kills ({t['kills_in_resume']} in a resume, {t['kills_before_folder']} before the folder was "
          f"filled, {t['kills_with_rounds']} with rounds on disk), {t['resumes']} resumes, {t['tables_equal']}/{t['episodes']} episodes with equal tables, "
          f"{doc['wall_s']:.0f} s; copies: {[c['tables_equal'] for c in doc['copies']]}")


if __name__ == "__main__":
    main()
