"""The engine's faster Array codec and message dispatch loop must not change a single byte or message."""

import threading
from queue import Queue

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedelastic.fl.arrays import from_numpy, record_from_numpy, record_to_numpy, record_to_torch, to_numpy
from fedelastic.runtime.dispatch import _linear_dispatch, fast_dispatch

_RNG = np.random.default_rng(0)
ARRAYS = [
    _RNG.standard_normal((16, 1, 3, 3)).astype(np.float32),
    np.array(5, dtype=np.int64),  # a BatchNorm's num_batches_tracked
    np.zeros((0, 3)),
    _RNG.integers(0, 2, (4, 5)).astype(bool),
    np.asfortranarray(_RNG.standard_normal((3, 4))),
    _RNG.standard_normal((3, 4)).astype(">f8"),
    _RNG.standard_normal((2, 3, 4))[:, ::2],  # not contiguous
    _RNG.standard_normal(5).astype(np.float16),
    np.arange(600, dtype=np.int32).reshape(20, 30).T,
    np.ones(3, dtype=np.float32),
]


@pytest.mark.parametrize("x", ARRAYS, ids=lambda x: f"{x.dtype}{x.shape}")
def test_codec_matches_flower_exactly(x):
    for _ in range(2):  # cold and cached header
        ref, ours = Array(x), from_numpy(x)
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (ref.dtype, ref.shape, ref.stype, ref.data)
        expected, got = ref.numpy(), to_numpy(ours)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert np.array_equal(got, expected)
        assert got.flags.writeable and got.flags.c_contiguous == expected.flags.c_contiguous


def test_record_helpers_round_trip_a_state_dict():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    state = model.state_dict()
    record = record_from_numpy({k: v.numpy() for k, v in state.items()})
    flower = ArrayRecord(torch_state_dict=state)
    assert {k: v.data for k, v in record.items()} == {k: v.data for k, v in flower.items()}
    for k, v in record_to_torch(flower).items():
        assert torch.equal(v, state[k])
    assert set(record_to_numpy(record)) == set(state)


class _Meta:
    def __init__(self, dst):
        self.dst_node_id, self.delivered_at = dst, ""


class _Msg:
    def __init__(self, dst):
        self.metadata = _Meta(dst)


def test_linear_dispatch_delivers_each_message_once_and_one_per_node_per_sweep():
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    state = InMemoryLinkState.__new__(InMemoryLinkState)  # only the parts the loop touches
    state.lock = threading.RLock()
    msgs = {f"m{i}": _Msg(dst) for i, dst in enumerate([1, 2, 2, 3, 99])}  # node 99 is not simulated here
    state.message_ins_store = dict(msgs)
    state._check_stored_messages = lambda ids: None
    queue, stop = Queue(), threading.Event()
    loop = _linear_dispatch(lambda *a: pytest.fail("fell back to Flower's loop"))
    worker = threading.Thread(target=loop, args=(state, queue, {1: 0, 2: 1, 3: 2}, stop))
    worker.start()
    try:
        first = [queue.get(timeout=5) for _ in range(3)]  # one sweep: one message per node
        second = queue.get(timeout=5)  # the second message of node 2, a sweep later
    finally:
        stop.set()
        worker.join()
    assert sorted(m.metadata.dst_node_id for m in first) == [1, 2, 3]
    assert second is msgs["m2"] and queue.empty()
    assert msgs["m4"].metadata.delivered_at == ""  # not for this simulation's nodes


def test_fast_dispatch_restores_flower():
    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue
    with fast_dispatch():
        assert vce_api.add_messages_to_queue is not original
    assert vce_api.add_messages_to_queue is original
