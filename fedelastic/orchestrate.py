"""The one path from a scenario to a finished run: ``fedelastic run``, :func:`fedelastic.run` and
the Flower App's ServerApp all start (and the command resumes) a run here.

:func:`run` keeps this order, a contract the entry points rely on:

1. :func:`check_run_folder`: the folder names and ``output_dir``, checked before any user code runs;
2. :func:`~fedelastic.scenario.validate`: the names the scenario refers to, a model file's import
   last (its code runs with the user's rights, so a scenario from elsewhere is refused before it);
3. ``on_start(scenario)``: the caller's own step with the validated scenario (the command prints
   its header line, the ServerApp checks its federation's size);
4. Ray's start (backend ``ray`` without a Flower grid only), with the runtime's imports and the
   data prepared beside it (:func:`prepare_run`);
5. :func:`~fedelastic.fl.runner.run_scenario`; a run that ends before its runtime stopped Ray has
   Ray shut down here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, FedelasticError
from .scenario import PLAIN_NAME, Scenario, is_plain_name, validate

if TYPE_CHECKING:
    from flwr.serverapp import Grid


def run(
    scenario: Scenario,
    *,
    run_id: str | None = None,
    progress: Callable[[dict], Any] | None = None,
    grid: Grid | None = None,
    on_start: Callable[[Scenario], None] | None = None,
) -> Path:
    """Check, validate and run ``scenario`` (type-checked, not yet validated: ``resolve=False``);
    returns the run folder. ``progress``: a function of each round's row, or a callback
    (:mod:`fedelastic.sim.callbacks`); ``grid``: a Flower App's own grid (no local runtime starts)."""
    check_run_folder(scenario, run_id)  # a bad folder fails now, before Ray's start and before a model file's code runs
    scenario = validate(scenario)
    if on_start is not None:
        on_start(scenario)
    from .fl import raypool

    started = grid is None and raypool.start_ray_early(scenario, lambda: prepare_run(scenario))
    try:
        from .fl.runner import run_scenario

        return run_scenario(scenario, run_id=run_id, progress=progress, grid=grid)
    finally:
        if started:  # the run stops Ray itself; this is for a run that ended before its runtime began
            raypool.quick_shutdown()


def resume(run_dir: str | Path, *, progress: Callable[[dict], Any] | None = None) -> Path:
    """Continue the killed or failed run in ``run_dir`` with the scenario it was started with (its
    folder and checkpoint are checked before the scenario's model file is imported)."""
    from .fl.runner import resume_run

    return resume_run(run_dir, progress=progress)


def check_run_folder(sc: Scenario, run_id: str | None = None) -> None:
    """What the run folder needs, checked before Ray starts (a second, where ``ray.init`` takes
    several): plain folder names, no run with this ``run_id``, and an ``output_dir`` that is (or
    can be made) a folder this process can write to. The same errors as the run's own
    (``runner.new_run_dir``), which still makes the folder."""
    src = sc.source or "<scenario>"
    names = [(src, "name", sc.name)] + ([] if run_id is None else [("<command line>", "--run-id", run_id)])
    for where, key, value in names:
        if not is_plain_name(value):
            raise ConfigError(where, key, PLAIN_NAME, value)
    output_dir = Path(sc.output_dir)
    base = output_dir / sc.name
    if run_id is not None and (base / run_id).exists() and not (base / run_id).is_dir():
        raise ConfigError(src, "output_dir", "a folder (a file is in the way)", str(base / run_id))
    if run_id is not None and (base / run_id).exists() and any((base / run_id).iterdir()):  # empty: a start killed early
        raise FedelasticError(
            f"{base / run_id}: a run with this id exists; continue it with `fedelastic run --resume {base / run_id}` "
            "or choose another --run-id"
        )
    nearest = base
    while not nearest.exists() and nearest.parent != nearest:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ConfigError(src, "output_dir", "a folder (a file is in the way)", str(nearest))
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(src, "output_dir", "a folder fedelastic can write to (Permission denied)", str(output_dir))


def prepare_run(sc: Scenario) -> None:
    """What a run builds first, done ahead (while Ray starts): the runtime's imports (Flower's
    simulation engine included), the data and the model's description (cached for the run)."""
    from .fl.runner import environment

    env = environment(sc)
    _ = env.data, env.info
    if sc.simulation.backend == "ray":  # imported by the run right after Ray is up, on the start-up's critical path
        import flwr.server.superlink.fleet.vce.backend.raybackend  # noqa: F401
        import flwr.simulation  # noqa: F401
