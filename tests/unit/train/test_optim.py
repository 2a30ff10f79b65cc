"""fedelastic's SGD/SGDW (fedelastic/train/optim.py) against torch.optim.SGD itself, bit for bit; the
FLOP cross-check of describe() against FlopCounterMode; and no torch._dynamo on the training path."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.cost.costmodel import CostModel
from fedelastic.data import load_digits_dataset
from fedelastic.devices.profile import get_profile
from fedelastic.modelinfo import MIN_MACS_COVERAGE, describe, flop_count_mode
from fedelastic.models.small import small_cnn
from fedelastic.selection.strategy import make_strategy
from fedelastic.train import trainer as training
from fedelastic.train.optim import SGD, SGDW, register_step_post_hook, register_step_pre_hook
from fedelastic.train.quant import Numerics
from fedelastic.train.trainer import LocalTraining, train_local
from tests.support import ROOT


class ReferenceSGDW(torch.optim.SGD):
    """SGDW as a torch.optim.SGD subclass: decoupled decay, then torch's own step (the reference formula)."""

    def __init__(self, params, lr, momentum, weight_decay):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=0.0, foreach=False)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = weight_decay

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.mul_(1 - group["lr"] * group["decoupled_weight_decay"])
        return super().step(closure)


def torch_optimizer(params, optimizer: str, lr: float, momentum: float, weight_decay: float):
    """The reference optimizers: torch's single-tensor SGD, or ReferenceSGDW."""
    if optimizer == "sgdw":
        return ReferenceSGDW(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=False)


def data(n: int = 64, seed: int = 0):
    ds = load_digits_dataset()
    idx = np.random.default_rng(seed).permutation(len(ds))[:n]
    return torch.from_numpy(ds.x[idx]), torch.from_numpy(ds.y[idx])


def assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("optimizer", ["sgd", "sgdw"])
@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.0, 5e-3), (0.9, 5e-3)])
def test_steps_equal_torch_bit_for_bit(optimizer, momentum, weight_decay):
    torch.manual_seed(0)
    ours_model = small_cnn(width=4)
    ref_model = copy.deepcopy(ours_model)
    ours = training.make_optimizer(list(ours_model.parameters()), optimizer, 0.1, momentum, weight_decay)
    ref = torch_optimizer(list(ref_model.parameters()), optimizer, 0.1, momentum, weight_decay)
    assert isinstance(ours, SGDW if optimizer == "sgdw" else SGD) and not isinstance(ours, torch.optim.Optimizer)
    x, y = data()
    steps = 40
    for step in range(steps):
        lr = 0.1 * 0.5 * (1 + np.cos(np.pi * step / steps))  # the trainer's cosine schedule (a numpy float)
        for opt in (ours, ref):
            opt.param_groups[0]["lr"] = lr
        part = slice(16 * (step % 4), 16 * (step % 4) + 16)
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[part]), y[part]).backward()
            opt.step()
        assert_same(ours_model, ref_model)
    moved = [not torch.equal(p, q) for p, q in zip(ours_model.parameters(), small_cnn_init())]
    assert all(moved)  # every tensor trained (the equality above is not of untouched weights)
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
        if momentum:
            assert torch.equal(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
        else:
            assert p not in ours.state
    ours.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in ours_model.parameters())


def small_cnn_init():
    torch.manual_seed(0)
    return list(small_cnn(width=4).parameters())


def test_first_momentum_step_and_decoupled_decay_by_hand():
    w = nn.Parameter(torch.tensor([2.0, -1.0]))
    opt = SGD([w], lr=0.5, momentum=0.9, weight_decay=0.1)
    w.grad = torch.tensor([1.0, 3.0])
    opt.step()
    # g = grad + wd * w = [1.2, 2.9]; the buffer starts as g (not 0.9 * 0 + g: the same here), w -= lr * g
    torch.testing.assert_close(w.detach(), torch.tensor([2.0 - 0.6, -1.0 - 1.45]))
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], torch.tensor([1.2, 2.9]))
    assert opt.state[w]["momentum_buffer"].data_ptr() != w.grad.data_ptr()  # a copy, not the gradient
    w.grad = torch.tensor([1.0, 1.0])
    before = w.detach().clone()
    opt.step()  # b = 0.9 b + (g + wd w)
    buf = 0.9 * torch.tensor([1.2, 2.9]) + torch.tensor([1.0, 1.0]) + 0.1 * before
    torch.testing.assert_close(w.detach(), before - 0.5 * buf)
    v = nn.Parameter(torch.tensor([4.0]))
    sgdw = SGDW([v], lr=0.5, momentum=0.0, weight_decay=0.2)
    v.grad = torch.tensor([1.0])
    sgdw.step()
    torch.testing.assert_close(v.detach(), torch.tensor([4.0 * (1 - 0.5 * 0.2) - 0.5]))  # decay kept out of g


