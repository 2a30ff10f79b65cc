"""Names of the results tables' columns, for the code that reads the tables or their rows back
(the command's progress lines, the terminal summary, the HTML report, comparisons, the Flower App's log).

Every name is a field of the schema in :mod:`fedelastic.sim.records` (``tests/unit/sim/test_columns.py``
checks it, and that every ``RoundCol.X`` / ``ClientCol.X`` the package reads exists): a renamed field
fails that test, not a user's report. Read a column as ``rounds[RoundCol.TEST_ACCURACY]`` or a
row's figure as ``row[RoundCol.SIM_TIME_S]``. Add a name here when a reader needs one.
"""

from __future__ import annotations

from typing import Final


class RoundCol:
    """Columns of ``rounds.csv``: fields of :class:`~.records.RoundRecord` and its :class:`~.records.RoundSummary`."""

    ROUND: Final = "round"
    STRATEGY: Final = "strategy"
    SIM_TIME_S: Final = "sim_time_s"
    TEST_ACCURACY: Final = "test_accuracy"
    VAL_ACCURACY: Final = "val_accuracy"  # only in a run with a validation share
    VAL_LOSS: Final = "val_loss"
    TOTAL_ENERGY_J: Final = "total_energy_j"
    ROUND_TIME_BAND_S: Final = "round_time_band_s"
    ROUND_ENERGY_BAND_J: Final = "round_energy_band_j"
    CLIENTS: Final = "clients"
    CLIENTS_FAILED: Final = "clients_failed"
    CLIENTS_NOT_FITTING: Final = "clients_not_fitting"
    CLIENTS_REJECTED: Final = "clients_rejected"
    CLIENTS_NO_STEPS: Final = "clients_no_steps"
    HOST_WALL_S: Final = "host_wall_s"
    DIVERGENCE: Final = "divergence"


class ClientCol:
    """Columns of ``clients.csv``: fields of :class:`~.records.ClientRecord`."""

    ROUND: Final = "round"
    PARTITION_ID: Final = "partition_id"
    DEVICE: Final = "device"
    DEVICE_CLASS: Final = "device_class"
    FITS: Final = "fits"
    STEPS: Final = "steps"
    FRACTION_PARAMS_TRAINED: Final = "fraction_params_trained"
    EMULATED_TRAIN_TIME_S: Final = "emulated_train_time_s"
    EMULATED_TRAIN_TIME_BAND_S: Final = "emulated_train_time_band_s"
    EMULATED_COMM_TIME_S: Final = "emulated_comm_time_s"
    EMULATED_ENERGY_J: Final = "emulated_energy_j"
    EMULATED_IDLE_ENERGY_J: Final = "emulated_idle_energy_j"
    EMULATED_ENERGY_BAND_J: Final = "emulated_energy_band_j"
    EMULATED_PEAK_MEMORY_BYTES: Final = "emulated_peak_memory_bytes"
    DEVICE_MEMORY_BYTES: Final = "device_memory_bytes"
    STATUS: Final = "status"
    FITS_REASON: Final = "fits_reason"
    ERROR: Final = "error"
