"""Flower's messages cross Ray's process boundary through the standard pickle (``lifecycle.plain_message_pickling``)."""

import pickle

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from ray import cloudpickle

from fedelastic.fl.rayrun import ShippedClientApp
from fedelastic.runtime.lifecycle import plain_message_pickling


@pytest.fixture
def registered():
    dispatch = cloudpickle.CloudPickler.dispatch
    before = dispatch.get(Message)
    plain_message_pickling()
    yield
    dispatch.pop(Message, None)
    if before is not None:
        dispatch[Message] = before


def test_ray_pickles_a_message_with_the_standard_pickle_and_gets_the_same_message_back(registered):
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 1, 0  # what Flower sets in a ServerApp
    weights = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    content = RecordDict(
        {
            "arrays.0": ArrayRecord({"w": Array(weights)}),
            "metrics.0": MetricRecord({"num-examples": 9, "loss": 0.25}),
            "cohort": ConfigRecord({"status": ["done"], "reasons": [""], "abandoned": False}),
        }
    )
    msg = Message(content=content, message_type=MessageType.TRAIN, dst_node_id=5, group_id="cohort-1")
    blob = cloudpickle.dumps(msg)  # what Ray's serializer calls
    back = pickle.loads(blob)
    assert type(back) is Message
    assert np.array_equal(back.content["arrays.0"]["w"].numpy(), weights)  # the hand-made values, not re-encoded ones
    assert back.content["metrics.0"]["num-examples"] == 9 and back.content["metrics.0"]["loss"] == 0.25
    assert back.content["cohort"]["status"] == ["done"] and back.content["cohort"]["abandoned"] is False
    assert (back.metadata.dst_node_id, back.metadata.group_id, back.metadata.message_type) == (5, "cohort-1", "train")
    # the pickle stream is the standard pickle's bytes of the message, wrapped in one call of pickle.loads
    assert pickle.dumps(msg, protocol=5) in blob
    reducer = cloudpickle.CloudPickler.dispatch[Message]
    assert reducer(msg)[0] is pickle.loads


def test_a_shipped_client_app_pickles_the_same_bytes_every_call(make_scenario):
    from fedelastic.fl.clientapp import make_client_app

    app = ShippedClientApp(make_client_app(make_scenario()))
    first = cloudpickle.dumps(app)
    assert cloudpickle.dumps(app) == first  # pickled once (the loader is not pickled again by value)
    assert app._payload in first
