"""Vectorised cohort training (fedelastic/train/vectorized.py) against the per-client loop (train_local).

Both start from the same weights and the same seeds; the per-client loop is the reference. The
weights agree to float32 rounding (a batched convolution is a grouped convolution and sums in
another order; the padded loss sums the same terms in another order), so they are compared with
``atol=1e-6`` (measured: at most 3e-8, one or two float32 ulps, while training moves weights by
0.03-0.06); losses to 1e-6 relative (measured: 2e-7). Step
counts, example counts and the cost-model figures are host-side and must be equal exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.cost.costmodel import CostModel
from fedelastic.data import ArrayDataset, load_digits_dataset
from fedelastic.devices.profile import Quantity, get_profile
from fedelastic.modelinfo import describe
from fedelastic.models.small import mcu_net, small_cnn
from fedelastic.selection.strategy import Selection, SelectionStrategy, make_strategy
from fedelastic.train import vectorized
from fedelastic.train.quant import Numerics
from fedelastic.train.trainer import LocalTraining, train_local
from fedelastic.train.vectorized import CALL_SAMPLES, by_width, train_cohort_vmap

DEVICES = ("raspberry_pi_4", "jetson_nano", "stm32h743")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_cnn(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, num_classes),
    )  # fmt: skip


def clients(sizes):
    """Disjoint slices of the digits: one client per size (sizes chosen to leave short last batches)."""
    ds = load_digits_dataset()
    out, start = [], 0
    for n in sizes:
        out.append(ArrayDataset(ds.x[start : start + n], ds.y[start : start + n]))
        start += n
    return out


def setup(factory, batch_size, sizes, strategy="full", options=None):
    torch.manual_seed(0)
    model = factory()
    info = describe(model, torch.zeros(1, 1, 8, 8))
    costs = [CostModel(info, get_profile(DEVICES[i % 3]), batch_size, "momentum") for i in range(len(sizes))]
    strategies = [make_strategy(strategy, options or {}) for _ in sizes]
    return model, info, costs, strategies, clients(sizes)


def loop(model, info, strategies, costs, data, seeds, caps, numerics=None, **kw):
    out = []
    for s, c, d, seed, cap, nm in zip(strategies, costs, data, seeds, caps, numerics or [None] * len(data)):
        m = copy.deepcopy(model)
        out.append(train_local(m, info, s, c, d, LocalTraining(max_steps=cap, **kw), seed=seed, numerics=nm))
    return out


def assert_same(ref, got, atol=1e-6, loss_rtol=1e-6):
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert (a.fits, a.num_examples, a.steps, a.selections, a.reason) == (
            b.fits,
            b.num_examples,
            b.steps,
            b.selections,
            b.reason,
        )
        assert a.train_time_s == b.train_time_s and a.macs == b.macs and a.peak_memory_bytes == b.peak_memory_bytes
        assert a.overhead_time_s == b.overhead_time_s
        np.testing.assert_allclose(b.train_loss, a.train_loss, rtol=loss_rtol)
        assert sorted(a.trained) == sorted(b.trained)
        for name in a.trained:
            np.testing.assert_allclose(b.trained[name], a.trained[name], rtol=0, atol=atol, err_msg=name)
        if a.ratios is None:
            assert b.ratios is None
        else:
            np.testing.assert_array_equal(a.ratios, b.ratios)
        assert sorted(a.channel_masks) == sorted(b.channel_masks)  # the same channels trained
        for name in a.channel_masks:
            np.testing.assert_array_equal(b.channel_masks[name], a.channel_masks[name], err_msg=name)


SIZES = (37, 16, 5, 61, 23)  # 3, 1, 1, 4 and 2 batches of 16; short last batches of 5, 5, 13, 7


@pytest.mark.parametrize(
    "factory, kw",
    [
        (tiny_cnn, dict(momentum=0.0, weight_decay=0.0, optimizer="sgd", lr_schedule="constant")),
        (tiny_cnn, dict(momentum=0.9, weight_decay=5e-4, optimizer="sgd", lr_schedule="cosine")),
        (lambda: small_cnn(width=4), dict(momentum=0.9, weight_decay=1e-3, optimizer="sgdw", lr_schedule="constant")),
    ],
)
def test_full_strategy_matches_the_per_client_loop(factory, kw):
    model, info, costs, strategies, data = setup(factory, 16, SIZES)
    seeds = [[7, 2, pid] for pid in range(len(SIZES))]
    caps = [0, 0, 0, 3, 0]  # the fourth client stops after 3 of its 4 batches
    common = dict(epochs=2, batch_size=16, lr=0.05, bn_mode="frozen", **kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, **common)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # the model is left as it was
    ref = loop(model, info, strategies, costs, data, seeds, caps, **common)
    assert [r.steps for r in ref] == [6, 2, 2, 3, 4]  # by hand: ceil(n/16) per epoch, two epochs, the cap
    assert_same(ref, got)
    # the clients really trained apart: different data, different weights
    w = [r.trained["0.weight"] for r in got]
    assert not np.allclose(w[0], w[1], atol=1e-3)


@pytest.mark.parametrize("name", ["full", "elastic_tensor", "last_layer"])
def test_batchnorm_on_batch_statistics_matches_the_loop(name):
    # bn_mode "train": each client's norm layers run on its own batch statistics and move its own
    # running statistics (momentum 0.1), which are sent with its trained norm layers; a short last
    # batch is not padded into another client's statistics. elastic_tensor probes on batch
    # statistics and changes which norm layers train, and on the first two clients' devices its
    # probe only fits 7 samples at a time (each micro-batch its own statistics, as in the loop);
    # last_layer leaves every norm layer on its running statistics.
    # (A model with ReLU6 and narrow channels, mcu_net, can differ by more: a float32 rounding
    # difference that moves an activation across a ReLU's kink is amplified by a low-variance
    # BatchNorm's 1/sigma in the backward; measured 2% of the largest gradient on one batch.)
    options = {"rho": 0.5, "interval": 2, "interval_unit": "steps"} if name == "elastic_tensor" else {}
    model, info, costs, strategies, data = setup(lambda: small_cnn(width=4), 16, SIZES, name, options)
    costs = [CostModel(info, c.device, 16, "momentum", "train") for c in costs]
    if name == "elastic_tensor":
        small = dataclasses.replace(costs[0].device, memory_train_bytes=Quantity(costs[0].probe_memory("importance", 7).total_bytes, "test"))
        costs[:2] = [CostModel(info, small, 16, "momentum", "train")] * 2
        assert [m for _, m in costs[0].probe_segments("importance", small.memory_train_bytes.value)] == [7]  # the premise
    seeds = [[4, 1, pid] for pid in range(len(SIZES))]
    caps = [0, 0, 0, 3, 0]
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode="train")
    fresh = [make_strategy(name, options) for _ in SIZES]
    seen_vmap, seen_loop = (recording(strategies), recording(fresh)) if name == "elastic_tensor" else ([], [])
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, **common)
    ref = loop(model, info, fresh, costs, data, seeds, caps, **common)
    assert_same(ref, got)
    for mine, theirs in zip(seen_vmap, seen_loop):  # the importance each selection saw
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max())
    stats = {k for r in ref for k in r.trained if "running" in k}
    every = {f"{m}.running_{s}" for m in (1, 4, 8) for s in ("mean", "var")}
    assert stats == every if name == "full" else (stats == set() if name == "last_layer" else 0 < len(stats) < 6)
    if name == "full":  # the statistics moved: 6 steps of momentum 0.1 from (0, 1)
        assert np.abs(ref[0].trained["1.running_mean"]).max() > 1e-3
        assert not np.allclose(got[0].trained["1.running_var"], got[1].trained["1.running_var"], atol=1e-4)


@pytest.mark.parametrize(
    "name, bn_mode, factory",
    [("full", "frozen", tiny_cnn), ("elastic_tensor", "train", small_cnn), ("elastic_tensor", "frozen", small_cnn)],
)
def test_int8_clients_train_like_the_loop(name, bn_mode, factory):
    # a cohort of int8 (stm32h743) and fp32 clients: each int8 client calibrates its layers' input
    # ranges on the first batch it sees (the probe's first micro-batch for elastic_tensor, whose
    # probe fits 7 samples at a time on the first two devices), fake-quantises weights, biases and
    # activations, with QAS; its short last batch is padded, the padding kept out of its ranges
    # (tiny_cnn's biases make a zero padding sample's activations nonzero)
    options = {"rho": 0.5, "interval": 2, "interval_unit": "steps"} if name == "elastic_tensor" else {}
    model, info, costs, strategies, data = setup(lambda: factory(width=4) if factory is small_cnn else factory(), 16, SIZES, name, options)
    costs = [CostModel(info, c.device, 16, "momentum", bn_mode) for c in costs]
    if name == "elastic_tensor":
        small = dataclasses.replace(costs[2].device, memory_train_bytes=Quantity(costs[2].probe_memory("importance", 7).total_bytes, "test"))
        costs[:2] = [CostModel(info, small, 16, "momentum", bn_mode)] * 2
    numerics = [Numerics("int8"), Numerics("int8"), Numerics("int8"), None, Numerics("fp32")]
    seeds = [[6, 1, pid] for pid in range(len(SIZES))]
    caps = [0, 0, 0, 3, 0]
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode=bn_mode)
    fresh = [make_strategy(name, options) for _ in SIZES]
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, numerics=numerics, **common)
    ref = loop(model, info, fresh, costs, data, seeds, caps, numerics=numerics, **common)
    assert_same(ref, got)
    fp32 = loop(model, info, [make_strategy(name, options) for _ in SIZES], costs, data, seeds, caps, **common)
    moved = [np.abs(a.trained[k] - b.trained[k]).max() for a, b in zip(ref[:3], fp32[:3]) for k in a.trained if k in b.trained]
    assert max(moved) > 1e-5  # int8 really changed the int8 clients' training: 10x the tolerance


def test_step_calls_split_by_batch_width_where_padding_costs_more_than_a_call():
    # by hand, CALL_SAMPLES = 80: 10 clients of width 16 and 40 of width 2 in one call pad to
    # 80 + 50 x 16 = 880 samples, in two calls 80 + 40 x 2 + 80 + 10 x 16 = 400; widths 3 and 4
    # alone: one call (80 + 2 x 4 = 88 against 167); on an accelerator always one call
    widths = np.array([16] * 10 + [2] * 40)
    cpu = torch.device("cpu")
    assert by_width(list(range(50)), widths, cpu) == [list(range(10, 50)), list(range(10))]
    assert by_width([0, 1], np.array([4, 3]), cpu) == [[0, 1]]
    assert by_width(list(range(50)), widths, torch.device("meta")) == [list(range(50))]
    # three widths: 16 (x8), 12 (x10), 2 (x30): {2},{12,16} = 80 + 60 + 80 + 18 x 16 = 508 against
    # {2},{12},{16} = 548, {2,12},{16} = 768 and one call 848
    widths = np.array([16] * 8 + [12] * 10 + [2] * 30)
    assert by_width(list(range(48)), widths, cpu) == [list(range(18, 48)), list(range(18))]
    # brute force: every split of the sorted widths into runs, against the calls it picks
    rng = np.random.default_rng(0)
    for _ in range(20):
        widths = rng.integers(1, 9, size=int(rng.integers(2, 60)))
        values = np.unique(widths)
        best = min(
            sum(CALL_SAMPLES + len(run) * run.max() for run in np.split(np.sort(widths), np.searchsorted(np.sort(widths), cut)))
            for k in range(len(values))
            for cut in itertools.combinations(values[1:], k)
        )
        calls = by_width(list(range(len(widths))), widths, cpu)
        assert sorted(i for c in calls for i in c) == list(range(len(widths)))
        assert sum(CALL_SAMPLES + len(c) * widths[c].max() for c in calls) == best


@pytest.mark.parametrize("bn_mode", ["frozen", "train"])
def test_a_cohort_split_into_calls_by_width_matches_the_loop(bn_mode, monkeypatch):
    # 3 clients of 16 samples and 20 of 2, one batch an epoch: each of the 2 steps runs as two calls
    # (80 + 20 x 2 + 80 + 3 x 16 = 248 padded samples against 80 + 23 x 16 = 448 in one)
    sizes = (16, 16, 16) + (2,) * 20
    model, info, costs, strategies, data = setup(lambda: small_cnn(width=4), 16, sizes)
    costs = [CostModel(info, c.device, 16, "momentum", bn_mode) for c in costs]
    seeds = [[3, 2, pid] for pid in range(len(sizes))]
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode=bn_mode)
    calls = []
    monkeypatch.setattr(vectorized, "by_width", lambda *a: calls.append(by_width(*a)) or calls[-1])
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, **common)
    assert [len(c) for c in calls] == [2, 2]  # the premise: each step in two calls
    ref = loop(model, info, [make_strategy("full") for _ in sizes], costs, data, seeds, [0] * len(sizes), **common)
    assert_same(ref, got)


def test_a_client_without_a_batch_keeps_its_weights_and_a_selection_masks_tensors():
    # last_layer trains the classifier only; a client with max_steps 1 stops while others go on
    model, info, costs, strategies, data = setup(tiny_cnn, 8, (30, 30, 9), strategy="last_layer")
    seeds = [[1, 1, pid] for pid in range(3)]
    caps = [0, 1, 0]
    common = dict(epochs=1, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, bn_mode="frozen")
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, **common)
    ref = loop(model, info, strategies, costs, data, seeds, caps, **common)
    assert_same(ref, got)
    assert sorted(got[0].trained) == ["6.bias", "6.weight"]
    # one step by hand for the client with one batch: plain SGD from the initial weights
    m = copy.deepcopy(model)
    order = np.random.default_rng([1, 1, 1])
    torch.manual_seed(int(order.integers(2**62)))
    idx = order.permutation(30)[:8]
    x, y = torch.from_numpy(data[1].x[idx]), torch.from_numpy(data[1].y[idx])
    loss = nn.functional.cross_entropy(m(x), y)
    g = torch.autograd.grad(loss, m[6].weight)[0]
    expected = m[6].weight.detach() - 0.1 * (g + 1e-3 * m[6].weight.detach())
    np.testing.assert_allclose(got[1].trained["6.weight"], expected.numpy(), atol=1e-6)


def test_a_selection_that_does_not_fit_fails_like_the_loop():
    model, info, costs, strategies, data = setup(tiny_cnn, 16, (20, 20))
    tiny = dataclasses.replace(costs[1].device, memory_train_bytes=Quantity(1.0, "test"))  # nothing fits
    costs = [costs[0], CostModel(info, tiny, 16, "momentum")]
    common = dict(epochs=1, batch_size=16, lr=0.05, bn_mode="frozen")
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=[0, 1], max_steps=0, **common)
    ref = loop(model, info, strategies, costs, data, [0, 1], [0, 0], **common)
    assert ref[0].fits and not ref[1].fits and "bytes" in ref[1].reason
    assert_same(ref, got)


def test_frozen_weights_beyond_flash_fail_like_the_loop():
    # tiny_cnn: 40 + 1040 + 170 parameters; last_layer trains the 170 of the head, so on an MCU the
    # other 1080 (int8: 1080 bytes) stay in flash; one byte less of flash and the client does not fit
    model, info, costs, strategies, data = setup(tiny_cnn, 16, (20, 20, 20), strategy="last_layer")
    mcu = costs[2].device
    assert mcu.name == "stm32h743" and info.num_params == 1250
    costs = [costs[0]] + [
        CostModel(info, dataclasses.replace(mcu, memory_flash_bytes=Quantity(f, "test")), 16, "momentum")
        for f in (1080.0, 1079.0)
    ]
    common = dict(epochs=1, batch_size=16, lr=0.05, bn_mode="frozen")
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=[0, 1, 2], max_steps=0, **common)
    ref = loop(model, info, strategies, costs, data, [0, 1, 2], [0, 0, 0], **common)
    assert ref[0].fits and ref[1].fits and not ref[2].fits
    assert ref[2].reason == "the frozen weights need 1080 bytes of flash; the device has 1079"
    assert_same(ref, got)


class FirstChannel(SelectionStrategy):
    """Trains output channel 0 of the first tensor only."""

    name = "first_channel_test"

    def select(self, ctx):
        return Selection.from_channels(ctx.info, {0: np.array([0])})


@pytest.mark.parametrize(
    "case, key",
    [
        (dict(numerics=[Numerics("fp16")] * 2), "train.numerics"),
        (dict(numerics=[Numerics("int8", qas=False)] * 2), "train.qas"),
        (dict(numerics=[Numerics("int8", master_weights="device")] * 2), "train.master_weights"),
        (dict(dropout=True), "model.name"),
    ],
)
def test_what_it_cannot_vectorise_is_refused_naming_the_key(case, key):
    factory = (
        (lambda: nn.Sequential(small_cnn(width=4), nn.Dropout(0.5)))
        if case.get("dropout")
        else (lambda: small_cnn(width=4))
    )
    model, info, costs, strategies, data = setup(factory, 16, (20, 20), strategy=case.get("strategy", "full"))
    bn_mode = case.get("bn_mode", "frozen")
    costs = [CostModel(info, c.device, 16, "momentum", bn_mode) for c in costs]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        train_cohort_vmap(
            model, info, strategies, costs, data, epochs=1, batch_size=16, lr=0.05, seeds=[0, 1],
            bn_mode=bn_mode, numerics=case.get("numerics"),
        )  # fmt: skip


def test_a_scenario_cohort_matches_train_partition(make_scenario):
    # the Flower client's own entry point, client by client, against one vectorised call
    from fedelastic.environment import RunEnvironment
    from fedelastic.fl.client import train_partition
    from fedelastic.train.trainer import CohortJob
    from fedelastic.train.vectorized import train_partitions_vmap

    scenario = make_scenario(
        train={
            "strategy": "full",
            "batch_size": 8,
            "max_steps": 0,
            "momentum": 0.9,
            "weight_decay": 5e-4,
            "bn_mode": "frozen",
            "numerics": "fp32",
        }
    )
    env = RunEnvironment(scenario)
    jobs = [CohortJob(pid, 2, env.strategy(), cap) for pid, cap in ((0, None), (1, 2), (3, None), (2, None))]
    got = train_partitions_vmap(env, env.new_model(), jobs)
    ref = [train_partition(env, env.new_model(), j.strategy, j.pid, j.server_round, j.max_steps) for j in jobs]
    sizes = [len(env.data.client(j.pid)) for j in jobs]
    assert [r.steps for r in ref] == [-(-n // 8) if j.max_steps is None else 2 for n, j in zip(sizes, jobs)]
    assert_same(ref, got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU path is optional)")
def test_on_a_gpu_the_cohort_matches_the_cpu_loop(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 convolutions, as on the CPU
    model, info, costs, strategies, data = setup(lambda: small_cnn(width=4), 16, SIZES)
    seeds = [[7, 2, pid] for pid in range(len(SIZES))]
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3, bn_mode="frozen")
    ref = loop(model, info, strategies, costs, data, seeds, [0] * len(SIZES), **common)
    gpu = copy.deepcopy(model).cuda()
    got = train_cohort_vmap(gpu, info, strategies, costs, data, seeds=seeds, **common)
    on_gpu = loop(gpu, info, strategies, costs, data, seeds, [0] * len(SIZES), **common)  # train_local on the GPU
    assert_same(ref, got, atol=1e-5, loss_rtol=1e-5)  # cuDNN's kernels sum in another order than the CPU's
    assert_same(ref, on_gpu, atol=1e-5, loss_rtol=1e-5)


@pytest.mark.parametrize("name", ["elastic_tensor", "elastic_layer"])
def test_elastic_strategies_probe_and_select_like_the_loop(name):
    # the importance probe runs vectorised on each client's current weights; reselection every 2 steps
    options = {"rho": 0.5, "interval": 2, "interval_unit": "steps"}
    model, info, costs, strategies, data = setup(lambda: small_cnn(width=8), 16, SIZES, strategy=name, options=options)
    seeds = [[3, 1, pid] for pid in range(len(SIZES))]
    caps = [0, 0, 0, 3, 0]
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode="frozen")
    fresh = [make_strategy(name, options) for _ in SIZES]
    seen_vmap, seen_loop = recording(strategies), recording(fresh)
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, **common)
    ref = loop(model, info, fresh, costs, data, seeds, caps, **common)
    assert [r.selections for r in ref] == [3, 1, 1, 2, 2]  # one selection every 2 steps: ceil(steps / 2)
    assert all(0 < (r.ratios > 0).sum() < info.num_tensors for r in ref)  # real partial selections
    assert_same(ref, got)
    # the probe itself: the importance each selection saw (ElasticTrainer's -g * dw per tensor)
    assert [len(v) for v in seen_vmap] == [len(v) for v in seen_loop]
    for mine, theirs in zip(seen_vmap, seen_loop):
        for a, b in zip(mine, theirs):
            assert np.abs(b).max() > 0
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max())


def recording(strategies, probe="importance"):
    """Wrap each strategy's select() to keep what its probe gave it (``ctx.importance`` or ``ctx.fisher``)."""
    seen = []
    for s in strategies:
        log: list = []
        seen.append(log)

        def select(ctx, inner=s.select, log=log):
            log.append(copy.deepcopy(getattr(ctx, probe)))
            return inner(ctx)

        s.select = select
    return seen


