"""fedelastic's parts for your own Flower app.

* :class:`PartialAwareFedAvg`: Flower's ``FedAvg`` (same arguments) that accepts partial updates,
  a client sending only the tensors it trained, plus optional 0/1 output-channel masks, and
  averages each element over the clients that trained it
  (:func:`fedelastic.sim.aggregate.aggregate_partial`).
* :func:`device_comm_mod`: a ClientApp Mod, like Flower's ``arrays_size_mod``, that prices the
  arrays a client receives and sends on an emulated device's link and adds the figures to the
  reply's metrics.

Neither needs torch or Ray; a reply that the strategy reads looks like::

    RecordDict({
        "arrays": ArrayRecord({name: trained tensor, ...}),   # only the tensors trained
        "masks": ArrayRecord({name: 0/1 per output channel}),  # optional: tensors trained in part
        "metrics": MetricRecord({"num-examples": n, ...}),
    })
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency
from flwr.supercore import log

from ..cost.costmodel import device_energy_j, link_times_s
from ..devices.profile import DeviceProfile, get_profile
from ..sim.aggregate import ClientUpdate, aggregate_partial


def _to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


class PartialAwareFedAvg(FedAvg):
    """``FedAvg`` over partial updates; takes FedAvg's arguments, plus ``maskrecord_key``.

    A reply's ``arrayrecord_key`` record may hold any subset of the model's tensors, and its
    ``maskrecord_key`` record (optional) a 0/1 vector over the output channels (first axis) of a
    tensor trained in part. Each element of the new global model is the mean, weighted by
    ``weighted_by_key``, over the replies that trained it; an element that no reply trained
    keeps its value. When every reply sends every tensor without masks, this is FedAvg.
    """

    def __init__(self, *args, maskrecord_key: str = "masks", **kwargs):
        super().__init__(*args, **kwargs)
        self.maskrecord_key = maskrecord_key
        self._global: ArrayRecord | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._global = arrays  # the model the replies start from: untrained elements keep it
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        valid = [msg for msg in replies if not msg.has_error()]
        for msg in replies:
            if msg.has_error():
                log(
                    WARNING,
                    "aggregate_train: error in reply from node %d: %s",
                    msg.metadata.src_node_id,
                    msg.error.reason,
                )
        if not valid:
            return None, None
        contents = [msg.content for msg in valid]
        # FedAvg's own check wants one ArrayRecord with the same keys everywhere; partial replies
        # differ by design, so only the metrics are checked here and the arrays below
        validate_message_reply_consistency(contents, self.weighted_by_key, check_arrayrecord=False)
        if self._global is None:
            raise RuntimeError("aggregate_train before configure_train: no global model to update")
        current = _to_numpy(self._global)
        updates = []
        for content in contents:
            if self.arrayrecord_key not in content.array_records:
                raise ValueError(f"a reply has no ArrayRecord {self.arrayrecord_key!r}")
            arrays = _to_numpy(content.array_records[self.arrayrecord_key])
            unknown = sorted(set(arrays) - set(current))
            if unknown:
                raise ValueError(f"a reply sent tensors the global model does not have: {unknown}")
            masks = content.array_records.get(self.maskrecord_key)
            metrics = next(iter(content.metric_records.values()))
            updates.append(
                ClientUpdate(float(metrics[self.weighted_by_key]), arrays, _to_numpy(masks) if masks else {})
            )
        merged = aggregate_partial(current, updates)
        new = ArrayRecord({name: Array(np.asarray(value)) for name, value in merged.items()})
        return new, self.train_metrics_aggr_fn(contents, self.weighted_by_key)


def price_transfer(profile: DeviceProfile, bytes_up: float, bytes_down: float) -> dict[str, float]:
    """Time and energy of sending ``bytes_up`` and receiving ``bytes_down`` on the device's link.

    The same pricing as a fedelastic run's engine, by the same functions
    (:func:`fedelastic.cost.costmodel.link_times_s`, :func:`fedelastic.cost.costmodel.device_energy_j`): each
    direction costs the link latency plus bits / bitrate, at the radio's transmit or receive power,
    plus the profile's optional energy per byte moved.
    """
    down_s, up_s = link_times_s(
        bytes_down, bytes_up, profile.downlink_bit_per_s.value, profile.uplink_bit_per_s.value, profile.latency_s.value
    )
    energy = device_energy_j(profile, 0.0, up_s, down_s, 0.0, bytes_up + bytes_down)
    return {"up_s": up_s, "down_s": down_s, "energy_j": energy}


def _elements(msg: Message) -> int:
    return sum(int(np.prod(array.shape)) for record in msg.content.array_records.values() for array in record.values())


def device_comm_mod(
    device: str | Path | Callable[[Context], str | Path], device_dirs: tuple[str | Path, ...] = ()
) -> Mod:
    """A Mod that prices a client's model transfers as if it ran on ``device``.

    ``device`` is a profile name or ``.toml`` path, or a function of the node's Context that
    returns one (e.g. by ``context.node_config["partition-id"]``). For a message that carries
    arrays either way, the mod counts the array elements received and sent, at the device's
    training dtype (``bytes_per_element``), prices them with :func:`price_transfer`, logs the
    figures and adds them to the reply's MetricRecord (the one named ``metrics``, or the only
    one; a new ``metrics`` record if there is none)::

        comm-bytes-down, comm-bytes-up, comm-time-s, comm-energy-j

    Other messages, and error replies, pass through unchanged.
    """
    profiles: dict[str, DeviceProfile] = {}

    def profile_of(context: Context) -> DeviceProfile:
        name = str(device(context) if callable(device) else device)
        if name not in profiles:
            profiles[name] = get_profile(name, tuple(device_dirs), context="device_comm_mod")
        return profiles[name]

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        received = _elements(msg)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        sent = _elements(reply)
        if not received and not sent:
            return reply
        profile = profile_of(context)
        down, up = received * profile.bytes_per_element, sent * profile.bytes_per_element
        price = price_transfer(profile, up, down)
        figures = {
            "comm-bytes-down": float(down),
            "comm-bytes-up": float(up),
            "comm-time-s": price["up_s"] + price["down_s"],
            "comm-energy-j": price["energy_j"],
        }
        log(INFO, "device_comm_mod (%s): %s", profile.name, figures)
        records = reply.content.metric_records
        if "metrics" in records:
            records["metrics"].update(figures)
        elif len(records) == 1:
            next(iter(records.values())).update(figures)
        else:
            reply.content["metrics"] = MetricRecord(figures)
        return reply

    return mod
