"""What pickling a cohort's reply costs as Ray pickles it: cloudpickle against the standard pickle.

    python benchmarks/message_pickling.py                 # 25 clients a reply (peers.py's cohort on 2 workers)
    python benchmarks/message_pickling.py --members 50 --repeats 50

A real reply: one in-process round of ``peers.py``'s workload trains ``--members`` clients in one
cohort call (``fedelastic.fl.cohort.cohort_train``); its reply ``Message`` is kept. Then, interleaved
(A, B, A, B ...), ``ray.cloudpickle.dumps`` of it without and with
``fedelastic.runtime.lifecycle.plain_message_pickling`` (what a Ray worker and the driver register),
and ``pickle.loads`` of each result; minima and medians in ms of process CPU time. Both results must
unpickle to the same message (checked: the same bytes when pickled again with ``pickle``).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def a_reply(members: int):
    """The reply of a cohort call that trained ``members`` clients of peers.py's workload (round 1)."""
    import torch
    from peers import Workload

    import fedelastic.fl.cohort as cohort
    from fedelastic import api

    torch.set_num_threads(1)
    kept = []
    train = cohort.cohort_train

    def keep(scenario, msg):
        kept.append(train(scenario, msg))
        return kept[-1]

    cohort.cohort_train = keep
    wl = Workload(rounds=1, per_round=members)
    with tempfile.TemporaryDirectory() as tmp:
        api.run(wl.scenario("inprocess", tmp))
    cohort.cohort_train = train
    return kept[0]


def timed(fn, arg) -> tuple[float, object]:
    """(ms of process CPU time, result) of ``fn(arg)``."""
    t = time.process_time()
    out = fn(arg)
    return 1e3 * (time.process_time() - t), out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    from flwr.app import Message
    from ray import cloudpickle

    from fedelastic.runtime.lifecycle import plain_message_pickling

    reply = a_reply(args.members)
    records = sum(1 for _ in reply.content.items())
    dispatch = cloudpickle.CloudPickler.dispatch
    times: dict[str, list[float]] = {
        "cloudpickle dumps": [],
        "plain dumps": [],
        "loads (cloudpickle)": [],
        "loads (plain)": [],
    }
    blobs = {}
    for _ in range(args.repeats):
        for name in ("cloudpickle", "plain"):
            dispatch.pop(Message, None)
            if name == "plain":
                plain_message_pickling()
            ms, blobs[name] = timed(cloudpickle.dumps, reply)
            times[f"{name} dumps"].append(ms)
            times[f"loads ({name})"].append(timed(pickle.loads, blobs[name])[0])
    dispatch.pop(Message, None)
    same = pickle.dumps(pickle.loads(blobs["cloudpickle"]), 5) == pickle.dumps(pickle.loads(blobs["plain"]), 5)
    load = os.getloadavg()[0]
    print(
        f"a cohort reply of {args.members} clients: {records} records, {len(blobs['plain']):,} bytes; "
        f"{args.repeats} interleaved repeats, load average {load:.1f}; same message unpickled: {same}"
    )
    print("| step | min ms | median ms |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {statistics.median(ts):.2f} |")
    ratio = statistics.median(times["cloudpickle dumps"]) / statistics.median(times["plain dumps"])
    print(f"cloudpickle / plain, dumps (medians): {ratio:.1f}x")
    if not same:
        raise SystemExit("the two pickles unpickle to different messages")


if __name__ == "__main__":
    main()
