"""Run a scenario: Flower's simulation on the Ray backend, or the same apps called in-process.

``backend = "ray"`` is the real runtime (``flwr.simulation.run_simulation``). ``"inprocess"``
drives the same ClientApp and server round loop through a minimal :class:`InProcessGrid`, for
tests and for measuring Flower/Ray's own overhead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch
from flwr.serverapp import Grid

from ..config import read_toml
from ..environment import RunEnvironment, environment
from ..errors import ConfigError, FedelasticError, RunFailed, Terminated
from ..results.recorder import Recorder, one_line, read_status
from ..results.recorder import warm_up as warm_up_writer
from ..runtime import orphans
from ..runtime.lifecycle import start_ray_beside
from ..scenario import PLAIN_NAME, Scenario, is_plain_name, parse_scenario, recorded, recorded_source, validate
from ..train.pretrain import initial_state
from .checkpoint import CHECKPOINT, load_checkpoint
from .clientapp import make_client_app
from .cohort import CohortGrid, cohort_count
from .grids import GuardedGrid, InProcessGrid, RunAborted
from .server import server_main
from .untrained import warn_if_untrained_partial


def check_folder_name(value: str, src: str, key: str) -> str:
    """``value`` if it is one plain folder name (so results stay inside output_dir), else a ConfigError."""
    if not is_plain_name(value):
        raise ConfigError(src, key, PLAIN_NAME, value)
    return value


def _claim(folder: Path, output_dir: Path, src: str) -> Path:
    """Create ``folder`` (inside ``output_dir``); FileExistsError if it is taken."""
    if not folder.resolve().is_relative_to(output_dir.resolve()):
        raise ConfigError(src, "name", f"a run folder inside output_dir {str(output_dir)!r}", str(folder))
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir()
    except FileExistsError:
        if folder.is_dir():
            raise
        raise ConfigError(src, "output_dir", "a folder (a file is in the way)", str(folder.parent)) from None
    except OSError as exc:
        raise ConfigError(src, "output_dir", f"a folder fedelastic can write to ({exc.strerror})", str(output_dir)) from None
    return folder


def new_run_dir(scenario: Scenario, run_id: str | None = None) -> Path:
    """Create the run folder ``<output_dir>/<name>/<run_id>``.

    A default id is a timestamp to the millisecond plus the seed, made unique with a suffix if
    several runs start at once. An explicit id that exists is refused (``--resume`` continues it).
    """
    src = scenario.source or "<scenario>"
    output_dir = Path(scenario.output_dir)
    base = output_dir / check_folder_name(scenario.name, src, "name")
    if run_id is not None:
        folder = base / check_folder_name(run_id, "<command line>", "--run-id")
        try:
            return _claim(folder, output_dir, src)
        except FileExistsError:
            if folder.is_dir() and not any(folder.iterdir()):
                return folder  # a start killed before its folder was filled: it holds no run (Recorder fills it whole)
            raise FedelasticError(
                f"{folder}: a run with this id exists; continue it with `fedelastic run --resume {folder}` "
                "or choose another --run-id"
            ) from None
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{int(now * 1000) % 1000:03d}-s{scenario.seed}"
    for n in range(1, 10_000):
        try:
            return _claim(base / (stamp if n == 1 else f"{stamp}-{n}"), output_dir, src)
        except FileExistsError:
            continue
    raise FedelasticError(f"{base}: could not find a free run id for {stamp}")


def _require_budget(cost, config, strategy: str, src: str) -> None:
    """ConfigError (naming the scenario) when ``config.rho`` leaves no backward time on ``cost``'s device."""
    if cost.backward_budget_s(config.rho) <= 0:
        share = cost.forward_time_s / cost.full_step_time_s()
        raise ConfigError(
            src, "train.options.rho",
            f"more than the forward share {share:.3f} of a step on device {cost.device.name!r} "
            f"(strategy {strategy} with infeasible = \"error\": no backward time is left to train anything)",
            config.rho,
        )  # fmt: skip


def _preflight(scenario: Scenario, env: RunEnvironment) -> dict:
    """Everything that can be checked before a runtime starts (:func:`check_inputs`, then the
    starting weights); returns them."""
    check_inputs(scenario, env)
    src = scenario.source or "<scenario>"
    state = initial_state(env)
    for name, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            key = "model.weights" if scenario.model.weights else "model"
            raise ConfigError(src, key, f"starting weights with finite values (tensor {name!r} holds NaN/inf)")
    warn_if_untrained_partial(env, state)  # a partial strategy from random weights ends near chance: say so
    warm_up_writer()  # the results writer's first-use costs, at start-up rather than in round 1
    return state


