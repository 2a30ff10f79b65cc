"""Two versions of fedelastic on the peers workload, alternated in fresh processes (issue 10).

    python benchmarks/ab_inprocess.py                          # this working tree against HEAD, 8 pairs
    python benchmarks/ab_inprocess.py --backend ray --rounds 60   # the same on Ray (the default backend)
    python benchmarks/ab_inprocess.py --base d2d4f14 --patch benchmarks/data/patches/replies_periodic.diff \
        --pairs 10 --rounds 60 --out benchmarks/results/ab.json

``base`` is a git revision of this repository (default ``HEAD``), checked out into a temporary
worktree; ``candidate`` is this working tree as it is, or, with ``--patch``, the base with the
patch applied (so that a change that was tried and not kept can be measured again by one
command). Each pair runs base and candidate one after the other (the order alternating between
pairs), each in a fresh process importing fedelastic from its own tree (``PYTHONPATH``), on
benchmarks/peers.py's workload (200 Dirichlet clients on digits, 50 a round, its 6k-parameter
CNN, batch 16, 1 epoch, SGD lr 0.05, strategy "full") for ``--rounds`` rounds, on ``--backend``
``inprocess`` (the default here) or ``ray`` (fedelastic's default, as users run it).

Per run, over rounds 3 to the last but one (medians): the round (progress row to progress row;
also its mean, which is what throughput is made of: a change that gathers work into a few rounds,
such as writing results every ``write_every_s``, shortens the median round more than the mean).
Per run, whole: the process's wall (launch to exit, start-up and shut-down included), its
start-up (launch to round 0's row) and the CPU time of its process tree (Ray's daemons and actors
descend from it) from round 0's row to the last round's. In process only (the training runs in
the driver, where it can be timed): the cohort's training call (``train_cohort``: wall and the
training thread's CPU time) and the gap between two training calls (the driver's work between
rounds). Every run uses torch on 1 thread and the niceness of this process. The report gives each side's
median and the median of the paired differences (candidate - base) with how many pairs the
candidate was shorter in: on this shared 2-core machine runs of the same code differ by up to
10%, pairs and their medians by much less. Both sides must end on the same final model (SHA-256
of the checkpoint's weights): a candidate that changes results is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
COMMON = ("round_ms", "round_mean_ms", "run_wall_s", "startup_s", "tree_cpu_s")
FIGURES = {"inprocess": (*COMMON, "train_wall_ms", "train_cpu_ms", "gap_ms"), "ray": COMMON}


def timed_training(rounds: int) -> Callable[[], dict]:
    """Times every in-process ``train_cohort`` call; the returned function gives their medians."""
    import numpy as np

    import fedelastic.fl.cohort as cohort

    calls: list[tuple[float, float, float]] = []  # (start, end, thread CPU) of each training call
    train = cohort.train_cohort

    def timed(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return train(*args, **kwargs)
        finally:
            calls.append((start, time.perf_counter(), time.thread_time() - cpu))

    cohort.train_cohort = timed

    def figures() -> dict:
        got = calls[-rounds:]  # the start-up query trains nothing; one call a round
        steady = slice(2, rounds - 1)
        gaps = [got[i + 1][0] - got[i][1] for i in range(rounds - 1)]
        return {
            "train_wall_ms": statistics.median(e - s for s, e, _ in got[steady]) * 1e3,
            "train_cpu_ms": statistics.median(c for _, _, c in got[steady]) * 1e3,
            "gap_ms": statistics.median(np.array(gaps)[steady]) * 1e3,
        }

    return figures


def worker(rounds: int, backend: str) -> dict:
    """One run on ``backend`` in this process (fedelastic from PYTHONPATH); per-round medians."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE.parent))
    import peers
    from measuring import tree_usage

    import fedelastic
    from fedelastic import api

    training = timed_training(rounds) if backend == "inprocess" else None
    stamps: list[float] = []  # epoch seconds of each progress row (round 0's row is the initial evaluation)
    cpu: list[float] = []

    def progress(row: dict) -> None:
        stamps.append(time.time())
        if row["round"] in (0, rounds):  # Ray's processes are still alive at the last round's row
            cpu.append(tree_usage(os.getpid()).cpu_s)

    wl = peers.Workload(peers.CLIENTS, rounds, peers.PER_ROUND)
    with tempfile.TemporaryDirectory() as tmp:
        result = api.run(wl.scenario(backend, tmp), progress=progress)
        state = torch.load(Path(result.run_dir) / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
        status = result.status.get("status")
    steady = slice(2, rounds - 1)  # rounds 3 .. R-1: index i of the differences is round i + 1
    return {
        "fedelastic": str(Path(fedelastic.__file__).parent),
        "status": status,
        "checksum": peers.checksum({k: np.asarray(v) for k, v in state.items()}),
        "first_row": stamps[0],
        "round_ms": statistics.median(np.diff(stamps)[steady]) * 1e3,
        "round_mean_ms": float(np.mean(np.diff(stamps)[steady])) * 1e3,
        "tree_cpu_s": cpu[-1] - cpu[0],
        **(training() if training else {}),
    }


def run_in(tree: Path, rounds: int, backend: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(HERE), "--worker", "--rounds", str(rounds), "--backend", backend]
    with tempfile.TemporaryDirectory() as cwd:  # not this repository: its fedelastic must not shadow the tree's
        launch = time.time()
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
        wall = time.time() - launch
    if out.returncode != 0:
        raise SystemExit(f"run in {tree} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(got["fedelastic"]).resolve() != (tree / "fedelastic").resolve():
        raise SystemExit(f"the run imported fedelastic from {got['fedelastic']}, not from {tree}")
    got.update(run_wall_s=wall, startup_s=got.pop("first_row") - launch)
    return got


def summarise(runs: dict[str, list[dict]], backend: str) -> dict[str, dict]:
    """Per figure: each side's median over its runs, their ratio, the median paired difference
    (candidate - base, pair by pair) and in how many pairs the candidate's figure was smaller."""
    summary = {}
    for f in FIGURES[backend]:
        diffs = [c[f] - b[f] for b, c in zip(runs["base"], runs["candidate"])]
        base, candidate = (statistics.median(r[f] for r in runs[side]) for side in ("base", "candidate"))
        summary[f] = {
            "base": base,
            "candidate": candidate,
            "candidate_x_base": candidate / base,
            "paired_difference": statistics.median(diffs),
            "candidate_shorter": sum(d < 0 for d in diffs),
        }
    return summary


def report_lines(summary: dict[str, dict], pairs: int) -> str:
    return "\n".join(
        f"{f:14s} base {s['base']:8.2f}  candidate {s['candidate']:8.2f} ({s['candidate_x_base']:.3f}x)  paired "
        f"difference {s['paired_difference']:+7.2f}  candidate shorter in {s['candidate_shorter']} of {pairs}"
        for f, s in summary.items()
    )


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="git revision of the base (default HEAD)")
    p.add_argument("--patch", help="candidate: the base with this patch applied (default: this working tree)")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--backend", choices=tuple(FIGURES), default="inprocess", help="default inprocess")
    p.add_argument("--out", help="write the report (JSON) here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error("--rounds: at least 5 (rounds 3 to the last but one are measured)")
    if args.worker:
        print(json.dumps(worker(args.rounds, args.backend)))
        return
    base_rev = git("rev-parse", "--short", args.base)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": Path(tmp) / "base", "candidate": REPO}
        git("worktree", "add", "--detach", str(trees["base"]), base_rev)
        try:
            if args.patch:
                trees["candidate"] = Path(tmp) / "candidate"
                git("worktree", "add", "--detach", str(trees["candidate"]), base_rev)
                patch = Path(args.patch).resolve()
                applied = subprocess.run(["git", "-C", str(trees["candidate"]), "apply", str(patch)], capture_output=True, text=True)
                if applied.returncode != 0:
                    raise SystemExit(f"{args.patch}: does not apply to {base_rev} (--base): {applied.stderr.strip()}")
            runs: dict[str, list[dict]] = {"base": [], "candidate": []}
            print(f"{args.backend}: base {base_rev} against {args.patch or 'the working tree'}, {args.pairs} pairs of "
                  f"{args.rounds} rounds; niceness {os.nice(0)}, load average {load_start}", flush=True)  # fmt: skip
            for i in range(args.pairs):
                for side in ("base", "candidate") if i % 2 == 0 else ("candidate", "base"):
                    runs[side].append(run_in(trees[side], args.rounds, args.backend))
                print(f"pair {i + 1}: " + ", ".join(
                    f"{s} round {runs[s][-1]['round_ms']:.2f} ms, wall {runs[s][-1]['run_wall_s']:.1f} s" for s in runs
                ), flush=True)  # fmt: skip
        finally:
            for side in ("base", "candidate"):
                if trees[side] != REPO and trees[side].exists():
                    git("worktree", "remove", "--force", str(trees[side]))
    summary = summarise(runs, args.backend)
    print(report_lines(summary, args.pairs))
    sums = {r["checksum"] for side in runs.values() for r in side}
    failed = [r["status"] for side in runs.values() for r in side if r["status"] != "completed"]
    print("same final model in every run" if len(sums) == 1 else f"final models differ: {sorted(sums)}")
    print(f"load average at the end {os.getloadavg()}")
    if failed:
        print(f"runs not completed: {failed}")
    report = {
        "command": "python benchmarks/ab_inprocess.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "base": base_rev,
        "candidate": args.patch or f"working tree on {git('rev-parse', '--short', 'HEAD')}",
        "backend": args.backend,
        "rounds": args.rounds,
        "pairs": args.pairs,
        "niceness": os.nice(0),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "summary": summary,
        "same_final_model": len(sums) == 1,
        "checksums": {side: sorted({r["checksum"] for r in rs}) for side, rs in runs.items()},
        "runs": runs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"written {args.out}")


if __name__ == "__main__":
    main()
