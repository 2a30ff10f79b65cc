"""A run on the Ray backend computes exactly what the same run computes in-process.

Cohort nodes and continual streams through Ray's actors, against the in-process run of the same
scenario (the plain in-process run and its Ray twin: ``tests/integration/test_simulation.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from fedelastic.fl.runner import run_scenario
from tests.support import SMALL_STREAM, assert_same_run, tables_and_model

SIX = {"raspberry_pi_4": 2, "jetson_nano": 2, "stm32h743": 2}


@pytest.mark.ray
@pytest.mark.unpatched
def test_ray_cohorts_equal_per_client_nodes_in_process(make_scenario):
    """Through Ray, two cohort nodes compute exactly what one Flower node per client computes."""
    train = {"strategy": "static_elastic", "options": {"rho": 0.7}, "max_steps": 3}
    server = {"rounds": 2, "clients_per_round": 4}
    per_client = make_scenario(fleet=SIX, train=train, server=server, simulation={"node_mode": "per_client"})
    local = tables_and_model(run_scenario(per_client, run_id="local"))
    # the per-client cohort path (vectorize = "auto" would batch a cohort: equal to rounding only)
    simulation = {"backend": "ray", "num_cpus_per_client": 1, "vectorize": False}
    sc = make_scenario(fleet=SIX, train=train, server=server, simulation=simulation)
    assert sc.simulation.node_mode == "cohort"  # the default
    ray_run = tables_and_model(run_scenario(sc, run_id="ray"))
    assert_same_run(local, ray_run)
    assert np.isfinite(ray_run[0].train_loss).any() and os.cpu_count()


@pytest.mark.ray
@pytest.mark.unpatched
def test_a_stream_on_ray_computes_what_it_computes_in_process(make_scenario):
    # buffers are replayed from (seed, client, round), so any actor builds the same one
    stream = {**SMALL_STREAM, "buffer_policy": "reservoir"}
    ray = make_scenario(server={"rounds": 3}, stream=stream, simulation={"backend": "ray", "num_cpus_per_client": 1})
    local = make_scenario(server={"rounds": 3}, stream=stream)
    a, b = run_scenario(ray, run_id="ray"), run_scenario(local, run_id="local")
    pd.testing.assert_frame_equal(pd.read_parquet(a / "tasks.parquet"), pd.read_parquet(b / "tasks.parquet"))
    drop = ["host_wall_s"]
    pd.testing.assert_frame_equal(
        pd.read_parquet(a / "clients.parquet").drop(columns=drop),
        pd.read_parquet(b / "clients.parquet").drop(columns=drop),
    )
