"""A run's early Ray start: the local cluster started, and Flower's client actors created, before
the runtime (Flower, torch) is imported.

:func:`start_ray_early` starts Ray with the driver's imports and data on a thread beside it
(:func:`fedelastic.runtime.lifecycle.start_ray_beside`), then creates Flower's client actors
(:func:`fedelastic.fl.rayrun.start_actors_early`), which build their data while the driver sets the
run up. Importing this module imports no Flower.
"""

from __future__ import annotations

from collections.abc import Callable

from ..runtime import patches
from ..runtime.backend import drop_early_actors
from ..runtime.lifecycle import quick_shutdown, start_ray_beside


def start_ray_early(scenario, prepare: Callable[[], object]) -> bool:
    """Start the local Ray cluster of ``scenario`` now, with ``prepare()`` (the driver's imports
    and data) on a thread beside it; True if this call started Ray.

    The one run path (:func:`fedelastic.orchestrate.run`) calls it before it imports the runtime, so
    that ``ray.init`` overlaps those imports too. Best effort: an error of ``prepare``
    or of ``ray.init`` is left for the run, which meets it again and reports it as usual. The
    caller shuts Ray down (:func:`quick_shutdown`) if the run ends before it does.
    """
    sim = scenario.simulation
    if sim.backend != "ray" or sim.ray_address:  # connecting to a running cluster is quick
        return False
    import ray

    if ray.is_initialized():
        return False

    def quietly() -> None:
        try:
            prepare()
        except Exception:  # noqa: BLE001,S110 (the run prepares again and reports the error)
            pass

    try:
        start_ray_beside(scenario, quietly)
        if ray.is_initialized():
            early_start(scenario)
    except Exception:  # noqa: BLE001 (the run starts Ray again and reports the error)
        return False
    except BaseException:  # Ctrl-C while Ray starts or the data is prepared: leave no cluster behind
        if ray.is_initialized():
            quick_shutdown()
        raise
    return ray.is_initialized()


def early_start(scenario) -> None:
    """Flower's client actors created now (``rayrun.start_actors_early``), so that they import the
    runtime and build their data while the driver sets the run up. Best effort: an error leaves
    the actors to Flower, which creates them when the simulation starts."""
    if not patches.active("flwr"):  # Flower's own build makes its own actors
        return
    try:
        from .rayrun import start_actors_early

        start_actors_early(scenario)
    except Exception:  # noqa: BLE001,S110 (the run meets the error again and reports it)
        drop_early_actors()


