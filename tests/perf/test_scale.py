"""The driver does not grow with rounds: a reduced fleet, in-process, structures counted.

500 clients, 20 a round, 20 rounds through the real server (``server_main``), ClientApp and
recorder. At round 5 and at round 20 the test counts every entry of every list, dict, set and
tuple reachable from the server strategy, the recorder and the grid, and measures the memory
Python has allocated (tracemalloc). Only the node contexts may grow, and only by one kept
strategy state per node that trained (bounded by the fleet, not the rounds); everything else
must hold the same number of entries, and allocations must stay far below what keeping one
client row or one model per client per round would take. No timings are asserted.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedelastic.environment import environment
from fedelastic.fl import server as fl_server
from fedelastic.fl.clientapp import make_client_app
from fedelastic.fl.grids import GuardedGrid, InProcessGrid
from fedelastic.results.recorder import Recorder
from fedelastic.scenario import SimulationConfig, parse_scenario
from fedelastic.sim.availability import SessionAvailability
from fedelastic.train.pretrain import initial_state
from tests.support import small_scenario_dict

pytestmark = pytest.mark.perf

CLIENTS, PER_ROUND, ROUNDS, EARLY = 500, 20, 20, 5


def held_entries(roots: list, skip: set[int]) -> int:
    """Entries of every container reachable from ``roots`` through fedelastic and Flower objects.

    Walks builtin containers and the attributes of objects whose class is defined in fedelastic
    or flwr; numpy arrays, tensors and other libraries' objects count as leaves (their sizes are
    fixed by the model and data). Objects whose id is in ``skip`` are not entered.
    """
    seen: set[int] = set(skip)
    total, stack = 0, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            total += len(obj)
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            total += len(obj)
            stack.extend(obj)
        elif type(obj).__module__.split(".")[0] in ("fedelastic", "flwr") and hasattr(obj, "__dict__"):
            if not isinstance(obj, type):
                stack.append(vars(obj))
    return total


def _has_cohorts() -> bool:
    return "node_mode" in {f.name for f in dataclasses.fields(SimulationConfig)}


def _per_round() -> dict:
    """Each round appended on its own (the test counts one part per round), where the version batches writes."""
    fields = {f.name for f in dataclasses.fields(SimulationConfig)}
    return {"write_every_s": 0} if "write_every_s" in fields else {}


@pytest.mark.slow  # 500 clients x 20 rounds in-process: 15-20 s on the loaded 2-core machine
@pytest.mark.parametrize("node_mode", ["per_client", "cohort"])
def test_driver_structures_do_not_grow_with_rounds(tmp_path: Path, node_mode: str):
    if node_mode == "cohort" and not _has_cohorts():
        pytest.skip("this version has no cohort mode")
    raw = small_scenario_dict(
        tmp_path,
        fleet={"raspberry_pi_4": 200, "jetson_nano": 200, "stm32h743": 100},
        data={"partitioner": "iid", "min_partition_size": 1},
        train={"max_steps": 1},
        server={"rounds": ROUNDS, "clients_per_round": PER_ROUND},
        # a memory test: one step a round on 1-sample partitions can collapse the predictions, not a verdict here
        divergence={"collapse_share": 0},
        simulation={"backend": "inprocess", **({"node_mode": node_mode} if _has_cohorts() else {}), **_per_round()},
    )
    scenario = parse_scenario(raw, src=str(tmp_path / "scale.toml"))
    assert scenario.num_clients == CLIENTS
    recorder = Recorder(tmp_path / "run", scenario.to_dict(), planned_rounds=ROUNDS)
    env = environment(scenario)
    # the grids of the runner's in-process path: a node per client, or a few cohort nodes
    if node_mode == "cohort":
        from fedelastic.fl.cohort import CohortGrid, cohort_count

        nodes = cohort_count(scenario, 1)
        local = InProcessGrid(make_client_app(scenario), nodes)
        grid = CohortGrid(GuardedGrid(local, threading.Event()), env, nodes)
        kept = lambda: len(grid.states)  # noqa: E731 (the clients' kept strategy states)
        unbounded = {id(grid.states)}  # per client, checked below; the cohort nodes' contexts are walked
    else:
        local = InProcessGrid(make_client_app(scenario), CLIENTS)
        grid = GuardedGrid(local, threading.Event())
        kept = lambda: sum("strategy-state" in c.state for c in local.contexts.values())  # noqa: E731
        unbounded = {id(c) for c in local.contexts.values()} | {id(local.contexts)}
    strategies: list = []
    seen: dict[int, dict] = {}

    class Capture:  # a callback: it sees the server strategy as the run starts
        def on_run_start(self, run) -> None:
            strategies.append(run)
            unbounded.add(id(run.client_states))  # per client, as the nodes' own states (kept for the checkpoint)

    def parts() -> dict[str, int]:
        folder = tmp_path / "run" / "clients.parquet"
        return {p.name: p.stat().st_mtime_ns for p in folder.glob("part-*.parquet")}

    def progress(row: dict) -> None:
        if row["round"] == EARLY - 2:  # traced from here: what later rounds keep is what counts
            tracemalloc.start()
        if row["round"] not in (EARLY, ROUNDS):
            return
        recorder.flush()  # the rows are written behind: this round's part is on disk after a flush
        gc.collect()
        seen[row["round"]] = {
            "entries": held_entries([strategies[0], recorder, grid], skip=unbounded),
            "states": kept(),
            "traced": tracemalloc.get_traced_memory()[0],
            "parts": parts(),
        }

    state = initial_state(env)
    try:
        fl_server.server_main(scenario, state, recorder, progress, grid, callbacks=[Capture()])
    finally:
        tracemalloc.stop()
        recorder.close()
    early, late = seen[EARLY], seen[ROUNDS]

    # every container the driver holds has as many entries after 20 rounds as after 5
    assert late["entries"] == early["entries"]
    # per client, one kept strategy state for each client that has trained (read back from the results)
    clients = pd.read_parquet(tmp_path / "run" / "clients.parquet")
    assert late["states"] == clients.partition_id.nunique() > early["states"]
    assert len(clients) == ROUNDS * PER_ROUND and recorder.rounds.rows[-1]["round"] == ROUNDS
    assert recorder.clients.rows == [] and len(recorder.rounds.rows) == 1
    # Python's allocations: keeping one model copy (about 25 KB here) per client per round would
    # add over ten times the bound in 15 rounds; the kept states of the new nodes and Flower's
    # per-round metric records stay well under it
    bound = 512 * 1024
    model_bytes = sum(np.asarray(v).nbytes for v in state.values())
    assert model_bytes * (ROUNDS - EARLY) * PER_ROUND > 10 * bound
    assert late["traced"] - early["traced"] < bound
    # results appended: the parts of rounds 1-5 untouched, one new part per round
    assert {k: late["parts"][k] for k in early["parts"]} == early["parts"]
    assert len(late["parts"]) == ROUNDS


@pytest.mark.parametrize("chunk", [7, 10_000])
def test_partition_query_in_chunks_maps_every_node(tmp_path: Path, monkeypatch, chunk):
    """The partition query sent a chunk at a time gives the same map as sent at once."""
    scenario = parse_scenario(small_scenario_dict(tmp_path, fleet={"raspberry_pi_4": 23}), src=str(tmp_path / "q.toml"))
    grid = InProcessGrid(make_client_app(scenario), 23)
    monkeypatch.setattr(fl_server, "QUERY_CHUNK", chunk)
    nodes = sorted(grid.get_node_ids())
    mapping = fl_server.discover_partitions(grid, nodes, timeout_s=60)
    expected = {ctx.node_config["partition-id"]: node for node, ctx in grid.contexts.items()}
    assert mapping == expected and sorted(mapping) == list(range(23))


def test_online_windows_behind_the_clock_are_dropped_without_changing_answers():
    """Sessions over 30 simulated days: a pruned copy answers as an unpruned one, with bounded state."""
    kept, full = (SessionAvailability(20, 5, 1800.0, 1800.0, 0.8, 86400.0) for _ in range(2))
    rng = np.random.default_rng(0)
    t = 0.0
    for _ in range(600):
        t += float(rng.exponential(4000.0))
        kept.forget_before(t)
        for p in range(20):
            ahead = t + float(rng.exponential(3000.0))  # a look ahead (as ready_at does) is allowed
            for q in (t, ahead):
                assert kept.online(p, q) == full.online(p, q)
                assert kept.next_online(p, q) == full.next_online(p, q)
                assert kept.offline_at(p, q) == full.offline_at(p, q)
    # ~30 days of ~1 h cycles is ~700 windows a client; the pruned copy keeps those since the floor
    # (a few chunks of 16 at most here) on top of KEEP
    assert max(len(s) for s in full._starts) > 500
    assert max(len(s) for s in kept._starts) <= 2 * SessionAvailability.KEEP
    with pytest.raises(ValueError, match="before the clock's floor"):
        kept.online(0, t - 1.0)
