"""The fault matrix: every bad input and fault, and what fedelastic must do about it.

Bad input ends in exit 2 with one line naming the file and the key, before anything runs.
A fault during a run is recorded and the run goes on (or stops with status 'failed'); the
status and exit code say which, and nothing finished is lost. Each row of the tables below is
one case; the Ray cases are marked ``ray``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedelastic.cli import main
from fedelastic.devices.profile import builtin_profile_dir
from fedelastic.results.recorder import read_status
from tests.support import (
    full_disk,
    only_run_dir,
    run_cli,
    scenario_file,
    small_scenario_dict,
    user_models,
    write_toml,
)

# -- helpers -----------------------------------------------------------------------------------


def profile(tmp: Path, name: str = "my_board", **changes) -> Path:
    import tomllib

    raw = tomllib.loads((builtin_profile_dir() / "jetson_nano.toml").read_text())
    raw["name"] = name
    for dotted, value in changes.items():
        *path, last = dotted.split(".")
        table = raw
        for part in path:
            table = table.setdefault(part, {})
        table[last] = value
    folder = tmp / "devices"
    folder.mkdir(exist_ok=True)
    return write_toml(folder / f"{name}.toml", raw)


# -- bad input: exit 2, one line naming the file and the key ------------------------------------


@dataclass
class Bad:
    id: str
    setup: object  # (tmp, monkeypatch) -> argv
    key: str  # must appear in the error line
    file: str = "scenario"  # the error names this file ("scenario": the file run; "": no file involved)


def _scn(**overrides):
    return lambda tmp, mp: ["run", scenario_file(tmp, **overrides)]


def _raw_toml(placeholder: str, text: str, **overrides):
    """A scenario whose TOML text has ``placeholder`` replaced by ``text`` (for values tomli_w cannot write)."""

    def setup(tmp, mp):
        path = scenario_file(tmp, **overrides)
        path.write_text(path.read_text().replace(placeholder, text))
        return ["run", path]

    return setup


def _with_profile(**changes):
    def setup(tmp, mp):
        profile(tmp, **changes)
        return ["run", scenario_file(tmp, fleet={"my_board": 2}, device_dirs=["devices"])]

    return setup


def _factory(name, options=None):
    def setup(tmp, mp):
        user_models(tmp, mp)
        return ["run", scenario_file(tmp, model={"name": name, "options": options or {}})]

    return setup


ATTENTION_MODEL = """
from torch import nn


