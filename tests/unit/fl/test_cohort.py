"""Cohort mode: one Flower node trains many virtual clients per call, with the results of one node each."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedelastic.environment import environment
from fedelastic.errors import ConfigError
from fedelastic.fl.cohort import CohortGrid
from fedelastic.fl.runner import run_scenario
from fedelastic.runtime import patches
from fedelastic.train.trainer import seed_torch
from tests.support import assert_same_run, tables_and_model, user_models


def _both(make_scenario, cohorts: int = 0, **overrides):
    runs = {}
    for mode in ("per_client", "cohort"):
        # the per-client cohort path, byte for byte against nodes (vectorised cohorts: test_vectorize_runtime.py)
        sim = {"vectorize": False, **overrides.pop("simulation", {}), "node_mode": mode, "cohorts": cohorts if mode == "cohort" else 0}
        overrides["simulation"] = sim
        runs[mode] = tables_and_model(run_scenario(make_scenario(**overrides), run_id=mode))
    return runs["per_client"], runs["cohort"]


SIX = {"raspberry_pi_4": 2, "jetson_nano": 2, "stm32h743": 2}


def test_cohorts_give_byte_identical_tables_and_model(make_scenario):
    # static_elastic keeps each client's selection across rounds: the driver must hand it back
    per_client, cohort = _both(
        make_scenario, cohorts=2, fleet=SIX,
        train={"strategy": "static_elastic", "options": {"rho": 0.7}, "max_steps": 3},
        server={"rounds": 3, "clients_per_round": 4},
    )  # fmt: skip
    assert_same_run(per_client, cohort)
    clients = cohort[0]
    assert len(clients) == 12 and clients.partition_id.nunique() > 4  # samples differ per round
    again = clients[clients.partition_id.duplicated(keep=False)].sort_values("round")
    assert (
        len(again)
        and (again.groupby("partition_id").emulated_overhead_time_s.apply(lambda s: (s.iloc[1:] == 0).all())).all()
    )


@pytest.mark.parametrize(
    "train",
    [
        # probes, reselection every 2 steps, priced selector work, momentum: every per-client state
        {"strategy": "elastic_tensor", "options": {"rho": 0.4, "interval": 2}, "momentum": 0.9, "max_steps": 6},
        {"strategy": "sparse_update", "optimizer": "sgdw", "weight_decay": 0.01, "lr_schedule": "cosine"},
    ],
    ids=["elastic_tensor", "sparse_update"],
)
def test_cohorts_equal_one_flower_node_per_client_with_optimizer_state(make_scenario, train):
    """A node per client builds its optimizer and model view afresh: the reference for what a cohort reuses."""
    per_client, cohort = _both(
        make_scenario, fleet={"raspberry_pi_4": 3, "jetson_nano": 3}, train=train,  # with the fixture's stm32h743 (int8)
        server={"rounds": 2, "clients_per_round": 6},
    )  # fmt: skip
    assert_same_run(per_client, cohort)
    assert cohort[0].status.eq("counted").all() and cohort[0].steps.gt(1).all()  # momentum and schedules carry


def test_cohorts_keep_deadline_plans_and_too_slow_replies(make_scenario):
    # a tight deadline: each client gets its own rho; the MCUs get none and reply 'too slow'
    per_client, cohort = _both(
        make_scenario, fleet=SIX,
        train={"strategy": "elastic_tensor", "options": {"rho": 0.5}, "max_steps": 3},
        server={"rounds": 2, "policy": "deadline_elastic", "deadline_quantile": 0.3},
    )  # fmt: skip
    assert_same_run(per_client, cohort)
    status = cohort[0].status.value_counts()
    assert status.get("too_slow", 0) >= 1 and status.get("counted", 0) >= 1
    assert cohort[0].rho.nunique() > 1


def test_a_client_that_raises_fails_alone_in_its_cohort(make_scenario, tmp_path, monkeypatch):
    user_models(tmp_path, monkeypatch)
    model = {"name": "faulty_models:net", "options": {"fault": "raise", "marker": str(tmp_path / "m")}}
    runs = []
    for mode in ("per_client", "cohort"):
        (tmp_path / "m-raise").unlink(missing_ok=True)  # the fault strikes once per run
        sc = make_scenario(fleet={"raspberry_pi_4": 4}, model=model, simulation={"node_mode": mode, "vectorize": False})
        runs.append(tables_and_model(run_scenario(sc, run_id=mode)))
        failed = runs[-1][0][runs[-1][0].status == "failed"]
        assert len(failed) == 1 and failed.error.iloc[0] == "RuntimeError: the device fell over"
    assert_same_run(*runs)


def test_a_hung_client_times_out_alone_and_the_rest_of_its_cohort_trains(make_scenario, tmp_path, monkeypatch):
    user_models(tmp_path, monkeypatch)
    monkeypatch.setenv("FAULTY_HANG_S", "4")
    marker = tmp_path / "m"
    sc = make_scenario(
        fleet={"raspberry_pi_4": 4},
        model={"name": "faulty_models:net", "options": {"fault": "hang", "marker": str(marker)}},
        simulation={"timeout_s": 1.5, "cohorts": 1, "vectorize": False},
    )  # fmt: skip
    clients = pd.read_parquet(run_scenario(sc, run_id="hang") / "clients.parquet")
    assert clients.groupby("round").size().tolist() == [6, 6]  # the fleet merges with the fixture's
    failed = clients[clients.status == "failed"]
    assert len(failed) == 1 and failed["round"].tolist() == [1]
    assert failed.error.iloc[0] == "timeout: no reply within simulation.timeout_s = 1.5 s"
    assert clients[clients.status != "failed"].steps.gt(0).all()


def test_a_training_thread_that_fails_outside_any_client_fails_its_clients(make_scenario, monkeypatch):
    import signal

    import fedelastic.fl.cohort as cohort

    def broken(*args, **kwargs):  # e.g. the global weights do not load into the model
        raise RuntimeError("weights did not load")

    monkeypatch.setattr(cohort, "train_cohort", broken)
    def hung(*args):
        raise TimeoutError("the run did not end: the failed cohort is re-sent forever")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)  # before the fix the cohort was re-sent forever: fail instead of hanging the suite
    try:
        clients = pd.read_parquet(run_scenario(make_scenario(server={"rounds": 1}), run_id="crash") / "clients.parquet")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert len(clients) > 0 and clients.status.eq("failed").all()
    assert clients.error.eq("RuntimeError: weights did not load").all()


def test_vectorised_cohorts_get_each_clients_timeout(make_scenario, tmp_path, monkeypatch):
    """One batched call reports every client at its end: a cohort of 6 gets 6 x timeout_s, not one client's."""
    user_models(tmp_path, monkeypatch)
    monkeypatch.setenv("FAULTY_HANG_S", "2")
    sc = make_scenario(
        fleet={"raspberry_pi_4": 4}, train={"numerics": "fp32"},
        model={"name": "faulty_models:net", "options": {"fault": "hang", "marker": str(tmp_path / "m")}},
        simulation={"timeout_s": 1.5, "cohorts": 1, "vectorize": True}, server={"rounds": 1},
    )  # fmt: skip
    clients = pd.read_parquet(run_scenario(sc, run_id="vhang") / "clients.parquet")
    assert (tmp_path / "m-hang").exists()  # the 2 s hang struck, inside the one batched call
    assert len(clients) == 6 and clients.status.eq("counted").all() and clients.steps.gt(0).all()


