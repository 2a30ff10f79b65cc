"""The results schema: one :class:`ClientRecord` per client and round, one :class:`RoundRecord` per round.

The tables ``clients.csv`` / ``rounds.csv`` (and their Parquet twins) have exactly these fields as
columns, in this order (:func:`client_columns`, :func:`round_columns`); a row is
:meth:`ClientRecord.row` / :meth:`RoundRecord.row`. Times are simulated seconds, energies joules,
memory and traffic bytes. A figure a row cannot have is NaN (a failed client's, a skipped evaluation's).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, MISSING, dataclass, field, fields
from typing import Any

import numpy as np

NAN = float("nan")

# The wire: every client's reply carries exactly these metric keys (Flower aborts on keys that differ
# between clients); a ClientRecord is made from them (fedelastic.sim.engine.RoundEngine.record). A
# client reports only what it measured or emulated on its device; the engine prices the link times,
# energy and idle wait, which depend on the fleet.
METRIC_KEYS = (
    "num-examples",
    "partition-id",
    "fits",
    "steps",
    "selections",
    "train-loss",
    "fraction-params-trained",
    "emulated-train-time-s",
    "emulated-train-time-band-s",
    "emulated-overhead-time-s",
    "emulated-probe-time-s",
    "probes",
    "emulated-peak-memory-bytes",
    "emulated-probe-peak-memory-bytes",
    "emulated-bytes-up",
    "emulated-bytes-down",
    "emulated-macs",
    "emulated-compute-time-s",
    "host-wall-s",
    "too-slow",
)

# a client row's status
COUNTED = "counted"  # its update was aggregated
REJECTED = "rejected"  # it trained and sent a non-finite update, which was not used
FAILED = "failed"  # an error, or no reply within the timeout
TOO_SLOW, NOT_FITTING = "too_slow", "not_fitting"  # it trained nothing: too slow for the round, or out of memory


def _col(help: str, default: Any = MISSING, *, figure: str = "", wire: str = "", count: bool = False) -> Any:
    """A column: its ``help`` (``docs/reference/results.md`` is generated from it), its default; for a
    client row's numeric figure, ``figure`` ('client': the client's own, or 'clock': the engine's; NaN
    unless set, as in a failed client's row), and ``wire``, the reply's metric key it is copied from
    (:func:`reported`; ``count``: an int)."""
    metadata = {"help": help, **({"figure": figure} if figure else {}), **({"wire": wire, "count": count} if wire else {})}
    return field(default=NAN if figure else default, metadata=metadata)


@dataclass
class ClientRecord:
    """One client's round: what it reported (``client`` figures) and its trip on the clock (``clock`` figures)."""

    round: int = _col("the round (for `policy = \"async\"`: the aggregation the client's row belongs to)")
    partition_id: int = _col("the client: its data partition")
    device: str = _col("its device profile")
    device_class: str = _col("the profile's device class")
    strategy: str = _col("the train strategy")
    fits: bool = _col("whether the selection and its probe fit the device's training memory")
    _: KW_ONLY
    num_examples: float = _col("examples trained on", figure="client", wire="num-examples", count=True)
    steps: float = _col("local training steps run", figure="client", wire="steps", count=True)
    selections: float = _col("selections the strategy made", figure="client", wire="selections", count=True)
    train_loss: float = _col("mean local training loss", figure="client", wire="train-loss")
    fraction_params_trained: float = _col("share of the model's parameters this client trained", figure="client", wire="fraction-params-trained")
    emulated_train_time_s: float = _col("local training time on the device (steps, probes and selector work)", figure="client")
    emulated_train_time_band_s: float = _col("the training time's one-sigma band ([uncertainty](../explanation/cost-model.md#uncertainty))", figure="client", wire="emulated-train-time-band-s")
    emulated_overhead_time_s: float = _col("selector work and probe time, included in the training time", figure="client", wire="emulated-overhead-time-s")
    emulated_probe_time_s: float = _col("probe time, included in the overhead", figure="client", wire="emulated-probe-time-s")
    probes: float = _col("probes run", figure="client", wire="probes", count=True)
    emulated_comm_time_s: float = _col("download and upload time on the client's links (priced by the engine)", figure="client")
    emulated_energy_j: float = _col("energy of the trip, training and radio, up to the round's close (priced by the engine)", figure="client")
    emulated_idle_energy_j: float = _col("idle energy while waiting for the round to close", figure="client")
    emulated_energy_band_j: float = _col("one-sigma band of the energy and idle energy together: the time band and the power's band combined ([uncertainty](../explanation/cost-model.md#uncertainty))", figure="client")
    emulated_peak_memory_bytes: float = _col("peak memory in RAM (an MCU's SRAM): the larger of training and probes", figure="client", wire="emulated-peak-memory-bytes")
    emulated_probe_peak_memory_bytes: float = _col("the probes' own peak memory", figure="client", wire="emulated-probe-peak-memory-bytes")
    device_memory_bytes: float = _col("the device's training memory", figure="client")
    emulated_bytes_up: float = _col("bytes sent: the trained elements (0 in a one-device stream)", figure="client", wire="emulated-bytes-up")
    emulated_bytes_down: float = _col("bytes received: the whole model (0 in a one-device stream)", figure="client", wire="emulated-bytes-down")
    emulated_macs: float = _col("multiply-accumulates of the local training", figure="client", wire="emulated-macs")
    host_wall_s: float = _col("real time the host took (the only column that differs between identical runs)", figure="client", wire="host-wall-s")
    policy: str = _col("the server policy ([The fleet](../explanation/fleet.md))", "")
    status: str = _col("the client's fate: `counted`, `late`, `extra`, `offline`, `too_slow`, `not_fitting`, `cancelled`, `rejected` or `failed`", "")
    counted: bool = _col("whether its update was aggregated", False)
    rho: float = _col("the rho a deadline policy gave it (NaN: none)", figure="clock")
    step_cap: float = _col("the step cap a deadline policy gave it (-1: none)", figure="clock")
    model_version: float = _col("the model version it trained on (async runs)", figure="clock")
    staleness: float = _col("how many versions old its model was on arrival (async runs)", figure="clock")
    dispatch_s: float = _col("simulated time it was sent the model", figure="clock")
    start_s: float = _col("simulated time it started training", figure="clock")
    finish_s: float = _col("simulated time it finished training", figure="clock")
    arrival_s: float = _col("simulated time its update arrived (NaN: it did not)", figure="clock")
    wasted_energy_j: float = _col("energy spent on an update that was not used", figure="clock")
    uplink_bit_per_s: float = _col("its uplink this round", figure="clock")
    downlink_bit_per_s: float = _col("its downlink this round", figure="clock")
    battery_fraction: float = _col("its battery's charge at dispatch (NaN: no battery)", figure="clock")
    fits_reason: str = _col("why the selection did not fit, or why it ran 0 steps", "")
    error: str = _col("one clean line for a failed or rejected client (the full text is in `errors.log`)", "")

    def row(self) -> dict:
        """The table row: every field, in order."""
        return dict(self.__dict__)

    @classmethod
    def failed(cls, rnd: int, pid: int, device: str, device_class: str, strategy: str, policy: str, error: str):
        """A failed client is a row too (every figure NaN): nothing is silently dropped."""
        record = cls(rnd, pid, device, device_class, strategy, False, policy=policy, status=FAILED, error=error)
        return record  # its figures are NaN already: the fields' defaults