class Attn(nn.Module):
    def __init__(self, num_classes, in_channels, input_size):
        super().__init__()
        self.embed = nn.Linear(in_channels * input_size * input_size, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        h = self.embed(x.flatten(1)).unsqueeze(1)
        return self.head(self.attn(h, h, h)[0].squeeze(1))


def net(num_classes, in_channels, input_size):
    return Attn(num_classes, in_channels, input_size)
"""


def _file_model(text: str, name: str = "attn_model.py:net"):
    """A model factory given as 'file.py:callable', the file beside the scenario (not on the path)."""

    def setup(tmp, mp):
        if text:
            (tmp / name.partition(":")[0]).write_text(text)
        return ["run", scenario_file(tmp, model={"name": name, "options": {}})]

    return setup


def _non_utf8(tmp, mp):
    path = tmp / "scn.toml"
    path.write_bytes(b'name = "caf\xe9"\n')
    return ["run", path]


def _non_utf8_profile(tmp, mp):
    (tmp / "devices").mkdir()
    (tmp / "devices" / "my_board.toml").write_bytes(b'name = "\xff\xfe"\n')
    return ["devices", "validate", tmp / "devices" / "my_board.toml"]


def _malicious_weights(tmp, mp):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp / 'pwned'}",))

    torch.save({"x": Evil()}, tmp / "evil.pt")
    return ["run", scenario_file(tmp, model={"name": "small_cnn", "options": {"width": 8}, "weights": str(tmp / "evil.pt")})]


def _nan_weights(tmp, mp):
    from fedelastic.models import build_model

    model = build_model("small_cnn", num_classes=10, in_channels=1, input_size=8, width=8)
    torch.save({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in model.state_dict().items()}, tmp / "nan.pt")
    return ["run", scenario_file(tmp, model={"name": "small_cnn", "options": {"width": 8}, "weights": str(tmp / "nan.pt")})]


def _existing_run_id(tmp, mp):
    path = scenario_file(tmp)
    (tmp / "runs" / "tiny" / "taken").mkdir(parents=True)
    (tmp / "runs" / "tiny" / "taken" / "config.toml").write_text("")  # a run's (an empty folder is taken again)
    return ["run", path, "--run-id", "taken"]


def _not_a_run(tmp, mp):
    (tmp / "notes.txt").write_text("x")  # a folder with files, none a run's (an empty one: see test_chaos)
    return ["run", "--resume", tmp]


def _output_is_file(tmp, mp):
    (tmp / "afile").write_text("x")
    return ["run", scenario_file(tmp, output_dir=str(tmp / "afile"))]


def _report_no_results(tmp, mp):
    (tmp / "empty").mkdir()
    return ["report", tmp / "empty"]


BAD = [
    Bad("alpha-inf", _raw_toml("12345.5", "inf", data={"alpha": 12345.5}), "data.alpha"),
    Bad("test-fraction-tiny", _scn(data={"test_fraction": 1e-9}), "data.test_fraction"),
    Bad("seed-negative", _scn(seed=-1), "seed"),
    Bad("seed-huge", _raw_toml("seed = 3", "seed = 1000000000000000000000000000000"), "seed"),
    Bad("dirichlet-2000-clients", _scn(fleet={"jetson_nano": 2000}), "data"),
    Bad("iid-2000-clients-empty", _scn(fleet={"jetson_nano": 2000}, data={"partitioner": "iid"}), "data"),
    Bad("classes-42", _scn(data={"classes": [42]}), "data.classes"),
    Bad("classes-negative", _scn(data={"classes": [-1]}), "data.classes"),
    Bad("classes-duplicate-and-missing", _scn(data={"classes": [1, 1, 99]}), "data.classes"),
    Bad("min-partition-size-huge", _scn(data={"min_partition_size": 1_000_000}), "data"),
    Bad("pretrain-batch-0", _scn(model={"name": "small_cnn", "pretrain": {"batch_size": 0}}), "model.pretrain.batch_size"),
    Bad("pretrain-classes-99", _scn(model={"name": "small_cnn", "pretrain": {"classes": [99], "epochs": 1}}), "model.pretrain.classes"),
    Bad("timeout-negative", _scn(simulation={"backend": "ray", "timeout_s": -1.0}), "simulation.timeout_s"),
    Bad("timeout-zero", _scn(simulation={"backend": "ray", "timeout_s": 0.0}), "simulation.timeout_s"),
    Bad("cpus-zero", _scn(simulation={"backend": "ray", "num_cpus_per_client": 0.0}), "simulation.num_cpus_per_client"),
    Bad("cpus-negative", _scn(simulation={"backend": "ray", "num_cpus_per_client": -1.0}), "simulation.num_cpus_per_client"),
    Bad("torch-threads-0", _scn(simulation={"torch_threads": 0}), "simulation.torch_threads"),
    Bad("momentum-negative", _scn(train={"momentum": -0.5}), "train.momentum"),
    Bad("weight-decay-nan", _raw_toml("12345.5", "nan", train={"weight_decay": 12345.5}), "train.weight_decay"),
    Bad("lr-inf", _raw_toml("12345.5", "inf", train={"lr": 12345.5}), "train.lr"),
    Bad("name-empty", _scn(name=""), "name"),
    Bad("name-traversal", _scn(name="../../x"), "name"),
    Bad("name-absolute", _scn(name="/tmp/x"), "name"),
    Bad("name-markup", _scn(name="exp[/b]"), "key 'name'"),
    Bad("key-markup", _scn(**{"[/oops]": 1}), "[/oops]"),
    Bad("device-dir-missing", _scn(device_dirs=["no_such_folder"]), "device_dirs[0]"),
    Bad("factory-not-a-model", _factory("os:getcwd"), "model.options"),
    Bad("factory-unknown-option", _factory("small_cnn", {"depth": 3}), "model.options"),
    Bad("factory-raises", _factory("faulty_models:raises"), "model.name"),
    Bad("factory-relative", _factory("..evil:f"), "model.name"),
    Bad("factory-empty-module", _factory(":f"), "model.name"),
    Bad("plugin-module-unknown", _factory("no_such_plugin.models:net"), "model.name"),
    Bad("model-multihead-attention-at-start", _file_model(ATTENTION_MODEL), "model.name"),
    Bad("model-file-missing", _file_model("", "no_such_file.py:net"), "model.name"),
    Bad("infeasible-error-at-start", _scn(train={"strategy": "elastic_tensor", "options": {"rho": 0.05, "infeasible": "error"}}), "train.options.rho"),
    Bad("scenario-missing", lambda tmp, mp: ["run", tmp / "nope.toml"], "<file>"),
    Bad("scenario-is-directory", lambda tmp, mp: ["run", tmp], "<file>"),
    Bad("scenario-non-utf8", _non_utf8, "<file>"),
    Bad("scenario-toml-syntax", _raw_toml("[train]", "[train"), "<toml>"),
    Bad("profile-non-utf8", _non_utf8_profile, "<file>", file="my_board.toml"),
    Bad("profile-directory", lambda tmp, mp: ["devices", "validate", tmp], "<file>", file=""),
    Bad("profile-memory-zero", _with_profile(**{"memory.train.value": 0}), "memory.train.value", file="my_board.toml"),
    Bad("profile-availability-150", _with_profile(**{"availability.probability": {"value": 150, "unit": "%", "source": "x"}}), "availability.probability.value", file="my_board.toml"),
    Bad("profile-peak-overflow", _with_profile(**{"compute.peak_fp32": {"value": 1e300, "unit": "TFLOP/s", "source": "x"}}), "compute.peak_fp32.value", file="my_board.toml"),
    Bad("profile-notes-number", _with_profile(notes=5), "notes", file="my_board.toml"),
    Bad("profile-measured-batch-bool", _with_profile(**{"measured.small_cnn": {"batch_size": True, "source": "x", "layers": {}}}), "measured.small_cnn.batch_size", file="my_board.toml"),
    Bad("profile-measured-layers-5", _with_profile(**{"measured.small_cnn": {"batch_size": 4, "source": "x", "layers": 5}}), "measured.small_cnn.layers", file="my_board.toml"),
    Bad("profile-measured-nan", _with_profile(**{"measured.small_cnn": {"batch_size": 4, "source": "x", "layers": {"features.0": {"fwd": float("nan"), "dx": 0.0, "dw": 0.0}}}}), "measured.small_cnn.layers.features.0", file="my_board.toml"),
    Bad("profile-unattributed-nan", _with_profile(**{"measured.small_cnn": {"batch_size": 4, "source": "x", "layers": {}, "unattributed_fwd": float("nan")}}), "measured.small_cnn.unattributed_fwd", file="my_board.toml"),
    Bad("profile-measured-unknown-layer", _with_profile(**{"measured.small_cnn": {"batch_size": 4, "source": "x", "layers": {"no.such.layer": {"fwd": 0.1, "dx": 0.1, "dw": 0.1}}}}), "measured.small_cnn.layers.no.such.layer", file="my_board.toml"),
    Bad("weights-malicious-pickle", _malicious_weights, "model.weights"),
    Bad("weights-all-nan", _nan_weights, "model.weights"),
    Bad("cli-rounds-negative", lambda tmp, mp: ["run", scenario_file(tmp), "--rounds", "-1"], "--rounds", file=""),
    Bad("cli-rounds-zero", lambda tmp, mp: ["run", scenario_file(tmp), "--rounds", "0"], "--rounds", file=""),
    Bad("cli-run-id-traversal", lambda tmp, mp: ["run", scenario_file(tmp), "--run-id", "../../../x"], "--run-id", file=""),
    Bad("cli-run-id-exists", _existing_run_id, "--resume", file=""),
    Bad("cli-report-missing", lambda tmp, mp: ["report", tmp / "nope"], "no such run folder", file=""),
    Bad("cli-report-no-results", _report_no_results, "no results", file=""),
    Bad("cli-resume-not-a-run", _not_a_run, "not a run folder", file=""),
    Bad("output-dir-is-file", _output_is_file, "output_dir"),
    Bad("output-dir-unwritable", _scn(output_dir="/sys/fedelastic-runs"), "output_dir"),
]


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_input_is_one_line_naming_file_and_key(case, tmp_path, monkeypatch, capsys):
    argv = case.setup(tmp_path, monkeypatch)
    code, out = run_cli(argv, capsys)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2, out
    assert len(errors) == 1 and "Traceback" not in out, out
    assert case.key in errors[0], errors[0]
    if case.file:
        assert (str(argv[1]) if case.file == "scenario" else case.file) in errors[0], errors[0]
    assert not (tmp_path / "pwned").exists()  # nothing ran
    assert not list((tmp_path / "runs").glob("*/*/rounds.csv"))  # nothing started


# -- faults during a run: recorded, honest status and exit code, nothing lost --------------------


@dataclass
class Fault:
    id: str
    overrides: dict
    exit: int
    status: str
    errors: dict = field(default_factory=dict)  # substring of an error -> how many rows carry it
    patch: str = ""  # a client-side fault injected with monkeypatch (in-process)


FAULTS = [
    # the client-side faults are one client's: on the per-client path (vectorize = "auto" would batch
    # the cohort, and one call's failure or overrun is then all its clients')
    Fault("client-exception", {"model": {"name": "faulty_models:net", "options": {"fault": "raise"}}, "simulation": {"vectorize": False}}, 3,
          "completed_with_errors", {"the device fell over": 1}),
    Fault("client-exception-per-client-node",
          {"model": {"name": "faulty_models:net", "options": {"fault": "raise"}}, "simulation": {"node_mode": "per_client"}},
          3, "completed_with_errors", {"the device fell over": 1}),
    Fault("client-exception-within-threshold",
          {"model": {"name": "faulty_models:net", "options": {"fault": "raise"}}, "simulation": {"max_failure_rate": 0.5, "vectorize": False}},
          0, "completed_with_errors", {"the device fell over": 1}),
    Fault("client-hangs-past-timeout",
          {"model": {"name": "faulty_models:net", "options": {"fault": "hang"}}, "simulation": {"timeout_s": 2.0, "vectorize": False}},
          3, "completed_with_errors", {"timeout": 1}),
    Fault("client-update-nan", {"simulation": {"vectorize": False}}, 3, "completed_with_errors", {"non-finite update": 2}, patch="nan"),
    Fault("global-model-nan", {}, 4, "diverged", {}, patch="global-nan"),
    # small_cnn at width 32 needs ~0.7 MB to train in full; an nRF52840 has 256 KiB
    Fault("selection-over-memory-every-client", {"fleet": {"nrf52840": 3}, "model": {"options": {"width": 32}}}, 3,
          "completed_with_errors"),
    Fault("selection-over-memory-allowed",
          {"fleet": {"nrf52840": 3}, "model": {"options": {"width": 32}}, "simulation": {"allow_empty_rounds": True}},
          0, "completed"),
    Fault("availability-zero", {"fleet": {"my_board": 2}, "device_dirs": ["devices"]}, 3, "completed_with_errors",
          patch="availability-0"),
]


def _inject(kind: str, monkeypatch) -> None:
    import numpy as np

    import fedelastic.fl.client as client
    import fedelastic.sim.aggregators as aggregators

    if kind == "nan":
        real = client.train_local

        def nan_for_partition_1(*args, seed, **kwargs):
            result = real(*args, seed=seed, **kwargs)
            if seed[2] == 1:
                result.trained = {k: np.full_like(v, np.nan) for k, v in result.trained.items()}
            return result

        monkeypatch.setattr(client, "train_local", nan_for_partition_1)
    if kind == "global-nan":
        real_agg = aggregators.aggregate_partial
        monkeypatch.setattr(aggregators, "aggregate_partial", lambda cur, ups: {k: v * np.nan for k, v in real_agg(cur, ups).items()})


@pytest.mark.parametrize("case", FAULTS, ids=[c.id for c in FAULTS])
def test_fault_is_recorded_with_honest_status(case, tmp_path, monkeypatch, capsys):
    user_models(tmp_path, monkeypatch)
    overrides = copy.deepcopy(case.overrides)
    if "fault" in overrides.get("model", {}).get("options", {}):
        overrides["model"]["options"]["marker"] = str(tmp_path / "marker")
    if case.patch == "availability-0":
        profile(tmp_path, availability={"probability": {"value": 0, "unit": "1", "source": "test"}})
    _inject(case.patch, monkeypatch)
    path = scenario_file(tmp_path, **overrides)
    code, out = run_cli(["run", path], capsys)
    run_dir = only_run_dir(tmp_path)
    status = read_status(run_dir)
    assert (code, status["status"]) == (case.exit, case.status), out
    rounds = pd.read_csv(run_dir / "rounds.csv")
    if case.status == "diverged":  # stopped after the round that diverged, which is on disk with its clients
        assert status["divergence"]["round"] == 1 and "norm is nan" in status["divergence"]["reason"]
        assert list(rounds["round"]) == [0, 1] and rounds["divergence"].fillna("").tolist()[0] == ""
        assert len(pd.read_csv(run_dir / "clients.csv")) == rounds["clients"].iloc[1]
        assert "diverged" in out
    elif case.status != "failed":
        assert list(rounds["round"]) == [0, 1, 2]  # every round on disk
        csv_path = run_dir / "clients.csv"
        clients = pd.read_csv(csv_path, dtype={"error": "string"}) if csv_path.exists() else pd.DataFrame()
        # nothing vanished: every sampled client of every round has a row (4 clients unless the fleet says otherwise)
        sampled = rounds["clients"].iloc[1:].sum()
        assert len(clients) == sampled
        errs = clients["error"].fillna("") if len(clients) else pd.Series(dtype=str)
        for text, n in case.errors.items():
            assert errs.str.contains(text).sum() == n, errs.tolist()
            assert all("\n" not in e and "\x1b" not in e for e in errs)  # one clean line per error
        failed_or_rejected = status["clients_failed"] + status["clients_rejected"]
        assert failed_or_rejected == (errs != "").sum() == (rounds["clients_failed"] + rounds["clients_rejected"]).sum()
        if case.errors:
            assert (run_dir / "errors.log").exists()
        if case.patch == "nan":  # a rejected update is its own status, not a failure
            assert status["clients_failed"] == 0 and status["clients_rejected"] == 2
        if case.id.startswith("client-exception"):  # the real traceback, down to the function that raised
            log = (run_dir / "errors.log").read_text()
            assert "Traceback (most recent call last)" in log and "in forward" in log, log
    else:
        assert "non-finite" in status["error"] and "\n" not in status["error"]
        assert list(rounds["round"]) == [0]  # the initial row stays
    assert (run_dir / "accuracy_vs_time.png").exists() or case.status == "failed"


def test_probe_over_memory_is_split_to_fit_the_device(tmp_path, capsys):
    """ElasticTrainer's full-model probe needs more than an nRF52840's 256 KiB at width 32: it runs in
    pieces that fit, the clients train, and each row reports a probe peak within its device."""
    path = scenario_file(tmp_path, fleet={"nrf52840": 2, "raspberry_pi_4": 1}, model={"options": {"width": 32}},
                         train={"strategy": "elastic_tensor"})  # fmt: skip
    code, out = run_cli(["run", path], capsys)
    run_dir = only_run_dir(tmp_path)
    clients = pd.read_csv(run_dir / "clients.csv")
    assert code == 0 and read_status(run_dir)["status"] == "completed", out
    assert len(clients) == 2 * 3 and clients.fits.all()
    assert (clients.emulated_probe_peak_memory_bytes <= clients.device_memory_bytes).all()
    assert (clients.emulated_peak_memory_bytes <= clients.device_memory_bytes).all()


# -- kill -9 of the driver, then resume: byte-identical tables ------------------------------------


def _table_text(run_dir: Path, name: str) -> str:
    frame = pd.read_csv(run_dir / f"{name}.csv")
    return frame.drop(columns=[c for c in frame.columns if c.startswith("host_")]).to_csv(index=False)


@pytest.mark.parametrize(
    "train",
    [
        {"strategy": "static_elastic", "max_steps": 3},
        # a re-selection interval carried across rounds: the checkpoint hands each client its state back
        {"strategy": "elastic_tensor", "options": {"rho": 0.8, "interval": 4, "interval_unit": "steps"}, "max_steps": 3},
    ],
    ids=["static_elastic", "elastic_interval"],
)
def test_kill_9_after_round_2_then_resume_gives_identical_tables(tmp_path, train):
    raw = small_scenario_dict(tmp_path, server={"rounds": 6}, train=train,
                              fleet={"raspberry_pi_4": 2, "jetson_nano": 1, "stm32h743": 1},
                              simulation={"write_every_s": 0})  # fmt: skip
    raw["model"]["name"] = "small_cnn"
    path = write_toml(tmp_path / "six.toml", raw)
    cli = [sys.executable, "-m", "fedelastic.cli", "run", str(path)]
    proc = subprocess.Popen([*cli, "--run-id", "killed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = tmp_path / "runs" / "tiny" / "killed"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (killed / "checkpoint.pt").exists() and read_status(killed).get("rounds_done", 0) >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    status = read_status(killed)
    assert status["status"] == "dead" and 2 <= status["rounds_done"] < 6, status
    _resume_and_compare(path, killed, tmp_path)


def test_kill_9_with_rounds_kept_for_a_later_write_then_resume_gives_identical_tables(tmp_path):
    """With ``write_every_s`` the rounds kept for a later write die with the process: the files and
    checkpoint on disk stop at the last write (here the first: round 0), and resuming trains the
    lost rounds again, to the same tables as an uninterrupted run."""
    raw = small_scenario_dict(tmp_path, server={"rounds": 12}, train={"strategy": "static_elastic", "max_steps": 3},
                              fleet={"raspberry_pi_4": 2, "jetson_nano": 1, "stm32h743": 1},
                              simulation={"write_every_s": 3600})  # fmt: skip
    raw["model"]["name"] = "small_cnn"
    path = write_toml(tmp_path / "twelve.toml", raw)
    cli = [sys.executable, "-m", "fedelastic.cli", "run", str(path), "--run-id", "killed"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each round's progress line as it is printed
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.split()[:2] == ["round", "3"]:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = tmp_path / "runs" / "tiny" / "killed"
    status = read_status(killed)
    assert status["status"] == "dead" and status["rounds_done"] == 0, status
    assert pd.read_csv(killed / "rounds.csv")["round"].tolist() == [0] and not (killed / "clients.csv").exists()
    assert torch.load(killed / "checkpoint.pt", weights_only=True)["round"] == 0
    _resume_and_compare(path, killed, tmp_path)


def _resume_and_compare(path: Path, killed: Path, tmp_path: Path) -> None:
    assert main(["run", "--resume", str(killed)]) == 0
    assert main(["run", str(path), "--run-id", "whole"]) == 0  # the same run, uninterrupted
    whole = tmp_path / "runs" / "tiny" / "whole"
    for name in ("clients", "rounds"):
        assert _table_text(killed, name) == _table_text(whole, name), name
        a = pd.read_parquet(killed / f"{name}.parquet").drop(columns="host_wall_s")
        pd.testing.assert_frame_equal(a, pd.read_parquet(whole / f"{name}.parquet").drop(columns="host_wall_s"))
    assert json.loads((killed / "status.json").read_text())["status"] == "completed"
    assert main(["run", "--resume", str(killed)]) == 2  # already finished: nothing to resume


def test_checkpoint_is_loaded_with_weights_only(tmp_path):
    """A checkpoint replaced by a malicious pickle is refused, and runs nothing."""
    from fedelastic.errors import FedelasticError
    from fedelastic.fl.checkpoint import load_checkpoint

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"round": 1, "model": Evil(), "server": {}, "client_states": {}}, tmp_path / "checkpoint.pt")
    with pytest.raises(FedelasticError, match="not a readable checkpoint"):
        load_checkpoint(tmp_path)
    assert not (tmp_path / "pwned").exists()


# -- Ray: a client process that dies, and one that hangs ------------------------------------------


@pytest.mark.ray
@pytest.mark.patched
def test_ray_dead_and_hung_clients_are_retried_or_timed_out_and_the_pool_recovers(tmp_path, monkeypatch, capsys):
    """A client process that dies (a forward that calls os._exit(1) once) and a hung client, in one Ray run.

    Round 1: the client whose process dies is retried on a fresh actor and trains; the hung one
    becomes a 'timeout' row and its actor is replaced. Later rounds train every sampled client.
    """
    user_models(tmp_path, monkeypatch)
    monkeypatch.setenv("FAULTY_HANG_S", "600")  # far past the timeout: the driver must not wait for it
    # run from a folder holding another fedelastic: Ray puts the cwd first on its workers' path,
    # yet they must run the driver's code
    (tmp_path / "fedelastic").mkdir()
    (tmp_path / "fedelastic" / "__init__.py").write_text("raise ImportError('a shadow copy of fedelastic was imported')")
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    path = scenario_file(
        tmp_path, fleet={"raspberry_pi_4": 6}, server={"rounds": 3},
        model={"name": "faulty_models:net", "options": {"fault": "exit,hang", "marker": str(marker)}},
        # the timeout counts from the worker's start (an event: its process replied), so a fresh
        # worker's start-up on a loaded machine is not taken for the hang; what is left within
        # timeout_s is a few seconds of CPU work per healthy client
        # the per-client path, whose timeout is per client (vectorize = "auto" would batch the cohort:
        # a hang there costs the cohort's budget, then its clients are retried one by one)
        simulation={"backend": "ray", "num_cpus_per_client": 1.0, "timeout_s": 40.0, "vectorize": False},
    )  # fmt: skip
    code, out = run_cli(["run", path], capsys)  # returns at all: the driver does not wait for the hung client
    run_dir = only_run_dir(tmp_path)
    assert Path(f"{marker}-exit").exists() and Path(f"{marker}-hang").exists()  # both faults struck
    clients = pd.read_csv(run_dir / "clients.csv", keep_default_na=False)
    status = read_status(run_dir)
    assert code == 3 and status["status"] == "completed_with_errors", out
    assert clients.groupby("round").size().tolist() == [6, 6, 6]  # no client vanished
    failed = clients[clients.error != ""]
    assert len(failed) == 1 and failed["round"].tolist() == [1] and failed.error.iloc[0].startswith("timeout")
    assert status["errors"] == {failed.error.iloc[0]: 1}
    assert clients[clients["round"] > 1].fits.all()  # later rounds: the full pool again


# -- disks, run ids, the report, a failed runtime, compare --resume ------------------------------


def test_full_disk_fails_the_run_in_one_line_and_csv_and_parquet_agree(tmp_path, monkeypatch, capsys):
    writes = {"rounds": 0}

    def third_rounds_write(name, rounds):  # the disk fills up while round 2's row is written
        writes[name] = writes.get(name, 0) + 1
        return name == "rounds" and writes["rounds"] == 3

    full_disk(monkeypatch, third_rounds_write)
    code, out = run_cli(["run", scenario_file(tmp_path, simulation={"write_every_s": 0})], capsys)
    run_dir = only_run_dir(tmp_path)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "No space left" in errors[0] and "Traceback" not in out
    assert read_status(run_dir)["status"] == "failed"
    for name in ("rounds", "clients"):  # the CSV and the Parquet file hold the same rows
        csv_rows, pq_rows = pd.read_csv(run_dir / f"{name}.csv"), pd.read_parquet(run_dir / f"{name}.parquet")
        assert csv_rows["round"].tolist() == pq_rows["round"].tolist()
    assert list(pd.read_csv(run_dir / "rounds.csv")["round"]) == [0, 1]  # every finished round kept
    assert not list(run_dir.glob("*.tmp"))


def test_table_append_is_all_or_nothing(tmp_path, monkeypatch):
    from fedelastic.results.recorder import _Table

    table = _Table(tmp_path, "t")
    table.append([{"a": 1, "b": "x"}])
    import pyarrow.parquet as pq  # what writes every part

    monkeypatch.setattr(pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    with pytest.raises(OSError):
        table.append([{"a": 2, "b": "y"}])
    assert (tmp_path / "t.csv").read_text().splitlines() == ["a,b", "1,x"] and len(table.rows) == 1
    assert not (tmp_path / "t.parquet.tmp").exists()


def test_run_ids_are_unique_when_many_start_in_one_second(make_scenario):
    from fedelastic.fl.runner import new_run_dir

    sc = make_scenario()
    folders = [new_run_dir(sc) for _ in range(25)]
    assert len({f.name for f in folders}) == 25 and all(f.is_dir() for f in folders)
    assert all(f.parent == Path(sc.output_dir) / sc.name for f in folders)


def test_report_draws_empty_and_non_finite_runs(tmp_path):
    from fedelastic.results.recorder import plot_accuracy

    rounds = pd.DataFrame({"round": [0, 1], "sim_time_s": [0.0, float("inf")], "test_accuracy": [0.1, 0.2]})
    clients = pd.DataFrame({"device": ["a", "b"], "device_class": ["mcu", "mcu"], "emulated_train_time_s": [float("nan"), float("inf")]})
    for i, (r, c) in enumerate([(rounds, clients), (rounds.iloc[:0], pd.DataFrame()), (rounds, clients.iloc[:0])]):
        plot_accuracy(r, c, tmp_path / f"{i}.png")
        assert (tmp_path / f"{i}.png").stat().st_size > 0


def test_a_stopped_runtime_ends_the_server_wait_at_once():
    import threading

    from fedelastic.fl.grids import GuardedGrid, RunAborted

    class SilentGrid:  # a runtime that never delivers anything
        def push_messages(self, messages):
            return ["m1"]

        def pull_messages(self, ids):
            return []

        def get_node_ids(self):
            return []

    stop = threading.Event()
    grid = GuardedGrid(SilentGrid(), stop)
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(RunAborted):
        grid.send_and_receive([object()], timeout=3600)  # returns when the runtime stops, not in an hour
    with pytest.raises(RunAborted):
        grid.get_node_ids()


def test_compare_resume_skips_finished_cells_and_resumes_a_killed_one(tmp_path, capsys):
    raw = small_scenario_dict(tmp_path, server={"rounds": 2})
    raw["compare"] = {"strategies": ["full", "last_layer", "static_elastic"]}
    path = write_toml(tmp_path / "cmp.toml", raw)
    assert main(["compare", str(path), "--output", str(tmp_path / "cmp")]) == 0
    out = tmp_path / "cmp"
    cells = sorted((out / "runs").glob("*/s3"))
    assert len(cells) == 3
    whole = {c.parent.name: _table_text(c, "clients") for c in cells}
    # interrupt: cell 2 was killed after round 1 (status 'running' of a dead process), cell 3 never started
    killed, missing = cells[1], cells[2]
    import shutil

    shutil.rmtree(missing)
    status = json.loads((killed / "status.json").read_text())
    (killed / "status.json").write_text(json.dumps({**status, "status": "running", "pid": 2**22 + 12345}))
    finished_before = (cells[0] / "clients.csv").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["compare", str(path), "--resume", str(out)]) == 0
    log = capsys.readouterr().out
    assert "finished earlier" in log and "resuming" in log
    assert (cells[0] / "clients.csv").stat().st_mtime_ns == finished_before  # not run again
    assert {c.parent.name: _table_text(c, "clients") for c in sorted((out / "runs").glob("*/s3"))} == whole
    assert len(pd.read_csv(out / "summary.csv")) == 3