def test_clients_are_shared_longest_first_to_the_least_loaded_cohort(make_scenario):
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    sc = make_scenario(fleet={"raspberry_pi_4": 6}, train={"max_steps": 0, "batch_size": 1})
    env = environment(sc)
    grid = CohortGrid(None, env, cohorts=2)  # type: ignore[arg-type]
    steps = [len(env.data.client(p)) for p in range(6)]  # batch 1, one epoch: one step per sample
    arrays = ArrayRecord()
    msgs = [
        Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord()}), message_type=MessageType.TRAIN, dst_node_id=p + 1
        )
        for p in range(6)
    ]
    chunks = grid._chunks(list(range(6)), msgs)
    # brute force: the greedy rule by hand
    load, expected = [0, 0], [[], []]
    for p in sorted(range(6), key=lambda p: (-steps[p], p)):
        j = 0 if load[0] <= load[1] else 1
        expected[j].append(p)
        load[j] += steps[p] + 1
    assert sorted(map(sorted, chunks)) == sorted(map(sorted, expected))
    assert sorted(sum(chunks, [])) == list(range(6))


def test_seed_torch_draws_what_torch_manual_seed_draws():
    for seed in (0, 7, 2**62 - 1):
        torch.manual_seed(seed)
        a = (torch.rand(5), torch.randn(3), torch.randperm(9))
        seed_torch(seed)
        b = (torch.rand(5), torch.randn(3), torch.randperm(9))
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "sim, key",
    [
        ({"node_mode": "nodes"}, "simulation.node_mode"),
        ({"cohorts": -1}, "simulation.cohorts"),
        ({"cohorts": 2, "node_mode": "per_client"}, "simulation.cohorts"),  # would be ignored: refused
        ({"train_threads": 2}, "simulation.train_threads"),  # removed (benchmarks/RESULTS.md): an unknown key
    ],
)
def test_bad_cohort_keys_are_one_line_errors(make_scenario, sim, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        make_scenario(simulation=sim)
    assert "\n" not in str(info.value)


def test_weights_loader_copies_what_load_state_dict_loads_and_defers_to_it_otherwise():
    from torch import nn

    from fedelastic.fl.client import weights_loader
    from fedelastic.models import build_model

    torch.manual_seed(0)
    source = build_model("small_cnn", num_classes=10, in_channels=1, input_size=8, width=4)  # BatchNorm included
    for p in source.parameters():
        p.data.normal_()
    for m in source.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(), m.running_var.uniform_(1, 2), m.num_batches_tracked.fill_(7)
    weights = {k: v.clone() for k, v in source.state_dict().items()}
    ours = build_model("small_cnn", num_classes=10, in_channels=1, input_size=8, width=4)
    theirs = build_model("small_cnn", num_classes=10, in_channels=1, input_size=8, width=4)
    weights_loader(ours, weights)()
    theirs.load_state_dict(weights)
    for (k, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b) and a.dtype == b.dtype, k
    assert all(p.requires_grad for p in ours.parameters())
    # a load hook, or a missing key: load_state_dict itself (which raises on the missing key)
    hooked = build_model("small_cnn", num_classes=10, in_channels=1, input_size=8, width=4)
    seen = []
    hooked.register_load_state_dict_pre_hook(lambda *args: seen.append(1))
    weights_loader(hooked, weights)()
    assert seen == [1]
    partial = {k: v for k, v in weights.items() if not k.endswith("num_batches_tracked")}
    ours.load_state_dict(weights), theirs.load_state_dict(weights)
    for m in (*ours.modules(), *theirs.modules()):
        if isinstance(m, nn.BatchNorm2d):
            m.num_batches_tracked.fill_(3)
    weights_loader(ours, partial)()  # BatchNorm's own loader decides what a missing counter becomes
    theirs.load_state_dict(partial)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))


