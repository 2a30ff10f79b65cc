"""Cohorts trained on several threads in one process (issue 10): the same results as one thread.

Each thread trains on its own model; the references are independent: the plain torch loop of
benchmarks/peers.py (its own data order, training and float64 FedAvg), and runs on one thread.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedelastic.costmodel import CostModel
from fedelastic.devices import get_profile
from fedelastic.fl.env import environment
from fedelastic.fl.runner import run_scenario
from fedelastic.scenario import parse_scenario

from .conftest import small_scenario_dict
from .test_cohort import _same, _tables
from .test_faults import user_models

ROOT = Path(__file__).resolve().parents[1]
FP32 = {"raspberry_pi_4": 4, "jetson_nano": 4}  # fp32 devices: no emulated numerics, so threads are allowed


@pytest.fixture
def fp32_scenario(tmp_path):
    """The small test scenario on fp32 devices only (the fleet replaced, not merged with the fixture's)."""

    def make(**overrides):
        raw = small_scenario_dict(tmp_path, **overrides)
        raw["fleet"] = FP32
        raw["train"]["numerics"] = "fp32"
        return parse_scenario(raw, src=str(tmp_path / "tiny.toml"))

    return make


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_bench_threads", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_bench_threads"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("peers_bench_threads", None)


@pytest.fixture
def thread_names(monkeypatch):
    """Names of the threads that trained a cohort's clients (each calls train_cohort once per cohort call;
    which clients each trains depends on timing)."""
    import fedelastic.fl.cohort as cohort

    names: set[str] = set()
    train = cohort.train_cohort

    def spy(*args, **kwargs):
        names.add(threading.current_thread().name)
        return train(*args, **kwargs)

    monkeypatch.setattr(cohort, "train_cohort", spy)
    return names


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_end_with_the_bare_torch_loops_model_bit_for_bit(peers, tmp_path, threads, thread_names):
    from fedelastic import api

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wl = peers.Workload(40, 3, 12)  # 36 client updates, most of one or two batches
        bare = peers.worker_bare(wl, {})
        raw = wl.scenario("inprocess", str(tmp_path))
        raw["simulation"]["train_threads"] = threads
        result = api.run(raw)
    finally:
        torch.set_num_threads(before)
    final = torch.load(result.run_dir / "checkpoint.pt", weights_only=True)["model"]
    assert peers.checksum({k: v.numpy() for k, v in final.items()}) == peers.checksum(bare)
    assert thread_names == {f"cohort-{k}" for k in range(threads)}


@pytest.mark.parametrize(
    "train",
    [
        # probes, reselection every 2 steps, priced selector work, momentum: every per-client state
        {"strategy": "elastic_tensor", "options": {"rho": 0.4, "interval": 2}, "momentum": 0.9, "max_steps": 6},
        {"strategy": "static_elastic", "options": {"rho": 0.7}, "max_steps": 3},  # state kept across rounds
        {"strategy": "elastic_layer", "options": {"rho": 0.5}, "bn_mode": "train", "max_steps": 3},  # BN statistics
        {"strategy": "sparse_update", "optimizer": "sgdw", "weight_decay": 0.01, "lr_schedule": "cosine"},
    ],
    ids=["elastic_tensor", "static_elastic", "bn_train", "sparse_update"],
)
def test_two_threads_give_one_threads_tables(fp32_scenario, train, thread_names):
    runs = []
    for threads in (1, 2):
        sc = fp32_scenario(
            train=train, server={"rounds": 3, "clients_per_round": 8}, simulation={"train_threads": threads}
        )
        runs.append(_tables(run_scenario(sc, run_id=f"t{threads}")))
    _same(*runs)
    assert {"cohort-0", "cohort-1"} <= thread_names
    assert runs[0][0].status.eq("counted").all() and runs[0][0].steps.gt(0).all()


def test_the_default_is_two_threads_in_process(fp32_scenario, thread_names):
    sc = fp32_scenario(server={"rounds": 1, "clients_per_round": 6})
    assert sc.simulation.train_threads == 0
    run_scenario(sc, run_id="default")
    assert thread_names == {"cohort-0", "cohort-1"}


def test_emulated_numerics_train_on_one_thread(make_scenario, thread_names):
    # stm32h743 trains in emulated int8: its optimizer hooks are process-wide, so threads would race
    sc = make_scenario(server={"rounds": 1}, simulation={"train_threads": 2})
    assert sc.train.numerics == "device" and "stm32h743" in sc.fleet
    run_scenario(sc, run_id="int8")
    assert thread_names == {"cohort-0"}


DROPOUT_MODEL = """
from torch import nn


def net(num_classes, in_channels, input_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size**2, 16), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(16, num_classes))
"""


def test_a_model_that_draws_random_numbers_gets_one_threads_results(fp32_scenario, tmp_path, monkeypatch):
    """Dropout draws from torch's global generator, which every client seeds: threads would mix the draws.

    The clients during which the generator moved are sent again and trained alone, and the
    process trains on one thread from then on: the tables equal one thread's.
    """
    (tmp_path / "dropout_models.py").write_text(DROPOUT_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    runs, envs = [], []
    for threads in (1, 2):
        sc = fp32_scenario(
            model={"name": "dropout_models:net", "options": {}}, server={"rounds": 2, "clients_per_round": 6},
            simulation={"train_threads": threads},
        )  # fmt: skip
        runs.append(_tables(run_scenario(sc, run_id=f"d{threads}")))
        envs.append(environment(sc))
    _same(*runs)
    assert runs[1][0].status.eq("counted").all()
    assert envs[1].torch_rng_used and not envs[0].torch_rng_used


def test_a_hung_client_times_out_alone_and_the_other_thread_trains_the_rest(
    fp32_scenario, tmp_path, monkeypatch, thread_names
):
    user_models(tmp_path, monkeypatch)
    monkeypatch.setenv("FAULTY_HANG_S", "4")
    sc = fp32_scenario(
        model={"name": "faulty_models:net", "options": {"fault": "hang", "marker": str(tmp_path / "m")}},
        server={"rounds": 2, "clients_per_round": 6}, simulation={"timeout_s": 1.5, "train_threads": 2},
    )  # fmt: skip
    clients = pd.read_parquet(run_scenario(sc, run_id="hang") / "clients.parquet")
    assert clients.groupby("round").size().tolist() == [6, 6]
    failed = clients[clients.status == "failed"]
    assert len(failed) == 1 and failed["round"].tolist() == [1]
    assert failed.error.iloc[0] == "timeout: no reply within simulation.timeout_s = 1.5 s"
    assert clients[clients.status != "failed"].steps.gt(0).all()
    assert {"cohort-0", "cohort-1"} <= thread_names


def test_a_forked_cost_model_prices_alike_and_counts_its_own_evaluations(make_scenario):
    env = environment(make_scenario())
    cost = CostModel(env.info, get_profile("jetson_nano"), 16, "momentum")
    twin = cost.fork()
    ratios = np.linspace(0, 1, env.info.num_tensors)
    cost.step_time_s(ratios)
    assert cost.evaluations == 1 and twin.evaluations == 0  # one backward_time_s evaluation
    assert twin.step_time_s(ratios) == cost.step_time_s(ratios)
    assert twin.peak_memory_bytes(ratios) == cost.peak_memory_bytes(ratios)
    assert twin.evaluations == 2 and cost.evaluations == 3


@pytest.fixture
def slow_selector():
    """A strategy whose every selection makes 3 cost-model evaluations, sleeping between them.

    The sleeps hand the GIL to the other training thread in the middle of a selection: a cost
    model shared by the threads would charge each selection the other's evaluations too.
    """
    from fedelastic.selection import REGISTRY, Selection, SelectionStrategy, register

    class SlowSelector(SelectionStrategy):
        name = "test_slow_selector"

        def select(self, ctx):
            ones = np.ones(ctx.info.num_tensors)
            for _ in range(3):
                ctx.cost.backward_time_s(ones)  # one evaluation
                time.sleep(0.002)
            return Selection.from_mask(ones)

        def should_reselect(self, step: int, steps_per_epoch: int = 0) -> bool:
            return True

    register(SlowSelector)
    yield SlowSelector.name
    REGISTRY.pop(SlowSelector.name, None)


def test_each_thread_charges_its_selections_their_own_evaluations(fp32_scenario, slow_selector, thread_names):
    sc = fp32_scenario(
        train={"strategy": slow_selector, "max_steps": 3}, server={"rounds": 2, "clients_per_round": 8},
        simulation={"train_threads": 2},
    )  # fmt: skip
    clients = pd.read_parquet(run_scenario(sc, run_id="slow") / "clients.parquet")
    assert {"cohort-0", "cohort-1"} <= thread_names
    env = environment(sc)
    for row in clients.itertuples():
        fresh = CostModel(env.info, get_profile(row.device), sc.train.batch_size, "momentum")
        per_selection = fresh.selector_time_s(3, 0.0)  # 3 evaluations, no other operations
        assert row.selections == row.steps > 0
        assert row.emulated_overhead_time_s == pytest.approx(row.selections * per_selection, rel=1e-12)


def test_training_threads_that_fail_outside_any_client_fail_its_clients(fp32_scenario, monkeypatch):
    import fedelastic.fl.cohort as cohort

    def broken(*args, **kwargs):  # e.g. the global weights do not load into the model
        raise RuntimeError("weights did not load")

    monkeypatch.setattr(cohort, "train_cohort", broken)
    sc = fp32_scenario(server={"rounds": 1, "clients_per_round": 6}, simulation={"train_threads": 2})
    clients = pd.read_parquet(run_scenario(sc, run_id="crash") / "clients.parquet")
    assert len(clients) == 6 and clients.status.eq("failed").all()
    assert clients.error.eq("RuntimeError: weights did not load").all()


def test_the_automatic_count_keeps_threads_only_while_they_run_side_by_side():
    from fedelastic.fl.cohort import ThreadGauge

    gauge = ThreadGauge(min_cores=1.3, retry=4)
    assert gauge.threads(2) == 2  # call 1: threads until found otherwise
    gauge.record(2, wall_s=1.0, cpu_s=1.9)  # the two threads kept ~2 cores busy
    assert gauge.threads(2) == 2  # call 2
    gauge.record(2, wall_s=1.0, cpu_s=1.05)  # one core's worth: they took turns
    assert [gauge.threads(2) for _ in range(4)] == [1, 2, 1, 1]  # calls 3-6: every 4th call tries again
    gauge.record(1, wall_s=1.0, cpu_s=1.0)  # a one-thread call says nothing about threads
    assert gauge.threads(2) == 1
    gauge.record(2, wall_s=1.0, cpu_s=1.6)  # a retry found a free core
    assert gauge.threads(2) == 2


def test_automatic_threads_fall_back_to_one_where_they_take_turns(fp32_scenario, monkeypatch):
    import fedelastic.fl.cohort as cohort
    from fedelastic.fl.cohort import ThreadGauge

    seen: set[tuple[int, str]] = set()
    train = cohort.train_cohort

    def spy(env, model, weights, jobs, *args, **kwargs):
        seen.add((jobs[0].server_round, threading.current_thread().name))
        return train(env, model, weights, jobs, *args, **kwargs)

    monkeypatch.setattr(cohort, "train_cohort", spy)
    sc = fp32_scenario(server={"rounds": 3, "clients_per_round": 6})
    environment(sc).thread_gauge = ThreadGauge(min_cores=100.0, retry=1000)  # never side by side enough
    run_scenario(sc, run_id="gauge")
    assert {name for rnd, name in seen if rnd == 1} == {"cohort-0", "cohort-1"}
    assert {name for rnd, name in seen if rnd > 1} == {"cohort-0"}


@pytest.mark.parametrize(
    "train",
    [
        {"strategy": "elastic_tensor", "options": {"rho": 0.4, "interval": 2}, "momentum": 0.9, "max_steps": 6},
        {"strategy": "sparse_update", "optimizer": "sgdw", "weight_decay": 0.01, "lr_schedule": "cosine"},
    ],
    ids=["elastic_tensor", "sparse_update"],
)
def test_threads_equal_one_flower_node_per_client(fp32_scenario, train):
    """Per client, a node builds its optimizer and model view afresh: the reference for what threads reuse."""
    runs = []
    for sim in ({"node_mode": "per_client"}, {"train_threads": 2}):
        sc = fp32_scenario(train=train, server={"rounds": 2, "clients_per_round": 8}, simulation=sim)
        runs.append(_tables(run_scenario(sc, run_id=sim.get("node_mode", "threads"))))
    _same(*runs)
