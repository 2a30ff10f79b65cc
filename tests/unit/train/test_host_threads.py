"""Host-side loops (pretraining, the server's evaluation) run on ``simulation.torch_threads``, as clients do."""

from __future__ import annotations

import torch

from fedelastic.environment import RunEnvironment
from fedelastic.train.pretrain import pretrain
from fedelastic.train.trainer import torch_threads

MODEL = '''
import torch
from torch import nn


class Recording(nn.Module):
    """A linear model that appends torch's thread count at each forward pass to the file ``log``."""

    def __init__(self, log, num_classes=10, in_channels=1, input_size=8):
        super().__init__()
        self.log = log
        self.fc = nn.Linear(in_channels * input_size * input_size, num_classes)

    def forward(self, x):
        with open(self.log, "a") as f:
            f.write(f"{torch.get_num_threads()} ")
        return self.fc(x.flatten(1))


def net(**kw):
    return Recording(**kw)
'''


def test_torch_threads_sets_the_count_inside_and_restores_it():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_pretraining_runs_on_the_scenarios_torch_threads(make_scenario, tmp_path):
    (tmp_path / "recording.py").write_text(MODEL)
    log = tmp_path / "threads.log"
    sc = make_scenario(
        model={"name": f"{tmp_path / 'recording.py'}:net", "options": {"log": str(log)}, "pretrain": {"epochs": 1}},
        simulation={"torch_threads": 1},
    )
    env = RunEnvironment(sc)
    _ = env.info  # the model is traced once (on the caller's threads) before pretraining starts
    log.unlink(missing_ok=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # torch's default on a 2-core machine
        pretrain(env)
        assert torch.get_num_threads() == 2  # the caller's count is restored
    finally:
        torch.set_num_threads(before)
    seen = log.read_text().split()
    assert len(seen) > 40 and set(seen) == {"1"}  # 45 steps of batch 32, then the evaluation