def reported(metrics: dict) -> dict:
    """The fields of a client's row copied from its reply's ``metrics`` (those with a ``wire`` key)."""
    return {f.name: int(metrics[key]) if f.metadata["count"] else metrics[key] for f, key in _WIRE}


_WIRE = [(f, f.metadata["wire"]) for f in fields(ClientRecord) if "wire" in f.metadata]
FIGURES = tuple(f.name for f in fields(ClientRecord) if "figure" in f.metadata)


def client_columns() -> list[str]:
    return [f.name for f in fields(ClientRecord)]


@dataclass
class RoundSummary:
    """What a round's clients did, summed up; the defaults are round 0's (the initial model), typed as
    every later round's (ints, floats) so that the rounds table keeps one schema from its first row."""

    clients: int = _col("clients sampled this round (failed ones included)", 0)
    clients_failed: int = _col("clients that failed (an error, or no reply within the timeout)", 0)
    clients_unavailable: int = _col("devices not reachable (or not charged) when the round started", 0)
    clients_not_fitting: int = _col("clients whose selection did not fit the device's memory", 0)
    clients_rejected: int = _col("clients whose non-finite update was rejected", 0)
    clients_no_steps: int = _col("clients that fit but trained nothing (0 steps; warned once per run with the device and reason)", 0)
    round_time_s: float = _col("the round's length on the simulated clock", 0.0)
    mean_train_loss: float = _col("mean train loss of the updates used", 0.0)
    round_energy_j: float = _col("the fleet's energy this round (trips and idle waits)", 0.0)
    max_peak_memory_bytes: float = _col("the largest client peak memory of the round", 0.0)
    policy: str = _col("the server policy", "")
    round_start_s: float = _col("the simulated clock at the round's start", 0.0)
    deadline_s: float = _col("the round's deadline (NaN: none)", NAN)
    clients_counted: int = _col("clients whose update was aggregated", 0)
    clients_late: int = _col("clients that arrived after the round closed, or beyond the k needed", 0)
    clients_offline: int = _col("clients that went offline before they arrived", 0)
    clients_too_slow: int = _col("clients the deadline left no time for even a forward pass", 0)
    mean_staleness: float = _col("async runs: mean staleness of the aggregated updates", NAN)
    wasted_energy_j: float = _col("energy of trips whose update was not used", 0.0)
    round_time_band_s: float = _col("one-sigma band of the round's length: the largest training-time band of its clients (a round's length moves by at most that; [uncertainty](../explanation/cost-model.md#uncertainty))", 0.0)
    round_energy_band_j: float = _col("one-sigma band of the round's energy: its clients' energy bands summed (a profile's error is the same for every client of that device, so bands add)", 0.0)


