"""The results schema: one :class:`ClientRecord` per client and round, one :class:`RoundRecord` per round.

The tables ``clients.csv`` / ``rounds.csv`` (and their Parquet twins) have exactly these fields as
columns, in this order (:func:`client_columns`, :func:`round_columns`); a row is
:meth:`ClientRecord.row` / :meth:`RoundRecord.row`. Times are simulated seconds, energies joules,
memory and traffic bytes. A figure a row cannot have is NaN (a failed client's, a skipped evaluation's).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, fields

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
    "host-wall-s",
    "too-slow",
)

# a client row's status
COUNTED = "counted"  # its update was aggregated
REJECTED = "rejected"  # it trained and sent a non-finite update, which was not used
FAILED = "failed"  # an error, or no reply within the timeout
TOO_SLOW, NOT_FITTING = "too_slow", "not_fitting"  # it trained nothing: too slow for the round, or out of memory


def _figure(kind: str):
    """A numeric field of a client row, NaN unless set (a failed client's row; ``kind``: 'client' or 'clock')."""
    return field(default=NAN, metadata={"figure": kind})


@dataclass
class ClientRecord:
    """One client's round: what it reported (``client`` figures) and its trip on the clock (``clock`` figures)."""

    round: int
    partition_id: int
    device: str
    device_class: str
    strategy: str
    fits: bool
    _: KW_ONLY
    num_examples: float = _figure("client")  # ints in a client's row, NaN in a failed one's
    steps: float = _figure("client")
    selections: float = _figure("client")
    train_loss: float = _figure("client")
    fraction_params_trained: float = _figure("client")
    emulated_train_time_s: float = _figure("client")
    emulated_train_time_band_s: float = _figure("client")
    emulated_overhead_time_s: float = _figure("client")
    emulated_probe_time_s: float = _figure("client")
    probes: float = _figure("client")
    emulated_comm_time_s: float = _figure("client")
    emulated_energy_j: float = _figure("client")
    emulated_idle_energy_j: float = _figure("client")
    emulated_peak_memory_bytes: float = _figure("client")
    emulated_probe_peak_memory_bytes: float = _figure("client")
    device_memory_bytes: float = _figure("client")
    emulated_bytes_up: float = _figure("client")
    emulated_bytes_down: float = _figure("client")
    emulated_macs: float = _figure("client")
    host_wall_s: float = _figure("client")
    policy: str = ""
    status: str = ""
    counted: bool = False
    rho: float = _figure("clock")  # the rho a deadline gave it (NaN: none)
    step_cap: float = _figure("clock")  # its step cap (-1: none)
    model_version: float = _figure("clock")
    staleness: float = _figure("clock")
    dispatch_s: float = _figure("clock")
    start_s: float = _figure("clock")
    finish_s: float = _figure("clock")
    arrival_s: float = _figure("clock")
    wasted_energy_j: float = _figure("clock")  # energy spent on an update that was not used
    uplink_bit_per_s: float = _figure("clock")
    downlink_bit_per_s: float = _figure("clock")
    battery_fraction: float = _figure("clock")
    fits_reason: str = ""
    error: str = ""

    def row(self) -> dict:
        """The table row: every field, in order."""
        return dict(self.__dict__)

    @classmethod
    def failed(cls, rnd: int, pid: int, device: str, device_class: str, strategy: str, policy: str, error: str):
        """A failed client is a row too (every figure NaN): nothing is silently dropped."""
        record = cls(rnd, pid, device, device_class, strategy, False, policy=policy, status=FAILED, error=error)
        return record  # its figures are NaN already: the fields' defaults


FIGURES = tuple(f.name for f in fields(ClientRecord) if "figure" in f.metadata)


def client_columns() -> list[str]:
    return [f.name for f in fields(ClientRecord)]


@dataclass
class RoundSummary:
    """What a round's clients did, summed up; the defaults are round 0's (the initial model), typed as
    every later round's (ints, floats) so that the rounds table keeps one schema from its first row."""

    clients: int = 0
    clients_failed: int = 0
    clients_unavailable: int = 0
    clients_not_fitting: int = 0
    clients_rejected: int = 0
    clients_no_steps: int = 0
    round_time_s: float = 0.0
    mean_train_loss: float = 0.0
    round_energy_j: float = 0.0
    max_peak_memory_bytes: float = 0.0
    policy: str = ""
    round_start_s: float = 0.0
    deadline_s: float = NAN
    clients_counted: int = 0
    clients_late: int = 0
    clients_offline: int = 0
    clients_too_slow: int = 0
    mean_staleness: float = NAN
    wasted_energy_j: float = 0.0


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
    )


def idle_rows(rows: list[ClientRecord]) -> list[ClientRecord]:
    """Counted clients that trained nothing (0 steps)."""
    return [r for r in rows if r.fits and r.status == COUNTED and r.steps == 0]


@dataclass(kw_only=True)
class RoundRecord:
    """One round's row: the global model's evaluation (NaN where skipped), totals, and the round's summary.

    ``val_accuracy`` / ``val_loss`` are columns only in a run with a validation share (None: absent).
    """

    round: int
    strategy: str
    sim_time_s: float
    test_accuracy: float = NAN
    test_loss: float = NAN
    val_accuracy: float | None = None
    val_loss: float | None = None
    total_energy_j: float
    summary: RoundSummary
    host_wall_s: float
    divergence: str = ""

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