def test_bad_hyperparameters_and_empty_params():
    w = nn.Parameter(torch.zeros(2))
    for kwargs in ({"lr": -1.0}, {"lr": 0.1, "momentum": -0.5}, {"lr": 0.1, "weight_decay": -1.0}):
        with pytest.raises(ValueError, match="Invalid"):
            SGD([w], **kwargs)
    with pytest.raises(ValueError, match="empty parameter list"):
        SGD([], lr=0.1)


def test_state_dict_round_trip_restores_momentum():
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.tensor([1.0, -1.0])
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert list(saved["state"]) == [0] and torch.equal(saved["state"][0]["momentum_buffer"], torch.tensor([1.0, -1.0]))
    ref = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    assert set(saved["param_groups"][0]) <= set(ref.state_dict()["param_groups"][0]) | {"decoupled_weight_decay"}
    opt.step()
    opt.param_groups[0]["lr"] = 0.5
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[w]["momentum_buffer"], torch.tensor([1.0, -1.0]))
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["params"] == [w]
    with pytest.raises(ValueError, match="different number"):
        SGD([w, nn.Parameter(torch.zeros(1))], lr=0.1).load_state_dict(saved)


def test_step_hooks_fire_once_around_the_step_and_can_be_removed():
    w = nn.Parameter(torch.tensor([1.0]))
    opt = SGDW([w], lr=0.1, momentum=0.0, weight_decay=0.0)
    seen = []
    pre = register_step_pre_hook(lambda o: seen.append(("pre", o is opt, w.item())))
    post = register_step_post_hook(lambda o: seen.append(("post", o is opt, w.item())))
    w.grad = torch.tensor([1.0])
    try:
        opt.step()
    finally:
        pre.remove()
        post.remove()
    opt.step()
    assert seen == [("pre", True, 1.0), ("post", True, pytest.approx(0.9))]


# ---- the trainer: torch's optimizers swapped in give the same run, bit for bit -------------------


def run_local(strategy: str, optimizer: str, monkeypatch=None, numerics=None, momentum=0.9, weight_decay=1e-3):
    if monkeypatch is not None:
        monkeypatch.setattr(training, "make_optimizer", torch_optimizer)
    torch.manual_seed(0)
    model = small_cnn(width=8)
    info = describe(model, torch.zeros(1, 1, 8, 8), "small_cnn")
    cost = CostModel(info, get_profile("jetson_nano"), 16)
    ds = load_digits_dataset()
    sub = ds.subset(np.random.default_rng(1).permutation(len(ds))[:160])
    options = {"channel_ratios": [0.5]} if strategy == "sparse_update" else {}
    result = train_local(
        model,
        info,
        make_strategy(strategy, options),
        cost,
        sub,
        LocalTraining(
            epochs=2,
            batch_size=16,
            lr=0.1,
            momentum=momentum,
            weight_decay=weight_decay,
            optimizer=optimizer,
            lr_schedule="cosine",
        ),
        seed=7,
        numerics=numerics,
    )
    if monkeypatch is not None:
        monkeypatch.undo()
    return result, model


@pytest.mark.parametrize("optimizer", ["sgd", "sgdw"])
@pytest.mark.parametrize("strategy", ["full", "elastic_tensor", "tinytrain", "sparse_update"])
def test_train_local_equals_torch_optimizers(strategy, optimizer, monkeypatch):
    """Masked channels (_Applied.step), the importance probe's state_dict round trip, cosine rate."""
    ours, ours_model = run_local(strategy, optimizer)
    ref, ref_model = run_local(strategy, optimizer, monkeypatch)
    assert ours.steps == ref.steps > 10 and ours.train_loss == ref.train_loss
    assert_same(ours_model, ref_model)
    assert ours.trained.keys() == ref.trained.keys() and all(
        np.array_equal(ours.trained[k], ref.trained[k]) for k in ours.trained
    )
    if strategy in ("tinytrain", "sparse_update"):  # channels masked: some tensors train in part
        assert ours.channel_masks and all(m.min() == 0 for m in ours.channel_masks.values())


@pytest.mark.parametrize("numerics", [Numerics("int8", qas=False), Numerics("int8", master_weights="device"),
                                      Numerics("fp16", master_weights="device")])  # fmt: skip