def test_fast_array_records_are_flowers_own():
    from flwr.app import ArrayRecord

    from fedelastic.fl import arrays

    assert arrays._FAST == patches.active("flwr")  # this Flower's constructors were matched at import (a patch)
    sample = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones((2, 1, 3), np.float64)}
    ours = arrays.record_from_numpy(sample)
    theirs = ArrayRecord({k: arrays.Array(v) for k, v in sample.items()})  # Flower's own, from the arrays
    assert ours.object_id == theirs.object_id
    assert {k: v.numpy().tolist() for k, v in ours.items()} == {k: v.numpy().tolist() for k, v in theirs.items()}


def test_the_environments_strategy_cache_stays_bounded_under_per_client_rhos(make_scenario):
    from fedelastic import environment as env_module
    from fedelastic.selection.strategy import make_strategy

    sc = make_scenario(train={"strategy": "elastic_tensor", "options": {"rho": 0.5}})
    env = env_module.environment(sc)
    rhos = [0.3 + i * 1e-4 for i in range(3 * env_module.STRATEGY_CACHE)]  # a deadline policy: one per client
    for rho in [None, *rhos, None, rhos[-1]]:
        got = env.strategy(rho)
        options = sc.train.options if rho is None else {**sc.train.options, "rho": rho}
        assert got.config == make_strategy("elastic_tensor", options, src="x").config
    assert len(env._strategies) == env_module.STRATEGY_CACHE
    assert env.strategy(rhos[-1]) is not env.strategy(rhos[-1])  # a fresh instance each call


