import numpy as np
import pytest
import torch

import fedelastic.train.pretrain as pretrain_mod
from fedelastic.environment import RunEnvironment
from fedelastic.errors import ConfigError
from fedelastic.train.pretrain import initial_state
from tests.support import small_scenario_dict


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "cache"))


def test_pretrain_is_cached_and_reloaded_weights_only(make_scenario, monkeypatch):
    sc = make_scenario(
        model={"name": "small_cnn", "options": {"width": 4}, "pretrain": {"classes": [0, 1, 2], "epochs": 3}}
    )
    env = RunEnvironment(sc)
    first = initial_state(env)
    init = env.new_model().state_dict()
    assert any(not torch.equal(first[k], init[k]) for k in init)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    monkeypatch.setattr(pretrain_mod, "pretrain", lambda env: pytest.fail("should come from the cache"))
    again = initial_state(RunEnvironment(sc))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert loads and all(kw.get("weights_only") is True for kw in loads)


def test_source_task_never_sees_the_test_split_and_target_is_shifted(make_scenario):
    sc = make_scenario(data={"transform": "rotate90"}, model={"name": "small_cnn", "pretrain": {"classes": [0, 1]}})
    env = RunEnvironment(sc)
    raw_train, raw_test = env.split
    source = env.view(raw_train, (0, 1), "none")
    assert set(np.unique(source.y)) == {0, 1}
    test_rows = {r.tobytes() for r in raw_test.x}
    assert not any(r.tobytes() in test_rows for r in source.x)
    # the target clients see the rotated domain, the source is clean
    np.testing.assert_array_equal(env.data.train.x, np.rot90(raw_train.x, 1, axes=(2, 3)))


def test_user_weights_file_is_checked(make_scenario, tmp_path):
    good = make_scenario()
    path = tmp_path / "w.pt"
    torch.save(RunEnvironment(good).new_model().state_dict(), path)
    state = initial_state(
        RunEnvironment(make_scenario(model={"name": "small_cnn", "options": {"width": 8}, "weights": str(path)}))
    )
    assert set(state) == set(RunEnvironment(good).new_model().state_dict())
    torch.save({"x": torch.zeros(1)}, path)
    with pytest.raises(ConfigError) as info:
        initial_state(
            RunEnvironment(make_scenario(model={"name": "small_cnn", "options": {"width": 8}, "weights": str(path)}))
        )
    assert info.value.key == "model.weights"
    with pytest.raises(ConfigError, match="existing weights file"):
        initial_state(RunEnvironment(make_scenario(model={"name": "small_cnn", "weights": str(tmp_path / "none.pt")})))


def _pretraining_comparison(tmp_path, **compare):

    raw = small_scenario_dict(
        tmp_path, model={"name": "small_cnn", "options": {"width": 4}, "pretrain": {"classes": [0, 1], "epochs": 1}}
    )
    raw["compare"] = {"strategies": ["full"], "seeds": [5, 6, 7], **compare}
    return raw


def test_a_shared_pretrain_runs_once_for_all_seeds_and_equals_a_fresh_pretrain(tmp_path, monkeypatch):
    from fedelastic.comparisons.comparison import expand

    _, cells = expand(_pretraining_comparison(tmp_path, pretrain="shared"), "cmp.toml")
    assert [c.scenario.seed for c in cells] == [5, 6, 7]
    assert {c.scenario.model.pretrain.seed for c in cells} == {5}  # the comparison's first seed
    calls = []
    real = pretrain_mod.pretrain
    monkeypatch.setattr(pretrain_mod, "pretrain", lambda env: calls.append(env.scenario.seed) or real(env))
    states = [initial_state(RunEnvironment(c.scenario)) for c in cells]
    assert calls == [5]  # the seeds 6 and 7 load seed 5's cached weights
    # a fresh pretrain, in a fresh cache, of the plain scenario with seed 5 (pretrain.seed unset)
    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "fresh"))
    plain = expand(_pretraining_comparison(tmp_path, seeds=[5]), "cmp.toml")[1][0].scenario
    assert plain.model.pretrain.seed == -1
    fresh = real(RunEnvironment(plain))
    for state in states:
        assert set(state) == set(fresh) and all(torch.equal(state[k], fresh[k]) for k in fresh)
    # one test set for all: pretraining (on seed 5's training split) never sees a run's test samples
    tests = {RunEnvironment(c.scenario).split[1].x.tobytes() for c in cells}
    assert len(tests) == 1


def test_per_seed_pretrains_differ_and_split_with_their_own_seeds(tmp_path, monkeypatch):
    from fedelastic.comparisons.comparison import expand

    _, cells = expand(_pretraining_comparison(tmp_path, seeds=[5, 6]), "cmp.toml")
    assert {c.scenario.model.pretrain.seed for c in cells} == {-1}
    calls = []
    real = pretrain_mod.pretrain
    monkeypatch.setattr(pretrain_mod, "pretrain", lambda env: calls.append(env.scenario.seed) or real(env))
    a, b = (initial_state(RunEnvironment(c.scenario)) for c in cells)
    assert calls == [5, 6] and any(not torch.equal(a[k], b[k]) for k in a)
    first, second = (RunEnvironment(c.scenario).split[1].x.tobytes() for c in cells)
    assert first != second


def test_a_shared_pretrain_needs_a_pretrain_table(tmp_path):
    from fedelastic.comparisons.comparison import expand

    raw = small_scenario_dict(tmp_path)
    raw["compare"] = {"seeds": [0, 1], "pretrain": "shared"}
    with pytest.raises(ConfigError) as info:
        expand(raw, "cmp.toml")
    assert info.value.key == "compare.pretrain"