@pytest.mark.parametrize(
    "train, key",
    [
        ({"strategy": "tinytrain", "numerics": "fp32", "bn_mode": "frozen"}, None),
        ({"strategy": "full", "bn_mode": "frozen", "quantized_gradients": True}, "train.quantized_gradients"),  # stm32h743: int8
        ({"strategy": "elastic_tensor", "numerics": "fp32", "bn_mode": "frozen"}, None),
        # Sparse Update trains a share of a tensor's input channels
        ({"strategy": "sparse_update", "numerics": "fp32", "bn_mode": "frozen", "options": {"channel_ratios": [0.25, 0.5]}}, None),
    ],
)
def test_a_scenario_is_checked_before_training(make_scenario, train, key):
    from fedelastic.environment import RunEnvironment
    from fedelastic.errors import ConfigError
    from fedelastic.train.vectorized import check_vectorizable

    env = RunEnvironment(make_scenario(train=train))
    if key is None:
        check_vectorizable(env)
        return
    with pytest.raises(ConfigError) as err:
        check_vectorizable(env)
    assert err.value.key == key and "tiny.toml" in str(err.value) and "\n" not in str(err.value)


def test_a_memory_split_probe_and_a_probe_that_cannot_fit_match_the_loop(bn_mode="frozen"):
    # mcu_net width 16 on stm32f746 (320 KiB): the importance probe only fits in pieces;
    # the third client's device has 1000 bytes: nothing fits, it fails as the loop's client does.
    # (Not on batch statistics: see test_batchnorm_on_batch_statistics_matches_the_loop)
    torch.manual_seed(0)
    model = mcu_net(width=16, num_classes=10)
    info = describe(model, torch.zeros(1, 1, 8, 8))
    mcu = get_profile("stm32f746")
    plan = CostModel(info, mcu, 16, "momentum", bn_mode).probe_plan("importance", mcu.memory_train_bytes.value)
    assert plan[0] == 0  # the premise
    tiny = dataclasses.replace(mcu, memory_train_bytes=Quantity(1000.0, "test"))
    costs = [CostModel(info, d, 16, "momentum", bn_mode) for d in (mcu, mcu, tiny)]
    options = {"rho": 0.4, "interval": 2, "interval_unit": "steps"}
    data = clients((40, 23, 20))
    seeds = [[5, 1, pid] for pid in range(3)]
    common = dict(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode=bn_mode)
    got = train_cohort_vmap(
        model, info, [make_strategy("elastic_tensor", options) for _ in range(3)], costs, data, seeds=seeds, **common
    )
    fresh = [make_strategy("elastic_tensor", options) for _ in range(3)]
    ref = loop(model, info, fresh, costs, data, seeds, [0, 0, 0], **common)
    assert ref[0].fits and ref[0].steps == 3 and ref[0].selections == 2
    assert not ref[2].fits and ref[2].reason  # nothing fits 1000 bytes (here: no selection fits)
    assert_same(ref, got)


