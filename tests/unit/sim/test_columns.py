"""The results tables' readers (progress lines, summary, report, comparison statistics) name
their columns through fedelastic.sim.columns, and every name there is a field of the records:
renaming a field fails here, not in a user's report."""

from __future__ import annotations

import ast
import json
import logging
import math
from pathlib import Path

import pandas as pd
import pytest

import fedelastic
from fedelastic.sim.columns import ClientCol, RoundCol
from fedelastic.sim.records import (
    COUNTED,
    NOT_FITTING,
    ClientRecord,
    RoundRecord,
    RoundSummary,
    client_columns,
    round_columns,
)

PACKAGE = Path(fedelastic.__file__).parent


def _names(cls: type) -> dict[str, str]:
    return {k: v for k, v in vars(cls).items() if k.isupper()}


@pytest.mark.parametrize(
    ("cls", "columns"), [(RoundCol, round_columns(validation=True)), (ClientCol, client_columns())], ids=["rounds", "clients"]
)
def test_every_column_name_is_a_field_of_the_records(cls, columns):
    names = _names(cls)
    assert len(names) >= 10
    for attr, value in names.items():
        assert value in columns, f"{cls.__name__}.{attr} = {value!r} is not a column of the table"
        assert attr == value.upper()


def _uses(tree: ast.Module) -> list[tuple[str, str, int]]:
    """(class, attribute, line) of every ``RoundCol.X`` / ``ClientCol.X`` in a module, import aliases followed."""
    alias = {"RoundCol": "RoundCol", "ClientCol": "ClientCol"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("columns"):
            alias.update({a.asname or a.name: a.name for a in node.names})
    return [
        (alias[node.value.id], node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in alias
    ]


def test_every_column_the_package_reads_by_name_exists():
    """A static check (the readers are not all type-checked): each ``RoundCol.X`` in the package is defined."""
    known = {"RoundCol": _names(RoundCol), "ClientCol": _names(ClientCol)}
    seen = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for cls, attr, line in _uses(ast.parse(path.read_text(), str(path))):
            seen += 1
            assert attr in known[cls], f"{path}:{line}: {cls}.{attr} is not a column name"
    assert seen >= 40  # the readers in cli, app, summary, report, comparison and seedstats


def _tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """A two-round run built by hand from the records: two clients, one of which does not fit."""
    pi = dict(device="raspberry_pi_4", device_class="sbc", strategy="full")
    nano = dict(device="jetson_nano", device_class="gpu-edge", strategy="full")
    clients = [
        ClientRecord(r, 0, **pi, fits=True, steps=3, emulated_train_time_s=t, emulated_energy_j=e,
                     emulated_idle_energy_j=0.5, emulated_peak_memory_bytes=m, device_memory_bytes=4e6,
                     fraction_params_trained=1.0, emulated_comm_time_s=0.25, status=COUNTED, counted=True,
                     emulated_train_time_band_s=0.1 * t, emulated_energy_band_j=0.5 * e).row()
        for r, t, e, m in ((1, 2.0, 1.0, 1e6), (2, 4.0, 3.0, 3e6))
    ] + [
        ClientRecord(r, 1, **nano, fits=False, steps=0, emulated_train_time_s=0.0, emulated_energy_j=0.0,
                     emulated_idle_energy_j=1.0, emulated_peak_memory_bytes=9e6, device_memory_bytes=8e6,
                     fraction_params_trained=0.0, emulated_comm_time_s=0.0, status=NOT_FITTING).row()
        for r in (1, 2)
    ]  # fmt: skip
    rounds = [
        RoundRecord(round=r, strategy="full", sim_time_s=s, test_accuracy=a, total_energy_j=j,
                    summary=RoundSummary(clients=2 * (r > 0), clients_not_fitting=int(r > 0),
                                         round_time_band_s=0.1 * r, round_energy_band_j=0.5 * r), host_wall_s=0.1).row()
        for r, s, a, j in ((0, 0.0, 0.1, 0.0), (1, 5.0, 0.5, 2.5), (2, 11.0, 0.75, 7.0))
    ]  # fmt: skip
    return pd.DataFrame(rounds), pd.DataFrame(clients)


def test_the_readers_read_tables_made_of_the_records_alone(tmp_path, capsys):
    from fedelastic.comparisons.report import device_table, energy_by_class, memory_by_device, write_html
    from fedelastic.results.seedstats import summarise
    from fedelastic.results.summary import report

    rounds, clients = _tables()
    headline = summarise(rounds, clients, target=0.7)  # by hand from the rows above
    assert headline["final_accuracy"] == 0.75 and headline["sim_time_s"] == 11.0 and headline["energy_j"] == 7.0
    assert headline["fits_fraction"] == 0.5 and headline["mean_train_time_per_round_s"] == 1.5
    assert headline["time_to_target_s"] == 11.0 and math.isclose(headline["host_wall_s"], 0.2)
    assert math.isclose(headline["sim_time_band_s"], 0.3) and math.isclose(headline["energy_band_j"], 1.5)  # 0.1 + 0.2, 0.5 + 1.0
    energy = energy_by_class(clients)
    assert energy.loc["sbc"].tolist() == [1, 4.0, 1.0] and energy.loc["gpu-edge"].tolist() == [1, 0.0, 2.0]
    memory = memory_by_device(clients)
    assert memory.loc["jetson_nano"].tolist() == [9e6, 8e6, 9 / 8]
    pi_row = [c.strip() for c in device_table(clients).split("<td>raspberry_pi_4</td>")[1].split("</tr>")[0].splitlines() if c.strip()]
    # bands: train (0.2 + 0.4) / 2, energy (0.5 + 1.5) / 2
    pi_row_expected = ("sbc", 1, "100%", "0%", 0, 3, 0.25, 2, "± 0.3", "± 1", "3.0 MB", "4.0 MB", "100%")
    assert pi_row == [f"<td>{v}</td>" for v in pi_row_expected]

    (tmp_path / "status.json").write_text(json.dumps({"status": "completed"}))
    rounds.to_parquet(tmp_path / "rounds.parquet")
    clients.to_parquet(tmp_path / "clients.parquet")
    report(tmp_path)
    out = capsys.readouterr().out
    assert "final accuracy 0.750, simulated 11.0 s" in out
    page = write_html(tmp_path).read_text()
    assert (
        "2 rounds, final test accuracy <b>0.750</b> after 11.0 s of simulated time (± 0.3 s, the emulation's one-sigma "
        "band) and 7.0 J (± 1.5 J, the emulation's one-sigma band); 2 clients"
    ) in page


def test_the_progress_lines_read_a_round_record(capsys):
    from fedelastic.app import _log_round
    from fedelastic.cli import _print_round

    rounds, _ = _tables()
    row = rounds.iloc[2].to_dict()
    _print_round(row)
    line = capsys.readouterr().out
    assert "round 2  accuracy 0.750  simulated     11.00 s  energy       7.0 J  failed 0  not fitting 1" in line
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flwr").addHandler(handler)
    try:
        _log_round(row)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert seen == ["[fedelastic] round 2: test accuracy 0.7500, simulated time 11.0 s, energy 7.0 J"]


def test_a_rows_reported_figures_are_copied_from_the_reply():
    from fedelastic.sim.records import METRIC_KEYS, reported

    metrics = {key: float(i) + 0.5 for i, key in enumerate(METRIC_KEYS)}
    got = reported(metrics)
    # by hand: the counts are ints (truncated), the other figures copied as they are; what the engine
    # prices (comm time, energy) and what it takes from the clock (train time) are not copied
    assert got["num_examples"] == int(metrics["num-examples"]) and isinstance(got["num_examples"], int)
    assert got["steps"] == int(metrics["steps"]) and got["probes"] == int(metrics["probes"])
    assert got["emulated_macs"] == metrics["emulated-macs"] and got["host_wall_s"] == metrics["host-wall-s"]
    assert not {"emulated_comm_time_s", "emulated_energy_j", "emulated_train_time_s", "emulated_idle_energy_j"} & set(got)
    assert len(got) == 15
