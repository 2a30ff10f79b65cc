"""Cohort mode on Ray: a cohort whose worker process dies is split, and only the client that
kills it fails (the others of its cohort train, and no client row goes missing)."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from fedelastic.environment import environment
from fedelastic.fl.runner import run_scenario

SIX = {"raspberry_pi_4": 2, "jetson_nano": 2, "stm32h743": 2}

EXIT_MODEL = """
import os
from torch import nn


def net(num_classes, in_channels, input_size, size=0):
    body = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size**2, num_classes))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, x):
            if self.training and x.shape[0] == size:  # one client's whole batch: its worker dies, every time
                os._exit(1)
            return self.body(x)

    return Net()
"""


@pytest.mark.ray
@pytest.mark.patched
def test_ray_a_cohort_whose_worker_dies_is_split_and_only_the_culprit_fails(make_scenario, tmp_path, monkeypatch):
    (tmp_path / "exit_models.py").write_text(EXIT_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = make_scenario(fleet=SIX, train={"batch_size": 512, "max_steps": 1})
    sizes = [len(environment(probe).data.client(p)) for p in range(6)]
    culprit = next(p for p, n in enumerate(sizes) if sizes.count(n) == 1 and n > 1)  # a batch size only it has
    sc = make_scenario(
        fleet=SIX, train={"batch_size": 512, "max_steps": 1}, server={"rounds": 1},
        model={"name": "exit_models:net", "options": {"size": sizes[culprit]}},
        # the per-client cohort path, whose clients each run their own forward (a vectorised cohort is one batch)
        simulation={"backend": "ray", "num_cpus_per_client": 1, "client_retries": 0, "cohorts": 2, "vectorize": False},
    )  # fmt: skip
    clients = pd.read_parquet(run_scenario(sc, run_id="exit") / "clients.parquet")
    assert len(clients) == 6  # no client vanished
    failed = clients[clients.status == "failed"]
    assert failed.partition_id.tolist() == [culprit] and "died" in failed.error.iloc[0]
    assert clients[clients.status != "failed"].steps.eq(1).all()
