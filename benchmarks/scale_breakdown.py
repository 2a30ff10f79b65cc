"""Where a client's cost goes in a large in-process round: a py-spy profile of a scale run, split by part (issue 40 §3).

    pip install py-spy
    OMP_NUM_THREADS=1 py-spy record -r 50 --format raw -o prof.txt -- python benchmarks/scale.py --worker inprocess \\
        --query-chunk 0 --clients 100000 --per-round 1000 --rounds 4 --samples 110000 > run.json
    python benchmarks/scale_breakdown.py prof.txt run.json            # the table
    python benchmarks/scale_breakdown.py prof.txt run.json --unmatched  # stacks no part claims, for checking

    # the peers workload (benchmarks/peers.py), a worker alone: fedelastic's per-client loop, or the bare loop
    py-spy record -r 250 --format raw -o loop.txt -- python benchmarks/peers.py --worker inprocess-loop \\
        --rounds 40 --result loop.json --tmp /tmp/loop
    python benchmarks/scale_breakdown.py loop.txt loop.json            # (--worker bare: the bare loop's parts)

Each sample of the rounds (stacks through the driver's round loop ``EngineStrategy.run``, the
training thread ``KeptThread._loop`` or the results writer ``_Writer._work``; start-up and the
benchmark's bare loop are left out) goes to the first part in ``PARTS`` whose frame it holds. A
thread waiting (a queue, a lock, an event) is idle and left out. py-spy samples wall time of
running threads; each part's milliseconds per client are its share of the rounds' samples times
the process's median CPU seconds a round (``run.json``, rounds 1..R) over the clients a round, so
the parts add up to the measured CPU. A ``benchmarks/peers.py --worker`` result gives the CPU a
round as its ``train_cpu_s`` over its rounds, and ``--per-round`` (default 50) clients a round.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

import numpy as np

THREADS = {
    "EngineStrategy.run": "driver", "KeptThread._loop": "training thread", "_Writer._work": "writer thread",
    "worker_bare": "bare loop",  # benchmarks/peers.py's bare torch loop (one thread)
}  # fmt: skip
# a thread waiting; a stack ending in a thread's own loop waits in C for its next call (SimpleQueue.get)
IDLE = ("Condition.wait", "Event.wait", "Queue.get", "SimpleQueue.get", "Lock.acquire", "KeptThread._loop", "_Writer._work")

# (thread, part, frames that claim a sample), first match wins
PARTS: list[tuple[str, str, tuple[str, ...]]] = [
    ("driver", "evaluation of the server's test set (once a round)", ("CentralEvaluation.evaluate",)),
    ("driver", "plan: sampling, deadline, assignments", ("RoundEngine.plan",)),
    ("driver", "messages: one per client (config, arrays)", ("EngineStrategy.messages",)),
    ("driver", "grid: cohort messages packed and unpacked", ("CohortGrid.send_and_receive", "GuardedGrid.send_and_receive")),
    ("driver", "settle: replies decoded and checked", ("EngineStrategy._failures", "EngineStrategy._by_partition")),
    ("driver", "settle: aggregation", ("aggregate_partial", "fednova_rescale", "FedAvg.__call__", "make_aggregator")),
    ("driver", "settle: trips, energy, client records", ("RoundEngine.settle",)),
    ("driver", "settle: rows handed to the recorder", ("EngineStrategy._add_clients",)),
    ("driver", "settle: strategy states, new model encoded", ("EngineStrategy.settle",)),
    ("driver", "round row, divergence check, checkpoint hand-over", ("EngineStrategy.end_round",)),
    ("driver", "benchmark's own progress callback", ("worker.<locals>.progress",)),
    ("driver", "driver, other", ("EngineStrategy.run",)),
    ("training thread", "client: reply (figures, arrays to records)", ("reply_content",)),
    ("training thread", "client: global weights loaded", ("weights_loader.<locals>.load",)),
    ("training thread", "client: seeding", ("seed_everything",)),
    ("training thread", "client: data batches", ("batches", "RunEnvironment.client_data")),
    ("training thread", "client: torch forward, backward, SGD step", ("Module._wrapped_call_impl", "Tensor.backward", "_Applied.step", "cross_entropy")),
    ("training thread", "client: trainer's own Python (selection, bookkeeping)", ("train_local",)),
    ("training thread", "client: job set-up (strategy, config)", ("prepare_job",)),
    ("training thread", "cohort: weights decoded, replies packed", ("cohort_train",)),
    ("training thread", "training thread, other", ("KeptThread._loop",)),
    ("writer thread", "writer: checkpoint", ("save_checkpoint",)),
    ("writer thread", "writer: clients/rounds tables (CSV, Parquet)", ("_Table.append",)),
    ("writer thread", "writer: other (status.json)", ("_Writer._work",)),
    ("bare loop", "torch: forward, backward, SGD step", ("Module._wrapped_call_impl", "Tensor.backward", "SGD.step", "cross_entropy")),
    ("bare loop", "global weights loaded (load_state_dict)", ("Module.load_state_dict",)),
    ("bare loop", "data batches", ("Workload.client_arrays",)),
    ("bare loop", "optimizer made, zero_grad", ("SGD.__init__", "Optimizer.zero_grad")),
    ("bare loop", "trained weights copied out", ("worker_bare.<locals>.<dictcomp>",)),
    ("bare loop", "FedAvg", ("fedavg",)),
    ("bare loop", "bare loop, other", ("worker_bare",)),
]  # fmt: skip


def frames(stack: str) -> list[str]:
    return [re.sub(r" \(.*", "", f) for f in stack.split(";")]


def split(path: str) -> tuple[collections.Counter, collections.Counter]:
    """Samples per part, and the unclaimed stacks."""
    parts: collections.Counter = collections.Counter()
    unmatched: collections.Counter = collections.Counter()
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip().rpartition(" ")
            names = frames(stack)
            held = set(names)
            thread = next((t for f, t in THREADS.items() if f in held), None)
            if thread is None or names[-1] in IDLE or "bare_client_ms" in held:
                continue
            part = next((p for t, p, claim in PARTS if t == thread and held.intersection(claim)), None)
            if part is None:
                unmatched[stack] += int(count)
            else:
                parts[(thread, part)] += int(count)
    return parts, unmatched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="py-spy --format raw output (.gz: gzipped)")
    parser.add_argument("run", help="the scale worker's JSON (its stdout's last line), or a peers.py --worker result")
    parser.add_argument("--per-round", type=int, default=50, help="clients a round of a peers.py worker (default 50)")
    parser.add_argument("--unmatched", action="store_true")
    args = parser.parse_args()
    with open(args.run) as fh:
        run = json.loads([line for line in fh if line.startswith("{")][-1])
    if "records" in run:  # scale.py
        recs = run["records"]
        cpu = np.diff([r["tree_cpu_s"] for r in recs])  # rounds 1..R
        clients = float(np.median([r["clients"] for r in recs[1:]]))
        per_round = float(np.median(cpu))
    else:  # a peers.py worker: its training phase's CPU, rounds 1..R
        cpu = np.zeros(len(run["stamps"]) - 1)
        clients, per_round = float(args.per_round), run["train_cpu_s"] / len(cpu)
    parts, unmatched = split(args.profile)
    total = sum(parts.values())
    print(f"rounds 1-{len(cpu)}: {per_round:.2f} s CPU a round (median), {clients:.0f} clients a round, {total} samples")
    print("| thread | part | share | ms CPU a client |\n|---|---|---:|---:|")
    for (thread, part), n in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {thread} | {part} | {100 * n / total:.1f}% | {1000 * per_round * n / total / clients:.2f} |")
    for thread in THREADS.values():
        n = sum(v for (t, _), v in parts.items() if t == thread)
        print(f"| {thread} | all | {100 * n / total:.1f}% | {1000 * per_round * n / total / clients:.2f} |")
    if args.unmatched:
        for stack, n in unmatched.most_common(20):
            print(n, " <- ".join(reversed(frames(stack)[-6:])))


if __name__ == "__main__":
    main()