def test_emulated_numerics_equal_with_torch_optimizers(numerics, monkeypatch):
    """The emulation's hooks fire for fedelastic's optimizers as they did for torch's: same numbers."""
    ours, ours_model = run_local("full", "sgdw", numerics=numerics)
    ref, ref_model = run_local("full", "sgdw", monkeypatch, numerics=numerics)
    plain, plain_model = run_local("full", "sgdw")
    assert ours.train_loss == ref.train_loss != plain.train_loss
    assert_same(ours_model, ref_model)


# ---- describe(): the FLOP cross-check counts what FlopCounterMode counts -----------------------------


class Attention(nn.Module):
    """Odd user model: functional matmuls (einsum, bmm, sdpa) on parameters, no attention module."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(1, 16, 2, stride=2)
        self.qkv = nn.Parameter(torch.randn(16, 48) * 0.1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)  # (N, 16 tokens, 16)
        q, k, v = torch.einsum("ntd,de->nte", t, self.qkv).chunk(3, dim=-1)
        a = torch.bmm(q.softmax(-1), k.transpose(1, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v) + torch.bmm(a, v)
        return self.head(y.mean(1))


class Recurrent(nn.Module):
    """Odd user model: an LSTM and a GRU over image rows, a grouped Conv1d, a transposed conv."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(1, 2, 2, stride=2)
        self.conv = nn.Conv1d(32, 8, 3, groups=4)
        self.lstm = nn.LSTM(14, 12, batch_first=True)
        self.gru = nn.GRU(12, 6, batch_first=True)
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        r = self.up(x).flatten(1, 2)  # (N, 32, 16)
        h, _ = self.lstm(self.conv(r))
        h, _ = self.gru(h)
        return self.head(h[:, -1])


def flop_counter_mode_flops(model: nn.Module, sample: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    model.eval()
    with torch.no_grad(), counter:
        model(sample)
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("name", "size"),
    [("small_cnn", 8), ("mcu_net", 8), ("resnet_small", 16), ("mobilenetv2", 32), ("vit_tiny", 32),
     ("Attention", 8), ("Recurrent", 8)],
)  # fmt: skip
def test_flop_count_equals_flop_counter_mode(name, size):
    from fedelastic.models import build_with_input

    torch.manual_seed(0)
    if name in ("Attention", "Recurrent"):
        model, shape = {"Attention": Attention, "Recurrent": Recurrent}[name](), (1, size, size)
    else:
        model, shape = build_with_input(name, num_classes=10, input_size=size)
    sample = torch.randn(2, *shape)
    expected = flop_counter_mode_flops(model, sample)
    counter = flop_count_mode()
    with torch.no_grad(), counter:
        model(sample)
    assert counter.flops == expected > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = describe(model, sample, name)
    assert info.flop_counter_macs == expected // 2 // 2  # per sample, MACs
    warned = any("FlopCounterMode" in str(w.message) for w in caught)
    assert warned == (info.macs_coverage < MIN_MACS_COVERAGE)
    assert warned == (name in ("Attention", "Recurrent"))  # what nothing prices: the LSTM/GRU's, sdpa's matmuls


def test_flop_count_mode_runs_higher_order_operators_uncounted():
    counter = flop_count_mode()
    lin = nn.Linear(4, 4)
    with torch.no_grad(), counter:
        out = torch.cond(torch.tensor(True), lambda x: lin(x), lambda x: lin(x) * 2, (torch.ones(2, 4),))
    assert torch.equal(out, lin(torch.ones(2, 4)).detach()) and counter.flops == 0


# ---- no torch._dynamo on the training path ---------------------------------------------------------

NO_DYNAMO = """
import sys, tempfile
from pathlib import Path
import fedelastic
from tests.support import small_scenario_dict
raw = small_scenario_dict(Path(tempfile.mkdtemp()), train={"strategy": "elastic_tensor", "batch_size": 16,
    "max_steps": 3, "momentum": 0.9, "weight_decay": 1e-3, "optimizer": "sgdw", "lr_schedule": "cosine"},
    model={"name": "small_cnn", "options": {"width": 8}, "pretrain": {"classes": [0, 1, 2], "epochs": 1}})
result = fedelastic.run(raw)
from fedelastic.models import describe_model
describe_model("small_cnn", num_classes=10, input_size=8)
assert (result.clients["steps"] > 0).any(), result.clients
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_in_process_run_never_imports_torch_dynamo(tmp_path):
    """A fresh process: an in-process run (pretrained, an int8 device emulated, the importance
    probe) and a model description leave torch._dynamo unimported (~0.9 s of CPU a process)."""
    env = {**os.environ, "FEDELASTIC_CACHE": str(tmp_path)}  # pretrains for real, not from a cache
    out = subprocess.run(
        [sys.executable, "-c", NO_DYNAMO], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pretraining small_cnn" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]