def summarize(
    rows: list[ClientRecord], failed: int, unavailable: int, policy: str, start_s: float, end_s: float,
    deadline_s: float | None,
) -> RoundSummary:  # fmt: skip
    """The summary of a round's (non-failed) client ``rows``, with ``failed`` failures besides them."""
    fitted = [r for r in rows if r.fits and r.status != TOO_SLOW]
    status = [r.status for r in rows]
    counted = [r for r in rows if r.counted]
    losses = [r.train_loss for r in fitted if r.steps and r.status != REJECTED]
    return RoundSummary(
        clients=len(rows) + failed,
        clients_failed=failed,
        clients_unavailable=unavailable,
        clients_not_fitting=status.count(NOT_FITTING),
        clients_rejected=status.count(REJECTED),
        clients_no_steps=len(idle_rows(rows)),
        round_time_s=float(end_s - start_s),  # plain floats, as round 0's (one Parquet schema)
        mean_train_loss=float(np.nanmean(losses)) if losses else NAN,
        round_energy_j=float(sum(r.emulated_energy_j + r.emulated_idle_energy_j for r in rows)),
        max_peak_memory_bytes=float(max((r.emulated_peak_memory_bytes for r in rows), default=0.0)),
        policy=policy,
        round_start_s=start_s,
        deadline_s=float(deadline_s) if deadline_s is not None else NAN,
        clients_counted=len(counted),
        clients_late=status.count("late") + status.count("extra"),
        clients_offline=status.count("offline"),
        clients_too_slow=status.count(TOO_SLOW),
        mean_staleness=float(np.mean([r.staleness for r in counted])) if counted else NAN,
        wasted_energy_j=float(sum(r.wasted_energy_j for r in rows)),
        round_time_band_s=float(max((r.emulated_train_time_band_s for r in fitted), default=0.0)),
        round_energy_band_j=float(sum(r.emulated_energy_band_j for r in rows)),
    )


def idle_rows(rows: list[ClientRecord]) -> list[ClientRecord]:
    """Counted clients that trained nothing (0 steps)."""
    return [r for r in rows if r.fits and r.status == COUNTED and r.steps == 0]


@dataclass(kw_only=True)
class RoundRecord:
    """One round's row: the global model's evaluation (NaN where skipped), totals, and the round's summary.

    ``val_accuracy`` / ``val_loss`` are columns only in a run with a validation share (None: absent).
    """

    round: int = _col("the round (row 0: the initial model; for `policy = \"async\"`: the aggregation)")
    strategy: str = _col("the train strategy")
    sim_time_s: float = _col("the simulated clock at the round's end")
    test_accuracy: float = _col("the global model's accuracy on the test set (NaN on rounds skipped by `server.evaluate_every`)", NAN)
    test_loss: float = _col("the global model's loss on the test set (NaN where skipped)", NAN)
    val_accuracy: float | None = _col("accuracy on the clients' held-out validation shares (a column only with `data.validation > 0`)", None)
    val_loss: float | None = _col("loss on the validation shares (only with `data.validation > 0`)", None)
    total_energy_j: float = _col("the fleet's energy in all so far")
    summary: RoundSummary = _col("what the round's clients did (each of its fields is a column, here in the table)")
    host_wall_s: float = _col("real time of the round, from its plan to the end of its central evaluation")
    divergence: str = _col("why the round diverged, or empty ([Divergence](status.md))", "")

    def row(self) -> dict:
        out = dict(self.__dict__)
        if self.val_accuracy is None:
            del out["val_accuracy"], out["val_loss"]
        summary = out.pop("summary")
        tail = {"host_wall_s": out.pop("host_wall_s"), "divergence": out.pop("divergence")}
        return {**out, **summary.__dict__, **tail}


def round_columns(validation: bool = False) -> list[str]:
    names = [f.name for f in fields(RoundRecord) if validation or not f.name.startswith("val_")]
    at = names.index("summary")
    return names[:at] + [f.name for f in fields(RoundSummary)] + names[at + 1 :]
