"""Fleet dynamics end to end: deadline policies, over-commitment, FedBuff, availability and links."""

import math

import numpy as np
import pandas as pd
import pytest

from fedelastic.environment import environment
from fedelastic.errors import ConfigError
from fedelastic.fl.runner import run_scenario
from tests.support import frames

ELASTIC = {"strategy": "random_budget", "options": {"rho": 0.5}, "max_steps": 6}  # no probe: rho is all step time


def _run(make_scenario, run_id, **overrides):
    return frames(run_scenario(make_scenario(**overrides), run_id=run_id))


def test_late_updates_are_never_aggregated(make_scenario, monkeypatch):
    from fedelastic.sim.engine import RoundEngine

    aggregated, now = [], []
    real_update, real_settle = RoundEngine.update, RoundEngine.settle

    def settle_spy(self, rnd, *args):
        now.append(rnd)
        return real_settle(self, rnd, *args)

    def spy(reply):
        aggregated.append((now[-1], reply.pid))
        return real_update(reply)

    monkeypatch.setattr(RoundEngine, "update", staticmethod(spy))
    monkeypatch.setattr(RoundEngine, "settle", settle_spy)
    server_cfg = {"rounds": 2, "policy": "deadline_drop", "deadline_quantile": 0.5}
    clients, rounds = _run(make_scenario, "drop", server=server_cfg)
    late = clients[clients.status == "late"]
    assert len(late) >= 2 and (clients.status == "counted").sum() >= 2
    # on the clock: a late client's download + training + upload ends after the deadline
    done = late.dispatch_s + late.emulated_comm_time_s + late.emulated_train_time_s
    deadline = late["round"].map(rounds.set_index("round").deadline_s)
    assert (done > late.dispatch_s + deadline).all()
    counted = clients[clients.counted]
    assert sorted(aggregated) == sorted(zip(counted["round"], counted.partition_id))
    # the energy a late client spent until the round closed is wasted
    assert (late.wasted_energy_j > 0).all() and (late.wasted_energy_j == late.emulated_energy_j).all()
    assert rounds.wasted_energy_j.iloc[1:].tolist() == pytest.approx(
        late.groupby("round").wasted_energy_j.sum().tolist()
    )
    # every round closes at its deadline, since someone is late in each
    assert rounds.round_time_s.iloc[1:].tolist() == pytest.approx(rounds.deadline_s.iloc[1:].tolist())


def test_a_round_where_everyone_is_late_leaves_the_model_unchanged(make_scenario):
    clients, rounds = _run(make_scenario, "none", server={"rounds": 1, "policy": "deadline_drop", "deadline": 1e-6})
    assert (clients.status == "late").all()
    assert rounds.test_accuracy.iloc[1] == rounds.test_accuracy.iloc[0]
    assert rounds.test_loss.iloc[1] == rounds.test_loss.iloc[0]


def test_deadline_elastic_gives_each_client_its_rho(make_scenario):
    server_cfg = {"rounds": 2, "policy": "deadline_elastic", "deadline_quantile": 0.2}
    sc = make_scenario(train=ELASTIC, server=server_cfg)
    clients, rounds = frames(run_scenario(sc, run_id="elastic"))
    env = environment(sc)
    for _, r in clients.iterrows():  # rho by hand: (D - full download - full upload) / (steps * full step time)
        cost = env.cost(r.device)
        profile = env.profile(r.device)
        comm = 2 * profile.latency_s.value + 8 * cost.bytes_down() * (
            1 / profile.downlink_bit_per_s.value + 1 / profile.uplink_bit_per_s.value
        )
        deadline = rounds.set_index("round").deadline_s[r["round"]]
        steps = min(6, math.ceil(r.num_examples / 16))
        assert r.rho == pytest.approx(min(1.0, (deadline - comm) / (steps * cost.full_step_time_s())))
    slow = clients[clients.rho <= 0]  # the MCU cannot even download and upload in time
    assert len(slow) and (slow.status == "too_slow").all()
    assert (slow.steps == 0).all() and (slow.emulated_bytes_up == 0).all() and (slow.fraction_params_trained == 0).all()
    trained = clients[clients.status == "counted"]
    assert (trained.rho < 1).any()  # somebody trains part of the model ...
    partial = trained[trained.rho < 1]
    assert (partial.fraction_params_trained < 1).all()
    # ... and every counted update arrives by the deadline
    deadline = trained["round"].map(rounds.set_index("round").deadline_s)
    assert (trained.arrival_s <= trained.dispatch_s + deadline + 1e-12).all()
    assert (clients.status != "late").all()


