"""End-to-end runs: determinism in-process, and one real Flower simulation on Ray."""

import json
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import tomli_w

from fedelastic.comparisons.comparison import expand, expand_tuning
from fedelastic.fl.runner import run_scenario
from fedelastic.runtime import patches
from fedelastic.scenario import load_scenario
from tests.support import ROOT, frames, processes_with


def test_same_seed_same_per_client_metrics(make_scenario):
    sc = make_scenario(server={"rounds": 3, "clients_per_round": 3})
    a = run_scenario(sc, run_id="a")
    b = run_scenario(sc, run_id="b")
    ca, ra = frames(a)
    cb, rb = frames(b)
    pd.testing.assert_frame_equal(ca, cb)
    pd.testing.assert_frame_equal(ra, rb)
    # sampling: 3 of 4 clients per round, not always the same ones
    assert ca.groupby("round").size().eq(3).all()
    assert ca.groupby("round").partition_id.apply(tuple).nunique() > 1
    c2, _ = frames(run_scenario(make_scenario(seed=4, server={"rounds": 3, "clients_per_round": 3}), run_id="c"))
    assert not ca.equals(c2)


def test_run_folder_contents(make_scenario):
    run_dir = run_scenario(make_scenario(), run_id="x")
    for name in ("clients.csv", "clients.parquet", "rounds.csv", "rounds.parquet", "config.toml", "versions.json"):
        assert (run_dir / name).exists(), name
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    clients = pd.read_csv(run_dir / "clients.csv")
    assert len(clients) == 2 * 4 and set(clients["round"]) == {1, 2}
    for col in (
        "emulated_train_time_s",
        "emulated_train_time_band_s",
        "emulated_energy_j",
        "emulated_peak_memory_bytes",
        "emulated_bytes_up",
        "host_wall_s",
        "train_loss",
        "num_examples",
        "fraction_params_trained",
    ):
        assert clients[col].notna().all(), col
    assert (clients.emulated_train_time_band_s >= 0).all()
    rounds = pd.read_csv(run_dir / "rounds.csv")
    assert list(rounds["round"]) == [0, 1, 2]
    # synchronous clock: a round lasts as long as its slowest client's train + comm time
    slowest = (clients.emulated_train_time_s + clients.emulated_comm_time_s).groupby(clients["round"]).max()
    assert rounds.sim_time_s.diff().iloc[1:].tolist() == pytest.approx(slowest.tolist())


def test_last_layer_trains_only_the_head(make_scenario):
    run_dir = run_scenario(make_scenario(train={"strategy": "last_layer"}), run_id="ll")
    clients = pd.read_parquet(run_dir / "clients.parquet")
    assert (clients.fraction_params_trained < 0.2).all()
    full = pd.read_parquet(run_scenario(make_scenario(), run_id="full") / "clients.parquet")
    assert (clients.emulated_bytes_up < full.emulated_bytes_up).all()
    assert (clients.emulated_train_time_s < full.emulated_train_time_s).all()


def test_finished_rounds_survive_a_crash(make_scenario, monkeypatch):
    import fedelastic.fl.server as server

    original = server.EngineStrategy.settle

    def crash_in_round_2(self, plan, replies, arrays):
        if plan.round == 2:
            raise KeyboardInterrupt("killed")
        return original(self, plan, replies, arrays)

    monkeypatch.setattr(server.EngineStrategy, "settle", crash_in_round_2)
    sc = make_scenario(server={"rounds": 3})
    with pytest.raises(KeyboardInterrupt):
        run_scenario(sc, run_id="crash")
    run_dir = Path(sc.output_dir) / "tiny" / "crash"
    assert list(pd.read_parquet(run_dir / "rounds.parquet")["round"]) == [0, 1]
    assert len(pd.read_csv(run_dir / "clients.csv")) == 4
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"


@pytest.mark.ray
@pytest.mark.unpatched
def test_real_ray_backend_two_rounds_four_clients(make_scenario, monkeypatch, tmp_path):
    # static_elastic keeps per-node state across rounds, which must survive Ray's actor pool too
    train = {"strategy": "static_elastic", "options": {"rho": 0.7}}
    sc = make_scenario(train=train, simulation={"backend": "ray", "num_cpus_per_client": 1})
    monkeypatch.setenv("FEDELASTIC_TEST_RUN", str(tmp_path))  # Ray's processes inherit it: find them after the run
    mark = f"FEDELASTIC_TEST_RUN={tmp_path}".encode()
    during: list[str] = []
    run_dir = run_scenario(sc, run_id="ray", progress=lambda row: during.extend(processes_with(mark).values()))
    if Path("/proc/self/environ").exists():
        assert any("raylet" in p for p in during)  # the check below sees Ray's processes ...
        if patches.active("ray"):  # ... and a local cluster runs no autoscaler monitor
            assert not any("autoscaler" in p for p in during)
    assert not processes_with(mark)  # the run left no Ray process behind
    clients, rounds = frames(run_dir)
    assert len(clients) == 8 and list(rounds["round"]) == [0, 1, 2]
    assert (clients[clients["round"] == 2].emulated_overhead_time_s == 0).all()
    # the Ray run computes exactly what the in-process run computes
    local_clients, local_rounds = frames(run_scenario(make_scenario(train=train), run_id="local"))
    pd.testing.assert_frame_equal(clients, local_clients)
    pd.testing.assert_frame_equal(rounds, local_rounds)


