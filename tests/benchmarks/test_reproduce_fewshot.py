"""The few-shot reproductions' per-group learning rates, against torch's own two-group SGD."""

import importlib.util

import numpy as np
import pytest
import torch

from fedelastic.optim import SGD
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