def test_deadline_elastic_with_a_rho_floor_cuts_steps_instead(make_scenario):
    server_cfg = {"rounds": 2, "policy": "deadline_elastic", "deadline_quantile": 0.2, "min_rho": 0.9}
    clients, rounds = _run(make_scenario, "floor", train=ELASTIC, server=server_cfg)
    ran = clients[clients.status == "counted"]
    assert (ran.rho >= 0.9 - 1e-12).all()
    cut = ran[ran.step_cap >= 0]
    assert len(cut) and (cut.steps == cut.step_cap).all() and (cut.step_cap < 6).all()
    deadline = ran["round"].map(rounds.set_index("round").deadline_s)
    assert (ran.arrival_s <= ran.dispatch_s + deadline + 1e-12).all()
    with pytest.raises(ConfigError, match="server.min_rho"):
        make_scenario(server={"policy": "deadline_drop", "deadline": 1.0, "min_rho": 0.5})


def test_deadline_rho_leaves_time_for_the_probe(make_scenario):
    server_cfg = {"rounds": 1, "policy": "deadline_elastic", "deadline": 0.3}
    probe = {"strategy": "elastic_tensor", "options": {"interval": 1000}, "max_steps": 6}
    with_probe, _ = _run(make_scenario, "probe", train=probe, server=server_cfg)
    without, _ = _run(make_scenario, "noprobe", train=ELASTIC, server=server_cfg)
    env = environment(make_scenario(train=probe))
    checked = 0
    for (_, a), (_, b) in zip(with_probe.iterrows(), without.iterrows()):
        if b.rho < 1:  # rho times the full-training time shrinks by exactly one probe
            steps = min(6, math.ceil(a.num_examples / 16))
            full = steps * env.cost(a.device).full_step_time_s()
            assert (b.rho - a.rho) * full == pytest.approx(env.cost(a.device).probe_time_s("importance"))
            checked += 1
    assert checked >= 1


def test_deadline_elastic_needs_a_rho_strategy(make_scenario):
    with pytest.raises(ConfigError, match="train.strategy"):
        make_scenario(server={"policy": "deadline_elastic", "deadline": 1.0})
    with pytest.raises(ConfigError, match="server.deadline"):
        make_scenario(server={"policy": "deadline_drop"})
    with pytest.raises(ConfigError, match="server.deadline"):
        make_scenario(server={"policy": "wait_all", "deadline": 3.0})


def test_fewer_steps_runs_what_fits(make_scenario):
    train = {"max_steps": 6}
    server_cfg = {"rounds": 2, "policy": "deadline_fewer_steps", "deadline_quantile": 0.6}
    clients, rounds = _run(make_scenario, "fewer", train=train, server=server_cfg)
    ran = clients[clients.status != "too_slow"]
    assert (ran.steps == ran.step_cap).all() and (ran.status == "counted").all()
    assert (clients.step_cap < 6).any()
    deadline = ran["round"].map(rounds.set_index("round").deadline_s)
    assert (ran.arrival_s <= ran.dispatch_s + deadline + 1e-12).all()


def test_overcommit_keeps_the_first_k(make_scenario):
    sc = {"rounds": 3, "policy": "overcommit", "clients_per_round": 2, "overcommit": 1.5}
    clients, rounds = _run(make_scenario, "over", server=sc)
    assert clients.groupby("round").size().eq(3).all()  # ceil(2 * 1.5) sampled
    assert clients.groupby("round").counted.sum().eq(2).all()
    for _, g in clients.groupby("round"):
        kept, extra = g[g.counted], g[~g.counted]
        assert kept.arrival_s.max() <= extra.arrival_s.min()
        assert (extra.status == "extra").all()
    assert rounds.sim_time_s.diff().iloc[1:].tolist() == pytest.approx(
        clients[clients.counted].groupby("round").apply(lambda g: (g.arrival_s - g.dispatch_s).max()).tolist()
    )


