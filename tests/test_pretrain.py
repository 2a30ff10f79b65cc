import numpy as np
import pytest
import torch

import fedelastic.pretrain as pretrain_mod
from fedelastic.errors import ConfigError
from fedelastic.fl.env import RunEnvironment
from fedelastic.pretrain import initial_state


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
