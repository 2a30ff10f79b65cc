"""fedelastic: simulate federated and continual on-device training on emulated edge fleets.

The Python API (imported lazily, so ``import fedelastic`` stays light)::

    from fedelastic import Scenario, run, compare, register_strategy, register_model, register_dataset

The extension points (strategies, models, datasets, server policies, aggregators) all register
through ``register_*`` functions here (the classes subclass ``SelectionStrategy``, ``Policy`` and
``Aggregator``); :mod:`fedelastic.plugins` describes them in one place.
"""

__version__ = "0.1.0"

_API = {
    "run": ("fedelastic.api", "run"),
    "compare": ("fedelastic.api", "compare"),
    "load": ("fedelastic.api", "load"),
    "stop_at_accuracy": ("fedelastic.api", "stop_at_accuracy"),
    "StopRun": ("fedelastic.errors", "StopRun"),
    "RunResult": ("fedelastic.api", "RunResult"),
    "ComparisonResult": ("fedelastic.api", "ComparisonResult"),
    "Scenario": ("fedelastic.scenario", "Scenario"),
    "register_strategy": ("fedelastic.selection.strategy", "register"),
    "register_model": ("fedelastic.models", "register_model"),
    "register_dataset": ("fedelastic.data", "register_dataset"),
    "register_policy": ("fedelastic.sim.policies", "register_policy"),
    "register_aggregator": ("fedelastic.sim.aggregators", "register_aggregator"),
    "SelectionStrategy": ("fedelastic.selection.strategy", "SelectionStrategy"),
    "Policy": ("fedelastic.sim.policies", "Policy"),
    "Aggregator": ("fedelastic.sim.aggregators", "Aggregator"),
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fedelastic' has no attribute {name!r}")