def test_a_carried_reselection_interval_runs_like_the_loop():
    # interval 3 steps across two local trainings: each client's state from the first is handed to
    # the second, as its node keeps it; vectorised and looped training probe at the same steps
    options = {"rho": 0.5, "interval": 3, "interval_unit": "steps"}
    model, info, costs, strategies, data = setup(lambda: small_cnn(width=8), 16, SIZES, "elastic_tensor", options)
    fresh = [make_strategy("elastic_tensor", options) for _ in SIZES]
    common = dict(epochs=1, batch_size=16, lr=0.05, momentum=0.9, bn_mode="frozen")
    caps = [0] * len(SIZES)
    for r in range(2):
        seeds = [[r, pid] for pid in range(len(SIZES))]
        got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, **common)
        ref = loop(model, info, fresh, costs, data, seeds, caps, **common)
        assert_same(ref, got)
        assert [a.probes for a in ref] == [b.probes for b in got]
        assert [a.since for a in fresh] == [b.since for b in strategies]

        def renewed(kept):  # a new instance each round, as a client builds it, with the state it kept
            out = [make_strategy("elastic_tensor", options) for _ in kept]
            for new, old in zip(out, kept):
                new.load_state(old.state())
            return out

        fresh, strategies = renewed(fresh), renewed(strategies)
    # steps per client: 3, 1, 1, 4, 2 a round; with the state carried, round 2 probes only where 3 steps came due
    assert [a.probes for a in ref] == [1, 0, 0, 1, 1]


