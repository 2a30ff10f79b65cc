"""fedelastic's parts in a user's own Flower app: the partial-aware FedAvg and the comm-pricing Mod."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedelastic.devices.profile import get_profile
from fedelastic.fl.grids import InProcessGrid
from fedelastic.fl.your_app import PartialAwareFedAvg, device_comm_mod, price_transfer

GLOBAL = {
    "w": np.zeros((2, 2), np.float32),
    "b": np.zeros(2, np.float32),
    "c": np.full(3, 7.0, np.float32),
}


def _rec(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def _user_app(replies: dict[int, tuple[dict, dict, int]]) -> ClientApp:
    """A user's ClientApp: partition p replies with (arrays, masks, num-examples) from ``replies``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays, masks, n = replies[int(context.node_config["partition-id"])]
        content = RecordDict({"arrays": _rec(arrays), "metrics": MetricRecord({"num-examples": n})})
        if masks:
            content["masks"] = _rec(masks)
        return Message(content, reply_to=msg)

    return app


def _one_round(strategy, app: ClientApp, num_nodes: int) -> dict[str, np.ndarray]:
    result = strategy.start(InProcessGrid(app, num_nodes), _rec(GLOBAL), num_rounds=1)
    return {k: v.numpy() for k, v in result.arrays.items()}


def test_partial_updates_average_each_element_over_the_clients_that_trained_it():
    replies = {
        0: ({"w": np.ones((2, 2), np.float32)}, {}, 10),  # trains all of w
        1: (  # trains output channel 0 of w, and b
            {"w": np.full((2, 2), 5.0, np.float32), "b": np.full(2, 2.0, np.float32)},
            {"w": np.array([1.0, 0.0], np.float32)},
            30,
        ),
    }
    strategy = PartialAwareFedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)
    got = _one_round(strategy, _user_app(replies), 2)
    # w row 0: (10 * 1 + 30 * 5) / 40 = 4; row 1: only client 0 trained it -> 1
    np.testing.assert_allclose(got["w"], [[4.0, 4.0], [1.0, 1.0]])
    np.testing.assert_allclose(got["b"], [2.0, 2.0])  # only client 1
    np.testing.assert_allclose(got["c"], [7.0, 7.0, 7.0])  # nobody trained c: it keeps its value
    assert got["w"].dtype == np.float32


def test_full_updates_give_flowers_fedavg():
    rng = np.random.default_rng(0)
    replies = {
        p: ({k: rng.normal(size=v.shape).astype(np.float32) for k, v in GLOBAL.items()}, {}, n)
        for p, n in enumerate((3, 5, 11))
    }
    args = {"fraction_evaluate": 0.0, "min_train_nodes": 3, "min_available_nodes": 3}
    ours = _one_round(PartialAwareFedAvg(**args), _user_app(replies), 3)
    flowers = _one_round(FedAvg(**args), _user_app(replies), 3)
    for name in GLOBAL:
        np.testing.assert_allclose(ours[name], flowers[name], rtol=1e-6, atol=1e-7)


def test_a_reply_with_a_tensor_the_model_lacks_is_an_error():
    strategy = PartialAwareFedAvg(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1)
    strategy._global = _rec(GLOBAL)
    reply = _user_app({0: ({"z": np.ones(1, np.float32)}, {}, 1)})(
        Message(RecordDict({"arrays": _rec(GLOBAL)}), dst_node_id=1, message_type=MessageType.TRAIN),
        Context(0, 1, {"partition-id": 0}, RecordDict(), {}),
    )
    with pytest.raises(ValueError, match="'z'"):
        strategy.aggregate_train(1, [reply])


def _priced_reply(device, partition: int, received: int, sent: int) -> MetricRecord:
    app = ClientApp(mods=[device_comm_mod(device)])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        content = RecordDict(
            {
                "arrays": _rec({"u": np.zeros(sent, np.float32)}),
                "metrics": MetricRecord({"num-examples": 5}),
            }
        )
        return Message(content, reply_to=msg)

    msg = Message(
        RecordDict({"arrays": _rec({"g": np.zeros(received, np.float32)})}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    reply = app(msg, Context(0, 1, {"partition-id": partition}, RecordDict(), {}))
    assert list(reply.content.metric_records) == ["metrics"]  # added to the reply's only MetricRecord
    return reply.content["metrics"]


def test_comm_mod_prices_the_transfers_from_the_profile():
    # raspberry_pi_4: fp32 (4 B), uplink 20 Mbit/s, downlink 50 Mbit/s, latency 30 ms, transmit 3.5 W, receive 3.3 W
    # 1000 elements down = 4000 B: 0.03 + 32000 / 50e6 = 0.03064 s; 250 up = 1000 B: 0.03 + 8000 / 20e6 = 0.0304 s
    m = _priced_reply("raspberry_pi_4", 0, received=1000, sent=250)
    assert m["num-examples"] == 5
    assert (m["comm-bytes-down"], m["comm-bytes-up"]) == (4000.0, 1000.0)
    assert m["comm-time-s"] == pytest.approx(0.06104)
    assert m["comm-energy-j"] == pytest.approx(3.5 * 0.0304 + 3.3 * 0.03064)  # 0.207512 J
    # nrf52840 (chosen by partition id): int8 (1 B), 1 Mbit/s both ways, 30 ms, 24.3 / 25.8 mW, 1.25 pJ per byte
    # down 1000 B: 0.03 + 8000 / 1e6 = 0.038 s; up 250 B: 0.03 + 2000 / 1e6 = 0.032 s
    m = _priced_reply(lambda ctx: ["raspberry_pi_4", "nrf52840"][ctx.node_config["partition-id"]], 1, 1000, 250)
    assert (m["comm-bytes-down"], m["comm-bytes-up"]) == (1000.0, 250.0)
    assert m["comm-time-s"] == pytest.approx(0.070)
    assert m["comm-energy-j"] == pytest.approx(0.0243 * 0.032 + 0.0258 * 0.038 + 1.25e-12 * 1250)


def test_comm_mod_leaves_messages_without_arrays_alone():
    app = ClientApp(mods=[device_comm_mod("jetson_nano")])

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"partition-id": 0})}), reply_to=msg)

    msg = Message(RecordDict(), dst_node_id=1, message_type=MessageType.QUERY)
    reply = app(msg, Context(0, 1, {}, RecordDict(), {}))
    assert dict(reply.content["metrics"]) == {"partition-id": 0}


@pytest.mark.parametrize("device", ["raspberry_pi_4", "nrf52840", "jetson_nano"])
def test_price_transfer_is_the_cost_models_communication(device):
    profile = get_profile(device)
    up, down = 12_345.0, 67_890.0
    price = price_transfer(profile, up, down)
    # by hand: a latency and the bits over the link each way, at the radio's power, plus the per-byte energy
    up_s = profile.latency_s.value + 8 * up / profile.uplink_bit_per_s.value
    down_s = profile.latency_s.value + 8 * down / profile.downlink_bit_per_s.value
    per_byte = profile.energy_per_byte_j.value * (up + down) if profile.energy_per_byte_j is not None else 0.0
    energy = profile.power_transmit_w.value * up_s + profile.power_receive_w.value * down_s + per_byte
    assert (price["up_s"], price["down_s"]) == pytest.approx((up_s, down_s))
    assert price["energy_j"] == pytest.approx(energy)