def _same_record(ours, theirs) -> None:
    assert type(ours) is type(theirs) and ours.object_id == theirs.object_id
    assert list(ours.keys()) == list(theirs.keys())
    assert [type(v) for v in ours.values()] == [type(v) for v in theirs.values()]


@pytest.mark.parametrize(
    "values",
    [
        {"n": 3, "x": 2.5, "z": -0.0, "big": 2**62, "neg": -7},
        {"nan": float("nan"), "inf": float("-inf"), "f64": np.float64(1.25), "f64nan": np.float64("nan")},
        {"ints": [1, 2, 3], "n": 4},  # lists: Flower's constructor
        {"floats": [0.5, 1.5]},
        {},
    ],
)
def test_fast_metric_records_are_flowers_own(values):
    from flwr.app import MetricRecord

    from fedelastic.fl import arrays

    assert arrays._FAST == patches.active("flwr")  # this Flower's constructors were matched at import (a patch)
    ours, theirs = arrays.metric_record(dict(values)), MetricRecord(dict(values))
    _same_record(ours, theirs)
    assert all(a is b or a == b for a, b in zip(ours.values(), theirs.values()))


@pytest.mark.parametrize("bad", [True, np.float32(1.0), np.int64(3), "1", None, [True]])
def test_fast_metric_records_refuse_what_flower_refuses(bad):
    from flwr.app import MetricRecord

    from fedelastic.fl.arrays import metric_record

    with pytest.raises(TypeError) as theirs:
        MetricRecord({"a": 1, "b": bad})
    with pytest.raises(TypeError) as ours:
        metric_record({"a": 1, "b": bad})
    assert str(ours.value) == str(theirs.value)


def test_fast_record_dicts_are_flowers_own():
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from fedelastic.fl import arrays
    from fedelastic.fl.arrays import record_dict

    records = {
        "arrays": arrays.record_from_numpy({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}),
        "metrics": MetricRecord({"loss": 0.25, "steps": 3}),
        "info": ConfigRecord({"fits-reason": "", "flags": [True, False]}),
        "empty": ArrayRecord(),
    }
    _same_record(record_dict(dict(records)), RecordDict(dict(records)))
    assert all(record_dict(dict(records))[k] is v for k, v in records.items())  # the records themselves
    for bad in ({"m": {"loss": 1.0}}, {"s": "text"}, {"n": 1}):  # not one of Flower's records: Flower decides
        with pytest.raises(TypeError) as theirs:
            RecordDict(dict(bad))
        with pytest.raises(TypeError) as ours:
            record_dict(dict(bad))
        assert str(ours.value) == str(theirs.value)


def test_cohorts_carry_a_reselection_interval_across_rounds_as_nodes_do(make_scenario):
    # every 4 steps, 3 steps a round, every client in every round: a probe at steps 0, 4, 8 of each
    # client's own count, i.e. in rounds 1, 2 and 3 but not 4; the state travels like static_elastic's.
    # A mechanics test: an untrained model trained at rho 0.8 for 3 steps a round collapses its predictions by round 3,
    # which would stop the run as diverged before round 4
    per_client, cohort = _both(
        make_scenario, cohorts=2, fleet={"raspberry_pi_4": 2, "jetson_nano": 2}, divergence={"collapse_share": 0},
        train={"strategy": "elastic_tensor", "options": {"rho": 0.8, "interval": 4, "interval_unit": "steps"},
               "max_steps": 3},
        server={"rounds": 4, "clients_per_round": 5},
    )  # fmt: skip
    assert_same_run(per_client, cohort)
    clients = cohort[0]
    trained = clients[clients.steps.eq(3)]
    assert len(trained) and set(trained.partition_id) == set(clients.partition_id)
    by_round = trained.groupby("round").selections.max()
    assert by_round.loc[4] == 0 and (trained[trained["round"] == 4].emulated_overhead_time_s == 0).all()
    assert (by_round.loc[[1, 2, 3]] == 1).all()
