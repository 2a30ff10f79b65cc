"""The in-process client step's fast paths, each against the plain computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, Message, MessageType

from fedelastic.cost.costmodel import CostModel
from fedelastic.devices.profile import get_profile
from fedelastic.fl.arrays import config_record, from_numpy, to_numpy
from fedelastic.modelinfo import describe
from fedelastic.models.small import small_cnn
from fedelastic.selection.strategy import Selection
from fedelastic.sim.aggregate import ClientUpdate, aggregate_partial
from fedelastic.train.trainer import LocalResult, _add_to_union, _Applied, ordered_params


def _plain_union(selections, applied_list, info):
    """The plain per-tensor union: one pass over the tensors of each selection (the reference)."""
    union = np.zeros(info.num_tensors)
    channel_union: dict[int, tuple[int, np.ndarray]] = {}
    for selection, applied in zip(selections, applied_list):
        for k in np.flatnonzero(selection.ratios > 0):
            k = int(k)
            union[k] = max(union[k], applied.kept_share(k))
            if k in applied.masks:
                axis, mask = applied.masks[k]
                kept = np.flatnonzero(mask.numpy())
            else:
                axis, kept = 0, np.arange(int(info.tensor_channels[k]), dtype=np.int64)
            if k not in channel_union:
                channel_union[k] = (axis, kept if kept.dtype == np.int64 else kept.astype(np.int64))
                continue
            old_axis, old = channel_union[k]
            if old_axis != axis:
                axis, kept, old = 0, np.arange(info.tensor_channels[k]), np.zeros(0, np.int64)
            channel_union[k] = (axis, np.union1d(old, kept).astype(np.int64))
    return union, channel_union


def _selections(info, rng):
    """Random selections: whole tensors, output channels, input channels (Sparse Update), a channel list
    on a tensor whose ratio is 0, and nothing at all."""
    n = info.num_tensors
    out = []
    for _ in range(4):
        kind = rng.integers(4)
        if kind == 0:  # whole tensors
            out.append(Selection.from_mask(rng.random(n) < 0.5))
        elif kind == 1:  # output channels of some tensors, others whole
            channels = {
                int(k): rng.choice(int(info.tensor_channels[k]), size=rng.integers(1, info.tensor_channels[k] + 1))
                for k in rng.choice(n, size=2, replace=False)
            }
            out.append(Selection.from_channels(info, channels, whole=(rng.random(n) < 0.3).astype(float)))
        elif kind == 2:  # a share of the input channels of the weights
            ratios = np.where(rng.random(n) < 0.6, rng.choice([0.25, 0.5, 1.0], size=n), 0.0)
            out.append(Selection(ratios, input_sparse=rng.random(n) < 0.7))
        else:  # channels listed for a tensor that does not train: ignored
            k = int(rng.integers(n))
            ratios = np.zeros(n)
            ratios[(k + 1) % n] = 1.0
            out.append(Selection(ratios, {k: np.array([0])}))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_union_of_selections_is_the_per_tensor_union(seed):
    torch.manual_seed(seed)
    model = small_cnn(width=8)
    info = describe(model, torch.zeros(1, 1, 8, 8), "small_cnn")
    params = ordered_params(model, info)
    rng = np.random.default_rng(seed)
    selections = _selections(info, rng)
    applied = [_Applied(model, info, params, s, "frozen") for s in selections]
    union, whole = np.zeros(info.num_tensors), np.zeros(info.num_tensors, dtype=bool)
    channel_union: dict[int, tuple[int, np.ndarray]] = {}
    for s, a in zip(selections, applied):
        _add_to_union(s, a, union, whole, channel_union)
    plain_union, plain_channels = _plain_union(selections, applied, info)
    np.testing.assert_array_equal(union, plain_union)
    assert set(np.flatnonzero(union > 0)) == set(plain_channels)  # every trained tensor has channels
    for k, (old_axis, old_kept) in plain_channels.items():
        axis, kept = (0, np.arange(info.tensor_channels[k])) if whole[k] else channel_union[k]
        assert axis == old_axis and np.array_equal(kept, old_kept), k


def test_a_whole_tensor_absorbs_channels_before_and_after_it():
    torch.manual_seed(0)
    model = small_cnn(width=8)
    info = describe(model, torch.zeros(1, 1, 8, 8), "small_cnn")
    params = ordered_params(model, info)
    k = 3  # "3.weight": a conv weight with 16 output and 8 input channels at width 8
    some = Selection.from_channels(info, {k: np.array([1, 3])})  # output channels (axis 0)
    every = Selection.from_mask(np.arange(info.num_tensors) == k)
    inputs = Selection(
        np.where(np.arange(info.num_tensors) == k, 0.5, 0.0), input_sparse=np.ones(info.num_tensors, bool)
    )
    for order in ([some, every, some], [every, some], [some, inputs], [inputs, some, inputs]):  # axes 0 and 1: whole
        applied = [_Applied(model, info, params, s, "frozen") for s in order]
        union, whole, channels = np.zeros(info.num_tensors), np.zeros(info.num_tensors, dtype=bool), {}
        for s, a in zip(order, applied):
            _add_to_union(s, a, union, whole, channels)
        plain_union, plain_channels = _plain_union(order, applied, info)
        assert whole[k] and union[k] == plain_union[k]  # whole: any channels listed for it are ignored
        assert (
            plain_channels[k][0] == 0 and plain_channels[k][1].size == info.tensor_channels[k]
        )  # the plain loop: every channel


@pytest.mark.parametrize(
    "x",
    [
        np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")]),
        np.zeros(3, dtype=[("c", "<i4"), ("d", "<f4")]),  # same size and .str ('|V8'), other fields
        np.arange(4, dtype=np.float32),
        np.arange(4, dtype=">f4"),
        np.array(["ab", "c"]),
    ],
    ids=lambda x: str(x.dtype),
)
def test_array_names_and_headers_are_flowers_own(x):
    for _ in range(2):  # cold and cached
        ours, ref = from_numpy(x), Array(x)
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (ref.dtype, ref.shape, ref.stype, ref.data)
        np.testing.assert_array_equal(to_numpy(ours), x)


@pytest.mark.parametrize(
    "values",
    [
        {"fits-reason": ""},
        {"fits-reason": "the selection needs 12 bytes"},
        {"s": "x", "b": b"\x00", "t": True, "i": -3, "f": float("nan")},
        {"l": ["a", "b"]},  # a list: Flower's constructor
        {},
    ],
)
def test_fast_config_records_are_flowers_own(values):
    ours, theirs = config_record(dict(values)), ConfigRecord(dict(values))
    assert type(ours) is type(theirs) and ours.object_id == theirs.object_id
    assert list(ours.items()) == list(theirs.items()) or values.get("f") != values.get("f")
    assert [type(v) for v in ours.values()] == [type(v) for v in theirs.values()]


@pytest.mark.parametrize("bad", [np.float32(1.0), np.int64(3), None, {"a": 1}])
def test_fast_config_records_refuse_what_flower_refuses(bad):
    with pytest.raises(TypeError) as theirs:
        ConfigRecord({"a": "x", "b": bad})
    with pytest.raises(TypeError) as ours:
        config_record({"a": "x", "b": bad})
    assert str(ours.value) == str(theirs.value)


def _brute_force_mean(global_state, updates):
    """Per element, in Python floats: sum of weight x mask x value over the clients, in order, / sum of weight x mask."""
    out = {}
    for name, current in global_state.items():
        flat = np.asarray(current, np.float64).ravel()
        merged = []
        for i in range(flat.size):
            num = den = 0.0
            for upd in updates:
                if name not in upd.arrays:
                    continue
                value = float(np.asarray(upd.arrays[name], np.float64).ravel()[i])
                w = float(upd.weight)
                if name in upd.channel_masks:
                    mask = np.asarray(upd.channel_masks[name], np.float64)
                    mask = mask.reshape((-1,) + (1,) * (current.ndim - 1)) if mask.ndim == 1 else mask
                    w *= float(np.broadcast_to(mask, current.shape).ravel()[i])
                num += w * value
                den += w
            merged.append(num / den if den > 0 else float(flat[i]))
        out[name] = np.array(merged).reshape(current.shape).astype(current.dtype)
    return out


def test_weight_sums_kept_as_one_float_give_the_per_element_means():
    rng = np.random.default_rng(5)
    global_state = {
        "conv": rng.standard_normal((4, 2, 3)).astype(np.float32),
        "bias": rng.standard_normal(4).astype(np.float32),
        "steps": np.array(7, np.int64),  # a buffer nobody sends keeps its value and dtype
        "head": rng.standard_normal((3, 4)).astype(np.float32),
    }
    updates = [
        ClientUpdate(3, {k: rng.standard_normal(v.shape) for k, v in global_state.items() if k != "steps"}),
        ClientUpdate(7, {"conv": rng.standard_normal((4, 2, 3)), "bias": rng.standard_normal(4)}),
        # a mask after two unmasked clients of the same tensor; an all-zero mask on another
        ClientUpdate(
            5,
            {"conv": rng.standard_normal((4, 2, 3)), "head": rng.standard_normal((3, 4))},
            {"conv": np.array([1.0, 0.0, 1.0, 0.0]), "head": np.zeros(3)},
        ),  # fmt: skip
        ClientUpdate(2, {"bias": rng.standard_normal(4)}),
    ]
    new = aggregate_partial(global_state, updates)
    expected = _brute_force_mean(global_state, updates)
    for k in global_state:
        assert new[k].dtype == global_state[k].dtype
        np.testing.assert_array_equal(new[k], expected[k])
    only_head = aggregate_partial(global_state, [updates[2]])  # weight sum 0 everywhere: the global values
    np.testing.assert_array_equal(only_head["head"], global_state["head"])
    assert only_head["bias"] is not global_state["bias"]  # a new array, as np.where made


@pytest.mark.parametrize("stack_max", [1 << 20, 0])  # the stacked sums, and the per-update loop they replace
def test_stacked_sums_add_in_the_loops_order(monkeypatch, stack_max):
    """Sums that depend on the order of the additions (1e16 then many small values, which a
    sequential sum rounds away one by one and a pairwise sum adds up first), -0.0 in every update
    of one element, float32/float64/int64 updates, a 0-d tensor and 40 clients: bit for bit the
    per-element sums in Python floats, in client order."""
    import fedelastic.sim.aggregate as aggregate

    monkeypatch.setattr(aggregate, "_STACKED_MAX", stack_max)
    rng = np.random.default_rng(11)
    global_state = {"w": np.zeros((3, 5), np.float64), "b": np.zeros(5, np.float32), "t": np.array(0.5, np.float64)}
    updates = []
    for i in range(40):
        w = rng.standard_normal((3, 5)) * 10.0 ** rng.integers(-8, 17, size=(3, 5))
        w[0, 0] = -0.0  # every client: from 0.0 the sum is +0.0; from the first client's value it would be -0.0
        w[1, 1] = 1e16 if i == 0 else 1.0
        arrays = {"w": w.astype(np.float32) if i % 2 else w, "t": np.array(1e16 if i == 0 else 1.0)}
        if i % 5 == 0:
            arrays["b"] = rng.integers(-(2**60), 2**60, size=5)  # int64: rounded to float64 on the way
        updates.append(ClientUpdate(float(rng.integers(1, 50)), arrays))
    new = aggregate.aggregate_partial(global_state, updates)
    expected = _brute_force_mean(global_state, updates)
    for k in global_state:
        assert new[k].dtype == global_state[k].dtype and new[k].shape == global_state[k].shape
        assert new[k].tobytes() == expected[k].tobytes(), k
    assert not np.signbit(new["w"][0, 0])


def test_stacked_sums_refuse_a_shape_as_the_loop_does():
    from fedelastic.sim.aggregate import aggregate_partial

    with pytest.raises(ValueError, match="tensor 'w': update shape"):
        aggregate_partial({"w": np.zeros(3)}, [ClientUpdate(1, {"w": np.zeros(3)}), ClientUpdate(1, {"w": np.zeros(4)})])


def test_reply_figures_are_the_cost_models_own(make_scenario):
    from fedelastic.environment import environment
    from fedelastic.fl.client import round_figures

    env = environment(make_scenario())
    info = env.info
    for device in ("raspberry_pi_4", "jetson_nano"):
        cost = CostModel(info, get_profile(device), 16)
        for ratios in (np.ones(info.num_tensors), np.linspace(0, 1, info.num_tensors), np.zeros(info.num_tensors)):
            for time_s, macs, peak in ((0.25, 1e6, 3e5), (0.5, 2e6, 3e5), (0.25, 1e6, 3e5)):  # the last repeats
                result = LocalResult(fits=True, num_examples=5, train_time_s=time_s, macs=macs, peak_memory_bytes=peak)
                bytes_up, band, share = round_figures(env, cost, result, ratios)
                assert bytes_up == float((ratios * info.tensor_numel).sum() * cost.device.bytes_per_element)
                assert band == cost.time_band_s(time_s)
                assert share == float((ratios * info.tensor_numel).sum() / info.num_params)


def test_a_0d_tensor_averaged_stays_a_0d_array():
    """A scalar parameter (e.g. a learned temperature) that clients send comes back as an array, as np.where gave."""
    new = aggregate_partial(
        {"t": np.array(3.0, np.float32)}, [ClientUpdate(2.0, {"t": np.array(5.0)}), ClientUpdate(6.0, {"t": np.array(1.0)})]
    )
    assert isinstance(new["t"], np.ndarray) and new["t"].shape == () and new["t"].dtype == np.float32
    assert float(new["t"]) == (2 * 5.0 + 6 * 1.0) / 8
    torch.from_numpy(new["t"])  # the server loads it into the model


@pytest.mark.parametrize("checked_max", [1 << 22, 7])  # whole stacks, and chunks of one or two replies
def test_grouped_finiteness_check_is_the_per_tensor_check(monkeypatch, checked_max):
    import fedelastic.sim.engine as engine

    monkeypatch.setattr(engine, "_CHECKED_MAX", checked_max)
    rng = np.random.default_rng(4)
    replies = []
    for i in range(30):
        arrays = {
            "conv": rng.standard_normal((2, 3, 3)).astype(np.float32 if i % 4 else np.float64),  # two dtypes
            "bias": rng.standard_normal(2 + (i % 3 == 0)).astype(np.float32),  # two shapes
            "steps": np.array(i, np.int64),  # not floating: never checked
            "scale": np.array(rng.standard_normal(), np.float32),  # 0-d
            "empty": np.zeros((0, 4), np.float32),
        }
        if i % 5 == 1:
            arrays["conv"].flat[rng.integers(18)] = (np.nan, np.inf, -np.inf)[i % 3]
        if i % 7 == 3:
            arrays["scale"] = np.array(np.nan, np.float32)
        if i == 9:
            arrays = dict(reversed(list(arrays.items())))  # another order of the same tensors
        replies.append(arrays)
    expected = [{k for k, v in a.items() if v.dtype.kind == "f" and not np.isfinite(v).all()} for a in replies]
    assert engine.nonfinite_tensors(replies) == expected
    assert any(expected) and not all(expected)
    assert engine.nonfinite_tensors([]) == []


def test_a_rejected_update_names_its_first_nonfinite_tensor(monkeypatch):
    from flwr.app import MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedelastic.fl.arrays import record_from_numpy
    from fedelastic.fl.server import nonfinite_update

    for key, value in (("_run_id", 0), ("_node_id", 1), ("_task_id", 0)):  # what a ServerApp process has
        monkeypatch.setattr(TaskIdentity, key, value, raising=False)
    arrays = {"a": np.zeros(2, np.float32), "b": np.array([np.inf], np.float32), "c": np.array([np.nan], np.float32)}
    reply = Message(
        content=RecordDict({"arrays": record_from_numpy(arrays), "metrics": MetricRecord({"train-loss": 0.5, "fits": 1, "steps": 1})}),
        message_type=MessageType.TRAIN,
        dst_node_id=1,
    )
    assert nonfinite_update(reply) == "non-finite update: tensor 'b' holds NaN/inf (train loss 0.5); update rejected"
    assert nonfinite_update(reply, arrays, {"c"}) == "non-finite update: tensor 'c' holds NaN/inf (train loss 0.5); update rejected"
    assert nonfinite_update(reply, {"a": arrays["a"]}, set()) == ""