FP32_FROZEN = {"strategy": "full", "numerics": "fp32", "bn_mode": "frozen"}


@pytest.mark.parametrize(
    "overrides, vectorised, says",
    [
        # small_cnn width 8 at 8x8: convolutions 8*9*64 + 16*8*9*64 + 32*16*9*16 = 152,384 MACs a sample (< 800k)
        ({"train": FP32_FROZEN}, True, '"auto", eligible'),
        # width 32: 32*9*64 + 64*32*9*64 + 128*64*9*16 = 2,377,728 MACs in the convolutions alone (> 800k)
        ({"train": FP32_FROZEN, "model": {"name": "small_cnn", "options": {"width": 32}}}, False, "MACs a sample exceed"),
        ({"train": {**FP32_FROZEN, "bn_mode": "train"}}, True, '"auto", eligible'),  # small_cnn's BatchNorm
        ({"train": {**FP32_FROZEN, "numerics": "device"}}, True, '"auto", eligible'),  # stm32h743: int8
        ({"train": {**FP32_FROZEN, "strategy": "tinytrain"}}, True, '"auto", eligible'),  # Fisher probe, channels
        ({"train": {**FP32_FROZEN, "numerics": "device", "master_weights": "device"}}, False, "train.master_weights"),
        ({"train": FP32_FROZEN, "simulation": {"backend": "inprocess", "node_mode": "per_client"}}, False, "node_mode"),
        ({"train": FP32_FROZEN, "server": {"rounds": 2, "aggregator": "fedprox"}}, False, "server.aggregator"),
        ({"train": FP32_FROZEN, "simulation": {"backend": "inprocess", "vectorize": False}}, False, "vectorize = false"),
        ({"train": {**FP32_FROZEN, "bn_mode": "train"}, "simulation": {"backend": "inprocess", "vectorize": False}}, False, "= false"),
    ],
)
def test_auto_takes_the_vectorised_path_where_eligible_and_small_and_says_why(make_scenario, overrides, vectorised, says):
    from fedelastic.environment import RunEnvironment
    from fedelastic.train.vectorized import choose_path

    env = RunEnvironment(make_scenario(**overrides))
    assert env.scenario.simulation.vectorize == overrides.get("simulation", {}).get("vectorize", "auto")
    got, why = choose_path(env)
    assert got is vectorised and says in why and why.startswith("vectorised" if vectorised else "per-client"), why