def test_fedbuff_records_staleness_and_versions(make_scenario):
    server_cfg = {"rounds": 4, "policy": "async", "concurrency": 3, "buffer_size": 2}
    clients, rounds = _run(make_scenario, "async", server=server_cfg)
    assert list(rounds["round"]) == [0, 1, 2, 3, 4]
    counted = clients[clients.counted]
    assert counted.groupby("round").size().eq(2).all()
    # an update aggregated into version v was trained on version v - 1 - staleness
    assert (counted.staleness == counted["round"] - 1 - counted.model_version).all()
    assert (counted.staleness > 0).any()
    assert rounds.sim_time_s.is_monotonic_increasing
    # each aggregation happens at its last arrival
    last = counted.groupby("round").arrival_s.max()
    assert rounds.set_index("round").sim_time_s.loc[1:].tolist() == pytest.approx(last.tolist())
    # at most 3 clients in flight at any time
    trips = clients.dropna(subset=["dispatch_s"])
    ends = trips.arrival_s.fillna(trips.finish_s)
    for t in trips.dispatch_s:
        assert ((trips.dispatch_s <= t) & (ends > t)).sum() <= 3


def test_clients_going_offline_send_nothing_and_waste_energy(make_scenario):
    availability = {"model": "sessions", "mean_session_s": 0.15, "mean_offline_s": 0.15}
    clients, rounds = _run(make_scenario, "avail", availability=availability, server={"rounds": 6})
    offline = clients[clients.status == "offline"]
    assert len(offline) > 0
    assert offline.arrival_s.isna().all() and (offline.wasted_energy_j > 0).all()
    full = clients[clients.counted].groupby("device").emulated_energy_j.max()
    assert (offline.wasted_energy_j < offline.device.map(full)).all()  # it stopped part-way
    assert (rounds.clients_offline.iloc[1:].sum()) == len(offline)


def test_lognormal_links_vary_per_client(make_scenario):
    fleet = {"raspberry_pi_4": 4, "jetson_nano": 0, "stm32h743": 0}
    clients, _ = _run(make_scenario, "net", fleet=fleet, network={"model": "lognormal", "sigma": 0.7})
    first = clients[clients["round"] == 1]
    assert first.uplink_bit_per_s.nunique() == 4 and first.emulated_comm_time_s.nunique() == 4
    nominal = environment(make_scenario(fleet=fleet)).profile("raspberry_pi_4")
    ratio = first.uplink_bit_per_s / nominal.uplink_bit_per_s.value
    assert np.allclose(ratio, first.downlink_bit_per_s / nominal.downlink_bit_per_s.value)


def test_network_trace_sets_the_links(make_scenario, tmp_path):
    path = tmp_path / "links.csv"
    pd.DataFrame(
        {"client_id": range(4), "uplink_bit_per_s": [1e5, 2e5, 4e5, 8e5], "downlink_bit_per_s": [1e6] * 4}
    ).to_csv(path, index=False)
    clients, _ = _run(make_scenario, "trace", network={"model": "trace", "trace": str(path)})
    first = clients[clients["round"] == 1].set_index("partition_id")
    assert first.uplink_bit_per_s.tolist() == [1e5, 2e5, 4e5, 8e5]
    nano = first.loc[first.device == "jetson_nano"].iloc[0]
    latency = environment(make_scenario()).profile("jetson_nano").latency_s.value
    expected = 2 * latency + 8 * nano.emulated_bytes_down / 1e6 + 8 * nano.emulated_bytes_up / nano.uplink_bit_per_s
    assert nano.emulated_comm_time_s == pytest.approx(expected)