def test_static_elastic_keeps_its_first_selection_across_rounds(make_scenario):
    sc = make_scenario(train={"strategy": "static_elastic", "options": {"rho": 0.7}}, server={"rounds": 3})
    clients = pd.read_parquet(run_scenario(sc, run_id="static") / "clients.parquet")
    trained = clients[clients.steps > 0]
    assert trained.partition_id.nunique() >= 2
    for _, g in trained.groupby("partition_id"):
        g = g.sort_values("round")
        assert g.emulated_overhead_time_s.iloc[0] > 0  # the probe runs once ...
        assert (g.emulated_overhead_time_s.iloc[1:] == 0).all()  # ... and never again
        assert g.fraction_params_trained.nunique() == 1


@pytest.mark.parametrize("path", sorted((ROOT / "simulations").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_scenarios_validate(path):
    raw = tomllib.loads(path.read_text())
    if "compare" in raw:
        assert expand(raw, str(path))[1]
        expand_tuning(raw, str(path))  # a [compare.tune] table validates too
    else:
        assert load_scenario(path).name == raw["name"]


def test_declared_availability_drops_clients_reproducibly(make_scenario, tmp_path, profile_raw):
    folder = tmp_path / "devices"
    folder.mkdir()
    profile_raw.update(name="flaky_nano", availability={"probability": {"value": 0.5, "unit": "1", "source": "test"}})
    (folder / "flaky_nano.toml").write_text(tomli_w.dumps(profile_raw))
    sc = make_scenario(fleet={"flaky_nano": 6, "raspberry_pi_4": 2}, device_dirs=[str(folder)], server={"rounds": 4})
    clients, rounds = frames(run_scenario(sc, run_id="avail"))
    per_round = clients.groupby("round").device.apply(list)
    assert all(r.count("raspberry_pi_4") == 2 for r in per_round)  # always available
    flaky = [r.count("flaky_nano") for r in per_round]
    assert min(flaky) < 6 and max(flaky) > 0
    assert (rounds.clients_unavailable.iloc[1:] == [6 - f for f in flaky]).all()
    again, _ = frames(run_scenario(sc, run_id="avail2"))
    pd.testing.assert_frame_equal(clients, again)


def test_a_users_own_model_factory_runs(make_scenario, tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\n\n"
        "def tiny_mlp(num_classes, in_channels, input_size, hidden=12):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size**2, hidden), nn.ReLU(),\n"
        "                         nn.Linear(hidden, num_classes))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sc = make_scenario(model={"name": "my_models:tiny_mlp", "options": {"hidden": 7}}, train={"strategy": "last_layer"})
    clients, rounds = frames(run_scenario(sc, run_id="user"))
    assert len(rounds) == 3 and clients.fits.all()
    assert clients.fraction_params_trained.iloc[0] == pytest.approx((7 * 10 + 10) / (64 * 7 + 7 + 7 * 10 + 10))


def test_a_failing_client_is_recorded_and_the_round_goes_on(make_scenario, monkeypatch):
    import fedelastic.fl.client as client

    real = client.train_local

    def flaky(*args, seed, **kwargs):
        if seed[2] == 1:  # partition 1 always fails
            raise RuntimeError("device fell over")
        return real(*args, seed=seed, **kwargs)

    monkeypatch.setattr(client, "train_local", flaky)
    run_dir = run_scenario(make_scenario(simulation={"vectorize": False}), run_id="flaky")  # train_local patched: per-client
    clients = pd.read_parquet(run_dir / "clients.parquet")
    bad = clients[clients.partition_id == 1]
    assert len(bad) == 2 and bad.error.str.contains("device fell over").all() and bad.emulated_energy_j.isna().all()
    good = clients[clients.partition_id != 1]
    assert (good.error == "").all() and good.emulated_energy_j.notna().all()
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    assert list(rounds.clients_failed) == [0, 1, 1] and rounds.total_energy_j.notna().all()


def test_clients_report_probe_memory_and_why_they_do_not_fit(make_scenario):
    # mcu_net width 16 on the STM32F746 (320 KiB): full training needs ~1.1 MiB, so it never fits;
    # elastic_tensor's importance probe must fit (in pieces) and is reported
    fleet = {"stm32f746": 2}
    model = {"name": "mcu_net", "options": {"width": 16}}
    full = run_scenario(make_scenario(fleet=fleet, model=model, train={"strategy": "full"}), run_id="f")
    clients = pd.read_parquet(full / "clients.parquet")
    clients = clients[(clients["round"] > 0) & (clients.device == "stm32f746")]  # the fixture's fleet is merged in
    assert len(clients) and not clients.fits.any() and clients.fits_reason.str.contains("selection needs").all()
    assert (clients.emulated_probe_peak_memory_bytes == 0).all()
    et = run_scenario(
        make_scenario(fleet=fleet, model=model, train={"strategy": "elastic_tensor", "options": {"rho": 0.4}}),
        run_id="e",
    )
    clients = pd.read_parquet(et / "clients.parquet")
    clients = clients[(clients["round"] > 0) & (clients.device == "stm32f746")]
    assert len(clients) and clients.fits.all() and (clients.fits_reason == "").all()
    # a round that probes reports its peak; one that trains the selection carried from an earlier
    # round (the 4-epoch interval runs across rounds) runs no probe
    probed = clients.selections > 0
    assert probed.any() and (clients[probed].emulated_probe_peak_memory_bytes > 0).all()
    assert (clients[~probed].emulated_probe_peak_memory_bytes == 0).all()
    assert (clients.emulated_probe_peak_memory_bytes <= clients.device_memory_bytes).all()
    assert (clients.emulated_peak_memory_bytes >= clients.emulated_probe_peak_memory_bytes).all()