def test_vectorize_true_on_what_it_cannot_vectorise_is_refused(make_scenario):
    from fedelastic.environment import RunEnvironment
    from fedelastic.errors import ConfigError
    from fedelastic.train.vectorized import choose_path

    train = {**FP32_FROZEN, "numerics": "device", "qas": False}  # stm32h743 trains in int8, without QAS
    env = RunEnvironment(make_scenario(train=train, simulation={"backend": "inprocess", "vectorize": True}))
    with pytest.raises(ConfigError, match=r"train\.qas"):
        choose_path(env)


def test_an_output_channel_selection_trains_only_those_channels_like_the_loop():
    # FirstChannel trains output channel 0 of the first conv's weight: each step's update is masked
    # per element, momentum and weight decay included, and the other 3 channels keep their values
    model, info, costs, _, data = setup(tiny_cnn, 16, SIZES)
    seeds = [[2, 1, pid] for pid in range(len(SIZES))]
    caps = [0] * len(SIZES)
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode="frozen")
    got = train_cohort_vmap(model, info, [FirstChannel() for _ in SIZES], costs, data, seeds=seeds, **common)
    ref = loop(model, info, [FirstChannel() for _ in SIZES], costs, data, seeds, caps, **common)
    assert_same(ref, got)
    start = model[0].weight.detach().numpy()
    for r in got:
        assert sorted(r.trained) == ["0.weight"] and r.ratios[0] == 0.25  # 1 of 4 channels
        np.testing.assert_array_equal(r.channel_masks["0.weight"], [1, 0, 0, 0])
        np.testing.assert_array_equal(r.trained["0.weight"][1:], start[1:])  # exactly unchanged
        assert np.abs(r.trained["0.weight"][0] - start[0]).max() > 1e-4  # channel 0 trained: 100x the tolerance