POLICIES = {
    "wait_all": {},
    "deadline_drop": {"deadline_quantile": 0.5},
    "deadline_fewer_steps": {"deadline_quantile": 0.5},
    "deadline_elastic": {"deadline_quantile": 0.7},
    "overcommit": {"clients_per_round": 2},
    "async": {"concurrency": 3, "buffer_size": 2},
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_is_deterministic(make_scenario, policy):
    kwargs = {
        "server": {"rounds": 2, "policy": policy, **POLICIES[policy]},
        "train": ELASTIC,
        "availability": {"model": "diurnal", "mean_session_s": 0.4, "mean_offline_s": 0.2, "day_s": 2.0},
        "network": {"model": "lognormal"},
    }
    a = _run(make_scenario, f"{policy}-a", **kwargs)
    b = _run(make_scenario, f"{policy}-b", **kwargs)
    for x, y in zip(a, b):
        pd.testing.assert_frame_equal(x, y)
    c = _run(make_scenario, f"{policy}-c", seed=11, **kwargs)
    assert not a[0].drop(columns="partition_id").equals(c[0].drop(columns="partition_id"))


@pytest.mark.ray
def test_deadline_policies_on_ray_match_in_process(make_scenario):
    kwargs = {"server": {"rounds": 2, "policy": "deadline_elastic", "deadline_quantile": 0.7}, "train": ELASTIC}
    ray = _run(make_scenario, "ray", simulation={"backend": "ray", "num_cpus_per_client": 1}, **kwargs)
    local = _run(make_scenario, "local", **kwargs)
    for x, y in zip(ray, local):
        pd.testing.assert_frame_equal(x, y)
    assert (ray[0].status == "counted").any()


def test_bad_fleet_dynamics_keys_name_the_key(make_scenario, tmp_path):
    with pytest.raises(ConfigError, match="availability.trace"):
        make_scenario(availability={"model": "trace"})
    with pytest.raises(ConfigError, match="missing.csv"):
        make_scenario(network={"model": "trace", "trace": str(tmp_path / "missing.csv")})
    with pytest.raises(ConfigError, match="availability.diurnal_amplitude"):
        make_scenario(availability={"model": "diurnal", "diurnal_amplitude": 1.5})
    with pytest.raises(ConfigError, match="server.overcommit"):
        make_scenario(server={"policy": "overcommit", "overcommit": 0.5})
    with pytest.raises(ConfigError, match="server.policy"):
        make_scenario(server={"policy": "fastest"})


def test_timeline_draws_every_phase_and_hatches_what_did_not_count(make_scenario):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedelastic.results.recorder import plot_timeline

    clients, rounds = _run(
        make_scenario, "gantt", server={"rounds": 3, "policy": "deadline_drop", "deadline_quantile": 0.5}
    )
    fig, ax = plt.subplots()
    plot_timeline(rounds, clients, ax, first_rounds=2)
    shown = clients[clients["round"] <= 2]
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert len(bars) == 3 * len(shown)  # download, training, upload of every trip
    hatched = [p for p in bars if p.get_hatch()]
    assert len(hatched) == 3 * (~shown.counted).sum() > 0
    plt.close(fig)


def test_batteries_drain_and_low_clients_refuse(make_scenario):
    # no recharging: a client's charge at its next dispatch is its last one minus what that trip cost
    battery = {"capacity_j": 1.0, "min_fraction": 0.4, "recharge_w": 0.0}
    clients, rounds = _run(make_scenario, "battery", battery=battery, server={"rounds": 3})
    assert (clients.battery_fraction >= 0.4).all()
    for _, g in clients.sort_values("round").groupby("partition_id"):
        spent = (g.emulated_energy_j + g.emulated_idle_energy_j).to_numpy()
        level = g.battery_fraction.to_numpy()
        assert level[0] == 1.0
        assert level[1:] == pytest.approx(level[:-1] - spent[:-1])
        if g["round"].max() < 3:  # it stopped training because its charge fell below 40%
            assert level[-1] - spent[-1] < 0.4
        else:
            assert (level - spent >= 0).all()
    stopped = clients.groupby("partition_id")["round"].max() < 3
    assert stopped.any() and rounds.clients_unavailable.iloc[-1] == stopped.sum()
    with pytest.raises(RuntimeError, match="no client is online and charged"):
        _run(make_scenario, "flat", battery=battery, server={"rounds": 8})


def test_recharging_brings_clients_back_on_schedule(make_scenario):
    battery = {
        "capacity_j": 0.5,
        "min_fraction": 0.9,
        "recharge_w": 1.0,
        "charge_from_s": 5.0,
        "charge_until_s": 6.0,
        "day_s": 10.0,
    }
    clients, rounds = _run(make_scenario, "recharge", battery=battery, server={"rounds": 3})
    # after round 1 nobody is at 90%: the clock waits for the charging window that opens at 5 s
    assert rounds.round_start_s.iloc[2] > 5.0 and rounds.round_start_s.iloc[2] < 6.0
    assert (clients.battery_fraction >= 0.9 - 1e-12).all()


def test_fednova_normalisation_can_be_switched_off(make_scenario, monkeypatch):
    import fedelastic.sim.engine as engine

    calls = []
    real = engine.fednova_rescale
    monkeypatch.setattr(engine, "fednova_rescale", lambda *a: calls.append(1) or real(*a))
    cfg = {"rounds": 1, "policy": "deadline_fewer_steps", "deadline_quantile": 0.5}
    _run(make_scenario, "nova", server=cfg)
    assert calls == [1]
    _run(make_scenario, "plain", server={**cfg, "fednova": False})
    assert calls == [1]
