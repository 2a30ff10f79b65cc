"""fedelastic as a Flower App: ``flwr run .`` runs a scenario on a Flower federation.

``pyproject.toml`` names :data:`server_app` and :data:`client_app`. Both read the scenario from
the run config (``[tool.flwr.app.config]``, changed with ``flwr run --run-config``):

* ``scenario``: the scenario file; a relative path is taken from the app's folder (the folder
  of ``pyproject.toml``, which Flower ships to the federation inside the app bundle);
* every other key is a dotted scenario key (``server.rounds``, ``train.lr``) whose value
  replaces the file's, validated like the file itself; an empty string keeps the file's value.

The ServerApp runs the scenario on its grid along the path ``fedelastic run`` takes
(:func:`fedelastic.orchestrate.run`) and owns the run's Recorder: the run folder is written as
``fedelastic run`` writes it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from .api import load
from .errors import ConfigError
from .scenario import Scenario
from .sim.columns import RoundCol

# The folder this package sits in: the app's folder when Flower loads the app from its bundle
# (Flower puts that folder first on sys.path in the ServerApp process and every ClientApp actor).
APP_DIR = Path(__file__).resolve().parent.parent
SRC = "<run config>"


def scenario_from_run_config(
    run_config: Mapping[str, Any], app_dir: Path = APP_DIR, *, resolve: bool = True
) -> Scenario:
    """The scenario a run config names, with its other keys applied as dotted overrides
    (``resolve=False``: type-checked only, see :func:`~fedelastic.api.load`)."""
    config = dict(run_config)
    path = config.pop("scenario", "")
    if not isinstance(path, str) or not path:
        raise ConfigError(SRC, "scenario", "the path of a scenario file", path)
    file = Path(path) if Path(path).is_absolute() else app_dir / path
    return load(file, {key: value for key, value in config.items() if value != ""}, resolve=resolve)


def _log_round(row: dict) -> None:
    """One INFO line per round on Flower's logger, which ``flwr run --stream`` shows.

    The run keeps Flower's own INFO lines off (``runner._flwr_quiet`` sets the ``flwr`` logger to
    WARNING), so this record goes straight to the logger's handlers, past its level.
    """
    accuracy = row[RoundCol.TEST_ACCURACY]
    shown = "-" if accuracy != accuracy else f"{accuracy:.4f}"  # NaN: not evaluated (server.evaluate_every)
    logger = logging.getLogger("flwr")
    args = (row[RoundCol.ROUND], shown, row[RoundCol.SIM_TIME_S], row[RoundCol.TOTAL_ENERGY_J])
    text = "[fedelastic] round %d: test accuracy %s, simulated time %.1f s, energy %.1f J"
    logger.handle(logger.makeRecord(logger.name, INFO, __file__, 0, text, args, None))


def check_federation_size(grid: Grid, scenario: Scenario, settle_s: float = 2.0) -> None:
    """Fail fast when a simulated federation has fewer SuperNodes than the scenario has clients.

    A simulation registers all its nodes at once, so once some are there and the count has
    settled, a shortfall is final (otherwise the server would wait ``simulation.timeout_s``).
    Deployed federations, whose nodes join over time, are not checked.
    """
    from flwr.superlink.grid import InMemoryGrid

    if not isinstance(grid, InMemoryGrid):
        return
    deadline = time.monotonic() + scenario.simulation.timeout_s
    while not list(grid.get_node_ids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(settle_s)
    have = len(list(grid.get_node_ids()))
    if have < scenario.num_clients:
        raise ValueError(
            f"scenario {scenario.name!r} has {scenario.num_clients} clients but the federation has {have} "
            f"SuperNodes: run with --federation-config 'num-supernodes={scenario.num_clients}'"
        )


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    from . import orchestrate

    scenario = scenario_from_run_config(context.run_config, resolve=False)  # the run validates it, after its folder checks
    run_dir = orchestrate.run(
        scenario, progress=_log_round, grid=grid, on_start=lambda valid: check_federation_size(grid, valid)
    )
    try:  # the figure `fedelastic run` writes; a failure here must not hide the finished run
        from .results.summary import write_figures

        write_figures(run_dir)
    except Exception as exc:  # noqa: BLE001
        log(WARNING, "[fedelastic] the figure failed (%s: %s)", type(exc).__name__, exc)
    log(INFO, "[fedelastic] results in %s", run_dir.resolve())
    pid = superlink_pid()
    if pid is not None:  # Flower's local SuperLink outlives `flwr run`: say which process it is
        (run_dir / "superlink.pid").write_text(f"{pid}\n")
        log(INFO, "[fedelastic] the local SuperLink keeps running as process %d: stop it with `kill %d`", pid, pid)


def superlink_pid(levels: int = 4) -> int | None:
    """The PID of the ``flower-superlink`` this ServerApp runs under (an ancestor process, within
    ``levels``), or None (none there, or no ``/proc`` to tell)."""
    pid = os.getpid()
    for _ in range(levels):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            return None
        if any(Path(os.fsdecode(a)).name == "flower-superlink" for a in argv[:2]):
            return pid
        if pid <= 1:
            return None
    return None


_CLIENTS: dict[str, ClientApp] = {}


def _client(context: Context) -> ClientApp:
    """The scenario's ClientApp, built once per process and run config."""
    key = repr(sorted(context.run_config.items()))
    if key not in _CLIENTS:
        from .fl.clientapp import make_client_app

        _CLIENTS.clear()
        _CLIENTS[key] = make_client_app(scenario_from_run_config(context.run_config))
    return _CLIENTS[key]


client_app = ClientApp()


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    return _client(context)(msg, context)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    return _client(context)(msg, context)