@pytest.mark.parametrize(
    "bn_mode, int8, options",
    [
        ("frozen", False, {}),
        ("train", True, {}),  # the int8 clients calibrate on the probe's first micro-batch
        ("frozen", False, {"interval": 2}),  # re-probed every 2 steps on the current weights
    ],
)
def test_tinytrain_probes_fisher_and_trains_its_channels_like_the_loop(bn_mode, int8, options):
    # the Fisher probe runs vectorised (per-sample channel sums of a * dL/da through taps on each
    # conv/linear output); its scores select the same top channels per client, which then train
    # channel-sparse. On the first two clients' devices the probe fits 7 samples at a time.
    model, info, costs, strategies, data = setup(lambda: small_cnn(width=8), 16, SIZES, "tinytrain", options)
    costs = [CostModel(info, c.device, 16, "momentum", bn_mode) for c in costs]
    small = dataclasses.replace(costs[0].device, memory_train_bytes=Quantity(costs[0].probe_memory("fisher", 7).total_bytes, "test"))
    costs[:2] = [CostModel(info, small, 16, "momentum", bn_mode)] * 2
    assert [m for _, m in costs[0].probe_segments("fisher", small.memory_train_bytes.value)] == [7]  # the premise
    numerics = [Numerics("int8") if int8 and i % 2 else None for i in range(len(SIZES))]
    seeds = [[8, 1, pid] for pid in range(len(SIZES))]
    caps = [0, 0, 0, 3, 0]
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode=bn_mode)
    fresh = [make_strategy("tinytrain", options) for _ in SIZES]
    seen_vmap, seen_loop = recording(strategies, "fisher"), recording(fresh, "fisher")
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, numerics=numerics, **common)
    ref = loop(model, info, fresh, costs, data, seeds, caps, numerics=numerics, **common)
    assert_same(ref, got)
    assert sum(bool(r.channel_masks) for r in ref) >= 3  # real channel-sparse selections (the small devices: the head)
    assert [len(v) for v in seen_vmap] == [len(v) for v in seen_loop] == [r.selections for r in ref]
    for mine, theirs in zip(seen_vmap, seen_loop):  # the Fisher potential each selection saw, per layer
        for a, b in zip(mine, theirs):
            assert sorted(a) == sorted(b) == [0, 2, 4, 6]  # small_cnn's 3 convs and its linear head (layers 1, 3, 5: norms)
            for li in b:
                np.testing.assert_allclose(a[li], b[li], rtol=1e-4, atol=1e-6 * np.abs(b[li]).max())


