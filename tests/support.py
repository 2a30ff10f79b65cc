"""Plain helpers the tests share: a small scenario, scenario files, run folders and their tables.

Fixtures live in ``tests/conftest.py``; everything here is an ordinary function or constant, imported
as ``from tests.support import ...``. No test module imports another test module.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]  # the repository: pyproject.toml, simulations/, benchmarks/


def small_scenario_dict(tmp_path: Path, **overrides) -> dict:
    """A four-client, two-round in-process scenario writing under ``tmp_path``; a dict override
    updates that section, any other value replaces it."""
    raw = {
        "name": "tiny",
        "seed": 3,
        "output_dir": str(tmp_path / "runs"),
        "fleet": {"raspberry_pi_4": 2, "jetson_nano": 1, "stm32h743": 1},
        "data": {"partitioner": "dirichlet", "alpha": 0.5},
        "model": {"name": "small_cnn", "options": {"width": 8}},
        "train": {"strategy": "full", "batch_size": 16, "max_steps": 3},
        "server": {"rounds": 2},
        "simulation": {"backend": "inprocess"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


# a continual stream for ``small_scenario_dict``: two tasks of five classes, a rotated domain
SMALL_STREAM = {
    "tasks": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]],
    "task_rounds": 2,
    "domains": [{}, {"rotation": 90}],
    "domain_rounds": 3,
    "onset_jitter": 1,
    "samples_per_round": 16,
    "buffer_size": 32,
    "eval_samples": 60,
}


def load_script(path: Path, name: str):
    """A benchmark script (not a package module) imported by its path, under ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_toml(path: Path, raw: dict) -> Path:
    path.write_text(tomli_w.dumps(raw))
    return path


def scenario_file(tmp: Path, **overrides) -> Path:
    """``small_scenario_dict`` written to ``tmp/scn.toml``; a ``fleet`` override replaces the fleet."""
    raw = small_scenario_dict(tmp, **overrides)
    if "fleet" in overrides:
        raw["fleet"] = overrides["fleet"]  # the fleet is replaced, not merged
    return write_toml(tmp / "scn.toml", raw)


def run_cli(argv: list, capsys) -> tuple[int, str]:
    """The command line's exit code and everything it printed (stdout, then stderr)."""
    from fedelastic.cli import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def only_run_dir(tmp: Path) -> Path:
    """The one run folder under ``tmp/runs`` (asserts there is exactly one)."""
    runs = [p for p in (tmp / "runs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


USER_MODELS = """
import os, time
from pathlib import Path
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels, input_size, fault="", marker=""):
        super().__init__()
        self.fault, self.marker = fault, marker
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size**2, 12), nn.ReLU(),
                                  nn.Linear(12, num_classes))

    def forward(self, x):
        for fault in self.fault.split(",") if self.training and self.fault else ():
            marker = Path(f"{self.marker}-{fault}")
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # each fault strikes once, in one call
            except FileExistsError:
                continue
            os.close(fd)
            if fault == "exit":
                os._exit(1)
            if fault == "hang":
                time.sleep(float(os.environ.get("FAULTY_HANG_S", "6")))
            if fault == "raise":
                raise RuntimeError("the device fell over")
        return self.body(x)


def net(num_classes, in_channels, input_size, fault="", marker=""):
    return Net(num_classes, in_channels, input_size, fault, marker)


def raises(num_classes, in_channels, input_size):
    raise RuntimeError("factory broke")
"""


def user_models(tmp: Path, monkeypatch) -> None:
    """Make ``faulty_models`` (USER_MODELS: a model that exits, hangs or raises on request, and a
    factory that raises) importable here and in the processes a run starts."""
    (tmp / "faulty_models.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp))
    monkeypatch.setenv("PYTHONPATH", str(tmp) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def full_disk(monkeypatch, when: Callable[[str, list[int]], bool]) -> None:
    """The disk fills up while a results part is written: for a part of table ``name`` (clients,
    rounds, tasks) holding rows of the rounds listed, ``when(name, rounds)`` says whether it fails
    with ENOSPC.

    The fault comes from pyarrow's ``parquet.write_table``, which writes every part of a results
    table, so the writer's own recovery runs as on a real full disk (the temporary part removed, the
    CSV cut back). A full disk cannot be made on demand for a test (root writes past permissions).
    """
    import pyarrow.parquet as pq

    real = pq.write_table

    def write_table(table, where, *args, **kwargs):
        if isinstance(where, (str, os.PathLike)):  # a file; pandas' in-memory writes pass through
            name = Path(where).parent.name.removesuffix(".parquet")
            rounds = table.column("round").to_pylist() if "round" in table.column_names else []
            if when(name, rounds):
                raise OSError(errno.ENOSPC, "No space left on device", str(where))
        return real(table, where, *args, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_table)


def frames(run_dir: Path):
    """A run's client and round tables without the host wall times (which differ between runs)."""
    import pandas as pd

    clients = pd.read_parquet(run_dir / "clients.parquet").drop(columns=["host_wall_s"])
    rounds = pd.read_parquet(run_dir / "rounds.parquet").drop(columns=["host_wall_s"])
    return clients, rounds


def tables_and_model(run_dir: Path):
    """``frames`` and a checksum of the final global model (from the run's checkpoint)."""
    import torch

    clients, rounds = frames(run_dir)
    model = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    digest = hashlib.sha256()
    for name in sorted(model):
        digest.update(name.encode() + model[name].numpy().tobytes())
    return clients, rounds, digest.hexdigest()


def assert_same_run(a, b) -> None:
    """Two ``tables_and_model`` results are equal: every value exactly, and the same final model."""
    import pandas as pd

    pd.testing.assert_frame_equal(a[0], b[0], check_exact=True)
    pd.testing.assert_frame_equal(a[1], b[1], check_exact=True)
    assert a[2] == b[2]


def processes_with(env_entry: bytes) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds ``env_entry`` (Ray's and
    Flower's processes inherit the driver's environment); empty where there is no /proc."""
    found = {}
    for proc in Path("/proc").iterdir() if Path("/proc/self/environ").exists() else ():
        try:
            if proc.name.isdigit() and env_entry in (proc / "environ").read_bytes().split(b"\0"):
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie has exited
                    found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def small_info(width: int = 4):
    """The described ``small_cnn`` of the given width on 8x8 one-channel inputs."""
    import torch

    from fedelastic.modelinfo import describe
    from fedelastic.models.small import small_cnn

    return describe(small_cnn(width=width), torch.zeros(1, 1, 8, 8), model_name="small_cnn")
