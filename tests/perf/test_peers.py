"""benchmarks/peers.py: one workload definition, shared by the bare loop, fedelastic and pfl.

On a reduced workload (10 clients, 2 rounds of 4) the bare torch loop, fedelastic in-process
(through its public API) and pfl must end with the same model, bit for bit: same data,
partitions, cohorts, batch orders, initial weights and FedAvg arithmetic. pfl is optional
(the ``bench`` extra): its test skips without it.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from tests.support import ROOT

pytestmark = pytest.mark.perf


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_bench", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_bench"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("peers_bench", None)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # every variant trains on one thread (reduction order)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bare(peers):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    wl = peers.Workload(10, 2, 4)
    out: dict = {}
    state = peers.worker_bare(wl, out)
    torch.set_num_threads(before)
    return wl, state, out


def test_model_size(peers):
    assert sum(p.numel() for p in peers.cnn().parameters()) == 6218  # 80 + 1168 + 4640 + 330


def test_fedavg_arithmetic_by_hand(peers):
    current = {"w": np.array([1.0, 5.0], np.float32)}
    updates = [(1, {"w": np.array([2.0, 4.0], np.float32)}), (3, {"w": np.array([6.0, 0.0], np.float32)})]
    # (1*2 + 3*6) / 4 = 5, (1*4 + 3*0) / 4 = 1
    np.testing.assert_array_equal(peers.fedavg(updates, current)["w"], np.array([5.0, 1.0], np.float32))


def test_cohorts_and_orders(peers):
    wl = peers.Workload(10, 2, 4)
    assert sum(len(p) for p in wl.partitions) == len(wl.train)  # every training sample with one client
    for rnd in (1, 2):
        cohort = wl.cohort(rnd)
        assert len(cohort) == len(set(cohort)) == 4 and cohort == sorted(cohort)
        for pid in cohort:
            order = wl.order(rnd, pid)
            assert sorted(order.tolist()) == list(range(len(wl.partitions[pid])))  # a permutation
    big = int(np.argmax([len(p) for p in wl.partitions]))
    assert not np.array_equal(wl.order(1, big), wl.order(2, big))  # reshuffled every round


def test_bare_trains(bare, peers):
    wl, state, out = bare
    initial = {k: v.detach().numpy() for k, v in peers.initial_model().state_dict().items()}
    assert len(out["stamps"]) == wl.rounds + 1
    assert any(not np.array_equal(state[k], initial[k]) for k in initial)


@pytest.mark.parametrize("vectorize", [False, "auto"])
def test_fedelastic_inprocess_matches_the_bare_loop(bare, peers, tmp_path, one_thread, vectorize):
    """The per-client loop ends on the bare loop's bytes; the default ("auto": vectorised on this
    small model) on the same model to float32 rounding (a batched step sums in another order)."""
    from fedelastic import api

    wl, state, _ = bare
    scenario = wl.scenario("inprocess", str(tmp_path))
    scenario["simulation"]["vectorize"] = vectorize
    result = api.run(scenario)
    assert result.status["training_path"].startswith("vectorised" if vectorize else "per-client")
    clients = result.clients
    for rnd in (1, 2):  # the same cohorts, partition sizes and so example weights
        rows = clients[clients["round"] == rnd].sort_values("partition_id")
        assert rows["partition_id"].tolist() == wl.cohort(rnd)
        assert rows["num_examples"].tolist() == [len(wl.partitions[p]) for p in wl.cohort(rnd)]
    final = torch.load(result.run_dir / "checkpoint.pt", weights_only=True)["model"]
    final = {k: v.numpy() for k, v in final.items()}
    if vectorize is False:
        assert peers.checksum(final) == peers.checksum(state)
    for k in state:
        np.testing.assert_allclose(final[k], state[k], atol=1e-6, err_msg=k)


def test_pfl_matches_the_bare_loop(bare, peers, one_thread):
    pytest.importorskip("pfl", reason="pfl is optional (pip install -e '.[bench]')")
    wl, state, _ = bare
    out: dict = {}
    final = peers.worker_pfl(wl, out)
    assert len(out["stamps"]) == wl.rounds + 1
    assert peers.checksum(final) == peers.checksum(state)


def test_missing_pfl_is_one_line(peers, monkeypatch):
    monkeypatch.setattr(peers, "have_pfl", lambda: False)
    with pytest.raises(SystemExit, match="pfl is not installed"):
        peers.main(["--variants", "pfl", "pfl2", "--runs", "1"])


def test_scale_part_without_scale_py(peers, monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="benchmarks/scale.py"):
        peers.main(["--part", "scale"])