@pytest.mark.parametrize("bn_mode", ["frozen", "train"])
def test_sparse_update_trains_input_channels_by_norm_like_the_loop(bn_mode):
    # Sparse Update: the last biases whole, some weights on a share of their input channels, kept
    # by their weight norm on each client's weights when the selection is applied
    options = {"channel_ratios": [0.25, 0.5]}
    model, info, costs, strategies, data = setup(lambda: small_cnn(width=8), 16, SIZES, "sparse_update", options)
    costs = [CostModel(info, c.device, 16, "momentum", bn_mode) for c in costs]
    seeds = [[9, 1, pid] for pid in range(len(SIZES))]
    caps = [0, 0, 0, 3, 0]
    common = dict(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode=bn_mode, optimizer="sgdw")
    got = train_cohort_vmap(model, info, strategies, costs, data, seeds=seeds, max_steps=caps, **common)
    ref = loop(model, info, [make_strategy("sparse_update", options) for _ in SIZES], costs, data, seeds, caps, **common)
    assert_same(ref, got)
    masks = [m for r in ref for m in r.channel_masks.values()]
    assert masks and all(m.ndim > 1 and 0 < m.mean() < 1 for m in masks)  # input channels (dim 1), in part


def test_step_calls_without_vmap_cover_plain_sequential_models_and_match_each_clients_own_model():
    # a strided, grouped, bias-free convolution, average and adaptive pooling, Flatten, nested Sequential
    def plain():
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.ReLU6(), nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2, bias=False),
            nn.Sequential(nn.ReLU(), nn.AvgPool2d(2)), nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3, bias=False),
        )  # fmt: skip

    torch.manual_seed(0)
    model = plain()
    leaves = vectorized.grouped_plan(model, 3)
    assert leaves is not None and vectorized.grouped_plan(tiny_cnn(), 3) is not None  # the loop tests above take it
    clients = [plain() for _ in range(3)]  # each client's own weights
    params = {k: torch.stack([dict(c.named_parameters())[k].detach() for c in clients]) for k, _ in model.named_parameters()}
    x = torch.randn(3, 5, 1, 8, 8)
    got = vectorized.grouped_forward(leaves, params, x)
    for i, c in enumerate(clients):
        torch.testing.assert_close(got[i], c(x[i]), atol=1e-6, rtol=1e-5)
    # what it does not cover runs under vmap: norm layers, a custom forward, hooks, a conv on flat samples
    assert vectorized.grouped_plan(small_cnn(width=4), 3) is None
    assert vectorized.grouped_plan(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), 3) is None  # logits not flat
    hooked = tiny_cnn()
    hooked[0].register_forward_hook(lambda m, i, o: o)
    assert vectorized.grouped_plan(hooked, 3) is None
    assert vectorized.grouped_plan(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), 1) is not None
    assert vectorized.grouped_plan(nn.Sequential(nn.Linear(64, 3), nn.MaxPool2d(2)), 1) is None
