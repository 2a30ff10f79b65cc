"""The few-shot reproductions' per-group learning rates, against torch's own two-group SGD."""

import importlib.util
import os

import numpy as np
import pytest
import torch

from fedelastic.train.optim import SGD
from tests.support import ROOT


@pytest.fixture(scope="module")
def fs():
    spec = importlib.util.spec_from_file_location("fewshot", ROOT / "benchmarks" / "reproduce" / "fewshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def test_group_lrs_train_the_biases_at_their_own_rate_as_a_two_group_sgd_does(fs):
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    lr = {"head": 0.1, "bias": 0.02}
    ours, ref = _model(), _model()
    head = list(ref[-1].parameters())
    others = [p for p in ref.parameters() if all(p is not h for h in head)]
    # torch's reference: the head at 0.1; the other bias at 0.02; the other weight (not trained here) at 0.1
    opt_ref = torch.optim.SGD([{"params": head + [others[0]], "lr": 0.1}, {"params": [others[1]], "lr": 0.02}],
                              lr=0.1, momentum=0.9, weight_decay=fs.WEIGHT_DECAY)  # fmt: skip
    opt = SGD(list(ours.parameters()), lr=0.1, momentum=0.9, weight_decay=fs.WEIGHT_DECAY)
    with fs.group_lrs(ours, lr) as base:
        assert base == 0.1
        for _ in range(3):
            for model, o in ((ours, opt), (ref, opt_ref)):
                o.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                o.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-7)
    before = [p.detach().clone() for p in ours.parameters()]  # outside the context: one rate again
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ours(x), y).backward()
    grads = [p.grad.clone() for p in ours.parameters()]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in ours.parameters()]
    opt.step()
    for p, p0, g, buf in zip(ours.parameters(), before, grads, bufs):
        expected = p0 - 0.1 * (0.9 * buf + g + fs.WEIGHT_DECAY * p0)
        np.testing.assert_allclose(p.detach().numpy(), expected.numpy(), rtol=1e-5, atol=1e-7)


def test_group_lrs_refuse_an_unknown_group(fs):
    with pytest.raises(ValueError, match="'head'"):
        with fs.group_lrs(_model(), {"bias": 0.1}):
            pass
    with pytest.raises(ValueError, match="norm"):
        with fs.group_lrs(_model(), {"head": 0.1, "norm": 0.1}):
            pass


def test_an_arm_with_lr_groups_searches_each_group_in_turn_along_a_hand_worked_sequence(fs, monkeypatch):
    import math

    def score(head, bias):  # best at head 0.3, bias 0.003; 0.1 lost per decade away from each
        return 1 - 0.1 * (abs(math.log10(head / 0.3)) + abs(math.log10(bias / 0.003)))

    def fake(state, arm, lr, seed, train, test, steps, batch):
        head, bias = (lr["head"], lr["bias"]) if isinstance(lr, dict) else (lr, lr)
        return {"accuracy": score(head, bias), "diverged": False, "fits": True}

    monkeypatch.setattr(fs, "run_task", fake)
    arms = [{"label": "one", "strategy": "bn_bias"},
            {"label": "two", "strategy": "bn_bias", "lr_groups": ["head", "bias"], "start": "one"}]  # fmt: skip
    out = fs.tune_and_run(arms, lambda split, key: [(None, None, 1, 1, key)], [0, 1], log=lambda *_: None,
                          lrs=(0.001, 0.01, 0.1), max_widen=3)  # fmt: skip
    # one lr: 0.01 and 0.1 tie at 0.8 (any rate in [0.003, 0.3]); the smaller wins, inside the grid
    assert out["one"]["lr"] == 0.01 and [t["lr"] for t in out["one"]["tuning"]] == [0.001, 0.01, 0.1]
    # head (bias 0.01): 0.1 at the top, widened to 1.0 (worse): 0.1. bias (head 0.1): 0.001 at the bottom,
    # widened to 0.0001 (worse): 0.001
    two = out["two"]
    assert two["lr"] == {"head": 0.1, "bias": 0.001}
    assert [(t["group"], t["lr"]["head"], t["lr"]["bias"]) for t in two["tuning"]] == [
        ("head", 0.001, 0.01), ("head", 0.01, 0.01), ("head", 0.1, 0.01), ("head", 1.0, 0.01),
        ("bias", 0.1, 0.001), ("bias", 0.1, 0.01), ("bias", 0.1, 0.1), ("bias", 0.1, 0.0001),
    ]  # fmt: skip
    assert [(s["group"], s["edge"], s["added"]) for s in two["searches"]] == [("head", "", 1), ("bias", "", 1)]
    assert two["mean"] == pytest.approx(score(0.1, 0.001)) and fs.lr_cell(two) == "head 0.1, bias 0.001"


def test_arms_in_parallel_processes_give_the_serial_numbers_and_report_a_failure(fs, monkeypatch):
    def fake(state, arm, lr, seed, train, test, steps, batch):
        if arm["label"] == "broken":
            raise ValueError("no such layer")
        return {"accuracy": 0.5 + seed / 10 - abs(lr - 0.01), "diverged": False, "fits": True}

    monkeypatch.setattr(fs, "run_task", fake)
    tasks = lambda split, key: [(None, None, 1, 1, key)]  # noqa: E731
    pid = os.getpid()
    arms = [{"label": "a", "strategy": "full", "prepare": lambda: os.getpid() != pid},
            {"label": "b", "strategy": "last_layer"}]  # fmt: skip
    serial = fs.tune_and_run(arms, tasks, [0, 1], log=lambda *_: None, lrs=(0.001, 0.01, 0.1))
    parallel = fs.tune_and_run_parallel(arms, tasks, [0, 1], jobs=2, lrs=(0.001, 0.01, 0.1))
    for label in ("a", "b"):
        assert parallel[label]["lr"] == serial[label]["lr"] == 0.01
        assert parallel[label]["per_seed"] == serial[label]["per_seed"] == [0.5, 0.6]
    assert serial["a"]["prepared"] is False and parallel["a"]["prepared"] is True  # run in the arm's own process
    with pytest.raises(RuntimeError, match="arm broken: ValueError: no such layer"):
        fs.tune_and_run_parallel([*arms, {"label": "broken", "strategy": "full"}], tasks, [0], jobs=3)
