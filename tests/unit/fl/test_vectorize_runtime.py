"""``simulation.vectorize``: a cohort call trains its clients as one batched model (fedelastic/train/vectorized.py)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from fedelastic.errors import ConfigError
from fedelastic.fl.runner import run_scenario

SIX = {"raspberry_pi_4": 2, "jetson_nano": 2, "stm32h743": 2}
TRAIN = {"strategy": "elastic_tensor", "options": {"rho": 0.7}, "max_steps": 3, "numerics": "fp32", "bn_mode": "frozen"}


# the shipped scenarios' defaults: BatchNorm on batch statistics, stm32h743 in int8
SHIPPED = {**TRAIN, "numerics": "device", "bn_mode": "train"}


def _run(make_scenario, vectorize: bool, run_id: str, train=TRAIN):
    """(clients table, final model) of a 2-round run; its status.json names the path it took."""
    sc = make_scenario(
        fleet=SIX, train=train, server={"rounds": 2, "clients_per_round": 4},
        simulation={"node_mode": "cohort", "cohorts": 2, "vectorize": vectorize},
    )  # fmt: skip
    run_dir = run_scenario(sc, run_id=run_id)
    path = json.loads((run_dir / "status.json").read_text())["training_path"]
    assert path == ("vectorised: simulation.vectorize = true" if vectorize else "per-client: simulation.vectorize = false")
    clients = pd.read_parquet(run_dir / "clients.parquet").drop(columns=["host_wall_s"])
    model = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    return clients, model


@pytest.mark.parametrize("train", [TRAIN, SHIPPED], ids=["fp32-frozen", "int8-batch-statistics"])
def test_vectorised_cohorts_train_what_the_per_client_loop_trains(make_scenario, monkeypatch, train):
    import fedelastic.train.vectorized as vectorized

    calls = []
    real = vectorized.train_partitions_vmap
    monkeypatch.setattr(
        vectorized, "train_partitions_vmap", lambda env, model, jobs: calls.append(len(jobs)) or real(env, model, jobs)
    )
    loop, loop_model = _run(make_scenario, False, "loop", train)
    assert calls == []
    vec, vec_model = _run(make_scenario, True, "vmap", train)
    assert sum(calls) == 8 and len(calls) == 4  # 2 cohorts a round, 2 rounds
    assert len(vec) == 8 and vec.steps.gt(0).all()
    # host-side figures (selections, pricing, steps) are the same numbers; the losses and weights
    # agree to float32 rounding (the batched model sums in another order)
    loss = [c for c in vec.columns if "loss" in c]
    pd.testing.assert_frame_equal(vec.drop(columns=loss), loop.drop(columns=loss), check_exact=True)
    np.testing.assert_allclose(vec[loss].to_numpy(float), loop[loss].to_numpy(float), rtol=1e-5)
    for name, value in loop_model.items():
        np.testing.assert_allclose(vec_model[name].numpy(), value.numpy(), atol=1e-5, err_msg=name)


def test_what_cannot_be_vectorised_stops_the_run_naming_the_key(make_scenario):
    sc = make_scenario(train={**TRAIN, "numerics": "device", "qas": False}, simulation={"vectorize": True})  # stm32h743: int8
    with pytest.raises(ConfigError, match=r"train\.qas") as err:
        run_scenario(sc, run_id="refused")
    assert "tiny.toml" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"simulation\.vectorize"):
        make_scenario(simulation={"vectorize": True, "node_mode": "per_client"})