def check_inputs(scenario: Scenario, env: RunEnvironment) -> None:
    """The checks of data, model, strategy and profiles (all but the starting weights), made before
    a new run's folder exists: bad input leaves nothing behind. Cached in ``env``: cheap the second time."""
    src = scenario.source or "<scenario>"
    labels = set(np.unique(env.split[0].y).tolist()) | set(np.unique(env.split[1].y).tolist())
    pre = scenario.model.pretrain
    for key, classes in (("data.classes", scenario.data.classes), ("model.pretrain.classes", pre.classes if pre else ())):
        if set(classes) - labels:
            raise ConfigError(src, key, f"labels of dataset {scenario.data.dataset!r} ({min(labels)}..{max(labels)})", list(classes))
    _ = env.data  # partitions (their size checks name the keys to change)
    try:
        _ = env.info  # the model, built and traced once: an unsupported layer stops here, not per client
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 (a user model's forward pass: any error is the model's)
        reason = one_line(f"{type(exc).__name__}: {exc}")
        raise ConfigError(src, "model.name", f"a model fedelastic can trace ({reason})", scenario.model.name) from None
    strategy = env.strategy()  # its options, checked once
    _ = env.training_path  # vectorize = true that cannot be vectorised stops the run here, naming the key
    config = getattr(strategy, "config", None)
    if getattr(config, "infeasible", None) == "error" and hasattr(config, "rho"):
        for device in scenario.fleet:  # 'infeasible = "error"' stops the run before any client starts
            _require_budget(env.cost(device), config, scenario.train.strategy, src)
    layers = {layer.name for layer in env.info.layers}
    for device in scenario.fleet:
        env.cost(device)
        table = env.profile(device).measured.get(env.info.model_name)
        for name in sorted(set(table.layers) - layers) if table else ():
            raise ConfigError(
                env.profile(device).path, f"measured.{env.info.model_name}.layers.{name}",
                f"a layer of model {env.info.model_name!r} (e.g. {sorted(layers)[:3]})", name,
            )  # fmt: skip


def _preflight_beside_ray(scenario: Scenario, env: RunEnvironment) -> dict:
    """:func:`_preflight` on a thread while this thread starts Ray: the two overlap at start-up.

    A check that fails wins: Ray is shut down and the check's error is raised, as if Ray had
    not been started (:func:`fedelastic.runtime.lifecycle.start_ray_beside`).
    """
    return start_ray_beside(scenario, lambda: _preflight(scenario, env))


def run_scenario(
    scenario: Scenario,
    *,
    run_id: str | None = None,
    progress: Callable[[dict], None] | None = None,
    resume: str | Path | None = None,
    grid: Grid | None = None,
) -> Path:
    """Run ``scenario`` to completion, or continue the killed run in folder ``resume``; returns the run folder.

    Results reach disk as the run goes (``simulation.write_every_s``), with a checkpoint. The final ``status.json`` says
    ``completed``, ``completed_with_errors`` (with counts and messages), ``diverged`` (with the round
    and reason) or ``failed``.
    With ``grid`` (a Flower App's ServerApp passes its own), the rounds run on that grid's
    nodes and ``simulation.backend`` is not used.
    """
    checkpoint = _check_resumable(Path(resume)) if resume is not None else None
    return _start(scenario, run_id, progress, resume, checkpoint, grid)


def _start(scenario: Scenario, run_id, progress, resume, checkpoint: dict | None, grid: Grid | None) -> Path:
    """:func:`run_scenario`, its resume checked (``checkpoint``: the one in folder ``resume``)."""
    orphans.clean_all_leftovers(Path(scenario.output_dir))  # Ray processes a killed run of ours left running
    if resume is not None:
        run_dir = Path(resume)
        recorder = Recorder(run_dir, {}, resume=True, planned_rounds=scenario.server.rounds)
        last = -1 if checkpoint is None else checkpoint["round"]  # no checkpoint: from round 0, no row kept
        recorder.reload(lambda r: r["round"] <= last)
    else:
        check_inputs(scenario, environment(scenario))  # bad data, model, options: refused before the folder exists
        run_dir = new_run_dir(scenario, run_id)
        try:
            profiles = {PROFILES: json.dumps(profile_hashes(scenario), indent=2)}
            recorder = Recorder(run_dir, recorded(scenario), planned_rounds=scenario.server.rounds, files=profiles)
        except OSError as exc:
            raise ConfigError(scenario.source or "<scenario>", "output_dir", f"a folder fedelastic can write to ({exc})", scenario.output_dir) from None
    recorder.allow_empty_rounds = scenario.simulation.allow_empty_rounds
    why = environment(scenario).training_path[1] if grid is None else "per-client: a Flower App's grid (a node per client)"
    recorder.notes["training_path"] = why  # in status.json: which path trains the clients, and why
    logging.getLogger("fedelastic").info("training path: %s", why)
    progress = progress or (lambda row: None)
    with _flwr_quiet():
        return _run(scenario, run_dir, recorder, checkpoint, progress, grid)


