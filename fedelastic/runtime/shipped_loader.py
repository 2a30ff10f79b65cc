"""The worker-side loader of ``fl.rayrun.ShippedClientApp`` and the warm-up of the early actors,
shipped to Ray's workers by value (this module is registered with Ray's cloudpickle by
:func:`by_value`): unpickling them imports no fedelastic, so that the driver's code can go first
on the worker's path before any fedelastic is imported there."""

from __future__ import annotations

import sys


def by_value(name: str):
    """The function ``name`` of this module, the module registered to be pickled by value."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return globals()[name]


def driver_code_first(root, paths):
    import sys

    if "fedelastic" not in sys.modules:  # this worker's first fedelastic: the driver's code goes first
        sys.path[:] = [root] + [p for p in paths if p != root] + [p for p in sys.path if p != root and p not in paths]


def load_with_driver_code(root, paths, key, payload):
    driver_code_first(root, paths)
    from fedelastic.runtime.lifecycle import unpickled_app

    return unpickled_app(root, key, payload)


def warm_with_driver_code(root, paths, payload):
    driver_code_first(root, paths)
    try:
        import pickle

        pickle.loads(payload)()
    except Exception:  # noqa: BLE001,S110 (best effort: the worker's first call builds what is missing, and reports its errors)
        pass
