"""Bad input the fault matrix missed: each exits 2 with one line naming the file or key and what
was expected, before a run folder exists (or, in Python, raises ConfigError)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from fedelastic.cli import main
from fedelastic.errors import ConfigError
from tests.support import small_scenario_dict


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "cache"))


def _run(tmp: Path, capsys, fleet: int = 3, **data) -> tuple[int, str]:
    raw = small_scenario_dict(tmp, data={"partitioner": "iid", **data}, model={"name": "small_cnn", "options": {}})
    raw["fleet"] = {"raspberry_pi_4": fleet}
    path = tmp / "scn.toml"
    path.write_text(tomli_w.dumps(raw))
    code = main(["run", str(path)])
    out = capsys.readouterr()
    return code, out.err


def _assert_refused(tmp: Path, code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    assert not (tmp / "runs").exists() or not any((tmp / "runs").rglob("status.json")), "a run folder was made"


def _pngs(folder: Path, sizes: list[int]) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i, size in enumerate(sizes):
        sub = folder / f"class_{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(sub / f"{i}.png")


def _npz(path: Path, images: int, labels: int) -> None:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 256, (images, 8, 8), dtype=np.uint8), y=rng.integers(0, 2, labels))


def test_empty_dataset_folder(tmp_path, capsys):
    pytest.importorskip("datasets")
    (tmp_path / "empty").mkdir()
    code, err = _run(tmp_path, capsys, dataset=str(tmp_path / "empty"))
    _assert_refused(tmp_path, code, err, "data.dataset", str(tmp_path / "empty"))


def test_unreadable_pngs(tmp_path, capsys):
    pytest.importorskip("datasets")
    for i in range(6):
        sub = tmp_path / "tree" / f"class_{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i}.png").write_bytes(b"not a png at all")
    code, err = _run(tmp_path, capsys, dataset=str(tmp_path / "tree"))
    _assert_refused(tmp_path, code, err, "data.dataset", str(tmp_path / "tree"))


def test_mixed_image_sizes_without_image_size(tmp_path, capsys):
    pytest.importorskip("datasets")
    _pngs(tmp_path / "tree", [8, 16] * 10)
    code, err = _run(tmp_path, capsys, dataset=str(tmp_path / "tree"))
    _assert_refused(tmp_path, code, err, "data.image_size", str(tmp_path / "tree"))


def test_an_npz_that_is_not_a_zip(tmp_path, capsys):
    (tmp_path / "bad.npz").write_bytes(b"this is not a zip file")
    code, err = _run(tmp_path, capsys, dataset=str(tmp_path / "bad.npz"))
    _assert_refused(tmp_path, code, err, "data.dataset", str(tmp_path / "bad.npz"))


def test_an_npz_of_3_images_for_3_clients(tmp_path, capsys):
    _npz(tmp_path / "three.npz", 3, 3)
    code, err = _run(tmp_path, capsys, dataset=str(tmp_path / "three.npz"))
    _assert_refused(tmp_path, code, err, "three.npz" if "test_fraction" in err else "'data'")


def test_an_npz_with_more_images_than_labels(tmp_path, capsys):
    _npz(tmp_path / "short.npz", 100, 90)
    code, err = _run(tmp_path, capsys, dataset=str(tmp_path / "short.npz"))
    _assert_refused(tmp_path, code, err, "data.label_column", "100 images", "90 labels", str(tmp_path / "short.npz"))


@pytest.mark.parametrize("dataset", ["", "  "])
def test_an_empty_dataset_name(tmp_path, capsys, dataset):
    code, err = _run(tmp_path, capsys, dataset=dataset)
    _assert_refused(tmp_path, code, err, "data.dataset")


# -- the Python API: a wrong type is a ConfigError, not an AttributeError or TypeError ------------


def test_an_override_key_that_is_not_a_string(tmp_path):
    import fedelastic as fe

    with pytest.raises(ConfigError, match="a dotted scenario key"):
        fe.load(small_scenario_dict(tmp_path), overrides={1: 2})
    with pytest.raises(ConfigError, match="overrides"):
        fe.load(small_scenario_dict(tmp_path), overrides=["train.lr=1"])


def test_a_scenario_given_as_bytes(tmp_path):
    import fedelastic as fe

    with pytest.raises(ConfigError, match="a Scenario, a TOML file path or a dict"):
        fe.run(b'name = "x"')
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("thing", [42, "full", object])
def test_registering_what_is_not_a_strategy_class(thing):
    import fedelastic as fe
    from fedelastic.selection.strategy import REGISTRY

    before = dict(REGISTRY)
    with pytest.raises(ConfigError, match="SelectionStrategy"):
        fe.register_strategy(thing)
    assert REGISTRY == before


def test_a_strategy_class_without_a_name():
    import fedelastic as fe
    from fedelastic.selection.strategy import SelectionStrategy

    class Nameless(SelectionStrategy):
        name = ""

    with pytest.raises(ConfigError, match="Nameless.name"):
        fe.register_strategy(Nameless)


# -- other values ----------------------------------------------------------------------------------


def test_an_absurd_number_of_rounds_is_refused(tmp_path, capsys):
    raw = small_scenario_dict(tmp_path, server={"rounds": 10**15})
    path = tmp_path / "scn.toml"
    path.write_text(tomli_w.dumps(raw))
    code = main(["run", str(path)])
    _assert_refused(tmp_path, code, capsys.readouterr().err, "server.rounds", "1,000,000")
    assert main(["run", str(path), "--rounds", str(10**7)]) == 2


@pytest.mark.parametrize("field, value", [("heartbeat", "soon"), ("status", 3), ("rounds_done", "two")])
def test_report_of_a_malformed_status_file(tmp_path, capsys, field, value):
    from fedelastic.results.recorder import read_status

    folder = tmp_path / "run"
    folder.mkdir()
    doc = {"status": "running", "pid": 1, "host": "h", "heartbeat": 1.0, "rounds_done": 0, field: value}
    (folder / "status.json").write_text(json.dumps(doc))
    assert read_status(folder)["status"] == "unreadable"
    assert main(["report", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"key '{field}'" in err and "status.json" in err and len(err.strip().splitlines()) == 1, err


# -- errors that named the wrong key ---------------------------------------------------------------


def _scenario_error(tmp: Path, capsys, raw: dict, *argv: str) -> str:
    path = tmp / "scn.toml"
    path.write_text(tomli_w.dumps(raw))
    code = main(["run", str(path), *argv])
    err = capsys.readouterr().err
    _assert_refused(tmp, code, err)
    return err


@pytest.mark.parametrize("section, key", [("availability", "availability.trace"), ("network", "network.trace")])
@pytest.mark.parametrize("trace", ["missing.csv", "trace.txt"])
def test_a_trace_file_names_its_scenario_key(tmp_path, capsys, section, key, trace):
    (tmp_path / "trace.txt").write_text("client_id,start_s,end_s\n")
    raw = small_scenario_dict(tmp_path, **{section: {"model": "trace", "trace": trace}})
    err = _scenario_error(tmp_path, capsys, raw)
    assert f"key '{key}'" in err and trace in err and "scn.toml" in err, err


def test_a_missing_fleet_profile_file_names_the_fleet_key(tmp_path, capsys):
    raw = small_scenario_dict(tmp_path)
    raw["fleet"] = {str(tmp_path / "nowhere.toml"): 2}
    err = _scenario_error(tmp_path, capsys, raw)
    assert f"key 'fleet.{tmp_path / 'nowhere.toml'}'" in err and "scn.toml" in err, err


def test_a_negative_width_names_model_options(tmp_path, capsys):
    raw = small_scenario_dict(tmp_path, model={"name": "small_cnn", "options": {"width": -3}})
    err = _scenario_error(tmp_path, capsys, raw)
    assert "key 'model.options'" in err and "-3" in err, err


def test_a_model_without_parameters_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "empty_model.py").write_text(
        "from torch import nn\n\ndef f(num_classes, in_channels, input_size):\n    return nn.Flatten()\n"
    )
    raw = small_scenario_dict(tmp_path, model={"name": str(tmp_path / "empty_model.py") + ":f", "options": {}})
    err = _scenario_error(tmp_path, capsys, raw)
    assert "key 'model.name'" in err and "parameters" in err, err


def test_a_bad_compare_fleet_names_its_compare_key(tmp_path, capsys):
    raw = small_scenario_dict(tmp_path, server={"rounds": 1})
    raw["compare"] = {"fleets": {"small": {"raspberry_pi_4": 2}, "odd": {"no_such_board": 2}}}
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(raw))
    assert main(["compare", str(path)]) == 2
    err = capsys.readouterr().err
    assert "key 'compare.fleets.odd.no_such_board'" in err, err


# -- names, model files that exit, strategies that take a built-in's name ----------------------------


@pytest.mark.parametrize(
    "name", ["\u001b[31mred\u001b]0;pwn\u0007", "two\nlines", "x" * 5000], ids=["terminal_escape", "newline", "5000_chars"]
)
def test_a_name_must_be_plain_printable_text(tmp_path, capsys, name):
    raw = small_scenario_dict(tmp_path, name=name)
    err = _scenario_error(tmp_path, capsys, raw)
    assert "key 'name'" in err and "printable text" in err and "\u001b" not in err, err


@pytest.mark.parametrize("run_id", ["two\nlines", "\u001b]0;pwn\u0007", "y" * 300])
def test_a_run_id_must_be_plain_printable_text(tmp_path, capsys, run_id):
    err = _scenario_error(tmp_path, capsys, small_scenario_dict(tmp_path), "--run-id", run_id)
    assert "key '--run-id'" in err and "\u001b" not in err, err


def test_a_model_file_that_calls_sys_exit_is_refused(tmp_path, capsys):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    raw = small_scenario_dict(tmp_path, model={"name": str(tmp_path / "exits.py") + ":f", "options": {}})
    err = _scenario_error(tmp_path, capsys, raw)
    assert "key 'model.name'" in err and "SystemExit" in err, err


def test_a_strategy_cannot_take_a_built_in_name_before_the_built_ins_load():
    import subprocess
    import sys

    code = (
        "import fedelastic as fe\n"
        "from fedelastic.errors import ConfigError\n"
        "from fedelastic.selection.strategy import SelectionStrategy, available\n"
        "class Mine(SelectionStrategy):\n"
        "    name = 'full'\n"
        "try:\n"
        "    fe.register_strategy(Mine)\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
        "print('full' in available(), 'elastic_tensor' in available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("refused:") and "Mine.name" in lines[0] and lines[1] == "True True", out.stdout


# -- profile import-trace ------------------------------------------------------------------------------


def _import_trace(tmp: Path, capsys, trace: Path, *extra: str) -> str:
    code = main(["profile", "import-trace", str(trace), "--model", "small_cnn", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]  # progress lines aside
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _steps_only() -> list[dict]:
    """A trace with two step regions and no layer region."""
    return [{"name": "fedelastic::step", "ph": "X", "ts": 1000.0 * i, "dur": 900.0, "cat": "user_annotation"} for i in range(2)]


def test_a_corrupt_gzip_trace(tmp_path, capsys):
    import gzip

    good = gzip.compress(json.dumps({"traceEvents": _steps_only()}).encode())
    (tmp_path / "corrupt.json.gz").write_bytes(good[:10] + bytes(b ^ 0xFF for b in good[10:]))
    (tmp_path / "cut.json.gz").write_bytes(good[: len(good) // 2])
    for name in ("corrupt.json.gz", "cut.json.gz"):
        line = _import_trace(tmp_path, capsys, tmp_path / name)
        assert str(tmp_path / name) in line and "not a readable Chrome trace" in line, line


def test_a_trace_that_is_a_list_of_numbers(tmp_path, capsys):
    (tmp_path / "numbers.json").write_text("[1, 2, 3]")
    line = _import_trace(tmp_path, capsys, tmp_path / "numbers.json")
    assert str(tmp_path / "numbers.json") in line and "JSON objects" in line, line


def test_a_trace_without_layer_regions_writes_nothing(tmp_path, capsys):
    from fedelastic.devices.profile import builtin_profile_dir

    (tmp_path / "steps.json").write_text(json.dumps({"traceEvents": _steps_only()}))
    board = tmp_path / "my_board.toml"
    board.write_text((builtin_profile_dir() / "jetson_nano.toml").read_text().replace('name = "jetson_nano"', 'name = "my_board"'))
    before = board.read_text()
    line = _import_trace(tmp_path, capsys, tmp_path / "steps.json", "--profile", str(board))
    assert "no layer regions" in line, line
    assert board.read_text() == before


def test_a_malformed_target_profile_is_named(tmp_path, capsys):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from fedelastic.models import build_model

    model = build_model("small_cnn", num_classes=10, in_channels=1, input_size=8)
    names = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("fedelastic::step"):
                for n in names:
                    with record_function(f"fedelastic::{n}::fwd"):
                        torch.ones(2).sum()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    (tmp_path / "bad.toml").write_text("name = [unclosed\n")
    line = _import_trace(tmp_path, capsys, tmp_path / "trace.json", "--profile", str(tmp_path / "bad.toml"))
    assert str(tmp_path / "bad.toml") in line, line


def test_an_npz_whose_images_hold_nan_is_bad_data_refused_before_the_run(tmp_path, capsys):
    """One image in three NaN: before, it ran and ended 'diverged' (exit 4); now exit 2, naming the
    file and how many values."""
    x = np.random.default_rng(0).random((60, 8, 8)).astype(np.float32)
    x[::3, 2, 5] = np.nan
    x[1, 0, 0] = np.inf
    np.savez(tmp_path / "nan.npz", image=x, label=np.arange(60) % 3)
    code, err = _run(tmp_path, capsys, dataset="nan.npz")
    _assert_refused(tmp_path, code, err, "key 'data.dataset'", "nan.npz", "21 NaN/inf values in 21 of 60 images")


@pytest.fixture
def _datasets():
    """Leaves the dataset registry as it found it."""
    from fedelastic.data import DATASETS

    before = dict(DATASETS)
    yield
    DATASETS.clear()
    DATASETS.update(before)


def test_a_registered_dataset_with_nan_images_is_refused(tmp_path, _datasets):
    import fedelastic as fe

    x = np.zeros((30, 1, 8, 8), dtype=np.float32)
    x[4, 0, 1, 1] = np.nan
    fe.register_dataset("nan_blobs", lambda: (x, np.arange(30) % 3))
    path = tmp_path / "scn.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, data={"dataset": "nan_blobs", "partitioner": "iid"})))
    with pytest.raises(ConfigError, match=r"key 'data.dataset'.*1 NaN/inf values in 1 of 30 images"):
        fe.run(path)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("callbacks", [[42], 42, "stop"])
def test_a_callback_that_is_not_one_is_a_config_error(tmp_path, callbacks):
    import fedelastic as fe

    path = tmp_path / "scn.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path)))
    with pytest.raises(ConfigError, match="key 'callbacks'"):
        fe.run(path, callbacks=callbacks)
    assert not (tmp_path / "runs").exists()


def test_a_scenario_file_cannot_set_source(tmp_path, capsys):
    """``source`` moves the base relative paths resolve against: the loader sets it, a file may not
    (it was silently dropped, and the run went on)."""
    raw = small_scenario_dict(tmp_path)
    raw["source"] = "/etc/passwd"
    path = tmp_path / "scn.toml"
    path.write_text(tomli_w.dumps(raw))
    code = main(["run", str(path)])
    _assert_refused(tmp_path, code, capsys.readouterr().err, "scn.toml", "key 'source'", "[recorded] source")
    import fedelastic as fe

    with pytest.raises(ConfigError, match="key 'source'"):
        fe.load({**small_scenario_dict(tmp_path), "source": "/etc/passwd"})
@pytest.mark.parametrize("name", ["./my_data.npz", "my_data.npz", "../data/set", "/no/such/folder"])
def test_a_missing_local_copy_is_refused_at_once_not_looked_up_on_the_hub(tmp_path, capsys, monkeypatch, name):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the Hugging Face Hub was asked for a local path")

    monkeypatch.setattr(socket, "create_connection", no_network)
    code, err = _run(tmp_path, capsys, dataset=name)
    _assert_refused(tmp_path, code, err, "data.dataset", "an existing file or folder", "does not exist")