@contextmanager
def _flwr_quiet():
    """Flower's per-round INFO lines off for the duration of this run only.

    The ``flwr`` logger's level is restored afterwards, so a notebook's logging is left as it was
    (a level the user set at WARNING or above is not touched at all).
    """
    logger = logging.getLogger("flwr")
    before = logger.level
    if before < logging.WARNING:
        logger.setLevel(logging.WARNING)
    logger.addFilter(_not_run_simulation_banner)
    logger.addFilter(_not_cut_off_at_run_end)
    try:
        yield
    finally:
        logger.setLevel(before)
        logger.removeFilter(_not_run_simulation_banner)
        logger.removeFilter(_not_cut_off_at_run_end)


CUT_OFF = "the run ended before this client"  # runtime.backend's ClientTimeout for calls a stopping run cuts off


def _not_cut_off_at_run_end(record: logging.LogRecord) -> bool:
    """False for Flower's ERROR lines (the exception, then its traceback) about a client call that
    the run cut off as it stopped (Ctrl-C, SIGTERM, a failure elsewhere): that is how a run ends,
    and the command says so in one line."""
    return CUT_OFF not in str(record.msg)


def _not_run_simulation_banner(record: logging.LogRecord) -> bool:
    """False for Flower's four-line notice that ``run_simulation`` is deprecated (the runtime
    fedelastic drives; ``flwr run`` runs fedelastic as a Flower App): every other record passes."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (
        str(record.msg).startswith("DEPRECATED FEATURE")
        and bool(args)
        and str(args[0]).startswith("The `run_simulation` function is deprecated")
    )


def _run(scenario: Scenario, run_dir: Path, recorder: Recorder, checkpoint, progress: Callable, grid: Grid | None) -> Path:
    env = environment(scenario)
    stop = threading.Event()
    failure: list[BaseException] = []
    outcome: list[str] = []  # the server's, once it returned
    try:
        if grid is None and scenario.simulation.backend == "ray":
            state = _preflight_beside_ray(scenario, env)
        else:
            state = _preflight(scenario, env)
        if checkpoint is not None:
            state = dict(checkpoint["model"])
        client_app = make_client_app(scenario)

        def server(grid: Grid) -> None:
            try:  # 'stopped' or 'diverged' (recorder.divergence) end it after the round a callback saw
                outcome.append(server_main(scenario, state, recorder, progress, grid, checkpoint=checkpoint))
            except BaseException as exc:
                failure.append(exc)
                raise

        if grid is not None:  # a Flower App's own grid (flwr run): pulls go over the network, keep 0.05 s
            server(GuardedGrid(grid, stop, pull_period_s=0.05, on_sent=recorder.hand_over))
        elif scenario.simulation.backend == "inprocess":
            cohort = scenario.simulation.node_mode == "cohort"
            nodes = cohort_count(scenario, 1) if cohort else scenario.num_clients
            local = InProcessGrid(client_app, nodes)
            local.on_abandon = lambda: env.__dict__.pop("client_model", None)
            guarded = GuardedGrid(local, stop, on_sent=recorder.hand_over)
            try:
                server(CohortGrid(guarded, env, nodes) if cohort else guarded)
            finally:
                local.close()
        else:
            from .rayrun import run_on_ray

            run_on_ray(scenario, server, client_app, stop, recorder)
        if failure:
            raise failure[0]
        done = max((r["round"] for r in recorder.rounds.rows), default=0)
        if done < scenario.server.rounds and outcome[:1] not in (["stopped"], ["diverged"]):
            raise RunFailed(f"the simulation stopped after {done} of {scenario.server.rounds} rounds")
    except BaseException as exc:
        cause = failure[0] if failure and not isinstance(failure[0], RunAborted) else exc
        text = "".join(traceback.format_exception(cause))
        with suppress(OSError):
            recorder.log_error(f"run failed:\n{text}")
            reason = (
                str(cause) if isinstance(cause, Terminated)
                else "interrupted (KeyboardInterrupt)" if isinstance(cause, KeyboardInterrupt)
                else f"{type(cause).__name__}: {cause}"
            )  # fmt: skip
            recorder.status("failed", error=one_line(reason))
        recorder.close()
        if cause is not exc and not isinstance(exc, KeyboardInterrupt):
            raise cause from None
        if isinstance(exc, KeyboardInterrupt):
            exc.run_dir = run_dir  # type: ignore[attr-defined]  # the command's resume hint names the folder
        raise
    recorder.finish(scenario.simulation.max_failure_rate)
    recorder.close()
    return run_dir


PROFILES = "profiles.json"  # in a run folder: each device profile's file and content hash, checked on resume


def profile_hashes(scenario: Scenario) -> dict[str, dict[str, str]]:
    """Device name -> its profile's file and the SHA-256 of its bytes."""
    from ..devices.profile import get_profile

    out = {}
    for device in sorted(scenario.fleet):
        path = Path(get_profile(device, tuple(scenario.device_dirs), context=scenario.source or "<scenario>").path)
        out[device] = {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return out


def _check_profiles(run_dir: Path, scenario: Scenario) -> None:
    """Refuse to resume with a device profile that changed since the run started (a run would mix two profiles)."""
    recorded = run_dir / PROFILES
    if not recorded.is_file():  # a run folder from before profiles were recorded
        return
    try:
        then = json.loads(recorded.read_text())
        items = [(str(device), str(doc["sha256"]), str(doc["path"])) for device, doc in then.items()]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise FedelasticError(f"{recorded}: not a profiles record (device -> {{path, sha256}})") from None
    now = profile_hashes(scenario)
    for device, digest, path in items:
        if device not in now or now[device]["sha256"] != digest:
            where = now[device]["path"] if device in now else path
            raise FedelasticError(
                f"{where}: device profile {device!r} changed since the run started (its hash is in {recorded}); "
                "resuming would mix two profiles in one run: restore the file, or start a new run"
            )


def _check_status(run_dir: Path) -> None:
    """A run folder whose run can be resumed: config.toml, a stopped run's status, a checkpoint file."""
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        raise FedelasticError(
            f"{run_dir}: the run was stopped before it started (the folder is empty); nothing to resume: "
            f"start it again, e.g. `fedelastic run SCENARIO --run-id {run_dir.name}`"
        )
    if not (run_dir / "config.toml").is_file():
        raise FedelasticError(f"{run_dir}: not a run folder (no config.toml)")
    status = read_status(run_dir)
    if status["status"] == "running":
        raise FedelasticError(f"{run_dir}: the run is still going (pid {status.get('pid')}); nothing to resume")
    if status["status"] in ("completed", "completed_with_errors", "diverged"):
        raise FedelasticError(f"{run_dir}: the run already finished ({status['status']}); nothing to resume")


def _check_resumable(run_dir: Path) -> dict | None:
    """The checkpoint to resume from; None for a run of ours stopped before its first checkpoint
    (its status.json has the PID, host and start a run writes): it starts again from round 0."""
    _check_status(run_dir)
    status = read_status(run_dir)
    started_here = all(key in status for key in ("pid", "host", "started"))
    if started_here and status["status"] in ("dead", "failed") and not (run_dir / CHECKPOINT).exists():
        return None
    return load_checkpoint(run_dir)


def resume_run(run_dir: str | Path, *, progress: Callable[[dict], None] | None = None) -> Path:
    """Continue a killed or failed run from its last checkpointed round, with the scenario it was started with."""
    run_dir = Path(run_dir)
    checkpoint = _check_resumable(run_dir)  # all that can be checked before the config's model file runs
    raw = read_toml(run_dir / "config.toml", "run config")
    src = recorded_source(raw) or str(run_dir / "config.toml")  # relative paths resolve as in the first start
    raw = {k: v for k, v in raw.items() if k not in ("source", "recorded")}
    scenario = parse_scenario(raw, src, resolve=False)
    if scenario.server.policy == "async":  # refused before the folder is touched: the run keeps its status
        raise FedelasticError(
            f"{run_dir}: a run with server.policy = 'async' cannot be resumed (the updates still in flight "
            "are not checkpointed); start it again"
        )
    _check_profiles(run_dir, scenario)
    scenario = validate(scenario)  # the checks first, the model file's import last
    return _start(scenario, None, progress, run_dir, checkpoint, None)
