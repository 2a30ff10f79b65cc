"""Server aggregation as a plug-in point: ``server.aggregator`` names one, ``server.aggregator_options`` sets it.

* ``fedavg`` (default): partial-aware FedAvg (:func:`~fedelastic.sim.aggregate.aggregate_partial`):
  each element is the example-weighted mean over the clients that trained it.
* ``fedprox``: the same server step; each client adds the proximal term ``mu/2 ||w - w_global||^2``
  to its loss (option ``mu``, default 0.01).
* ``fedadam`` / ``fedyogi``: server optimizers over the aggregated pseudo-gradient
  ``delta = fedavg(x, updates) - x`` (Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
  Algorithm 2, without bias correction, moments starting at 0)::

      m = beta_1 m + (1 - beta_1) delta
      v = beta_2 v + (1 - beta_2) delta^2                          (Adam)
      v = v - (1 - beta_2) delta^2 sign(v - delta^2)               (Yogi)
      x = x + eta m / (sqrt(v) + tau)

  Options: ``eta``, ``beta_1``, ``beta_2``, ``tau`` (defaults as Flower's FedAdam / FedYogi).

**Untrained coordinates.** An element that no counted client trained (its tensor absent from
every update, or masked out of every channel mask) keeps its value, and a server optimizer's
moments are not updated there: they change only where some client trained. The server
optimizers step the trainable tensors (``tensor_names``); other arrays (normalisation
statistics) take the partial FedAvg value.

A new aggregator is one class registered with :func:`register_aggregator`; its moments or
other state go in :meth:`Aggregator.state` so that a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError
from ..plugins import Registry
from .aggregate import ClientUpdate, aggregate_partial


class Aggregator:
    """Partial-aware FedAvg, and the base of every aggregator.

    ``defaults``: its options and their default values (any other option is a config error).
    """

    name: ClassVar[str] = "fedavg"
    defaults: ClassVar[dict[str, float]] = {}

    def __init__(self, options: Mapping[str, Any] | None = None, tensor_names: Sequence[str] = ()):
        self.options = {**self.defaults, **(options or {})}
        self.tensor_names = list(tensor_names)

    def __call__(self, current: dict[str, np.ndarray], updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        """The new global state from ``current`` and the round's counted updates."""
        return aggregate_partial(current, updates)

    def state(self) -> dict[str, np.ndarray]:
        """Arrays a checkpoint keeps (a server optimizer's moments)."""
        return {}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        pass


AGGREGATORS = Registry("aggregators", {"fedavg": Aggregator}, where="<register_aggregator>")


def register_aggregator(cls: type[Aggregator]) -> type[Aggregator]:
    """Class decorator (``fedelastic.register_aggregator``): make ``cls`` available as ``server.aggregator = cls.name``.

    ``cls`` subclasses :class:`Aggregator` and sets its own ``name``; its ``defaults`` map option
    names to numbers. Registering the same class again (a re-run notebook cell) is harmless; a
    name another class has is a ConfigError, as is anything else.
    """
    def check(cls: type[Aggregator]) -> None:
        defaults = cls.defaults
        if not (isinstance(defaults, dict) and all(isinstance(k, str) and _number(v) for k, v in defaults.items())):
            raise ConfigError(AGGREGATORS.where, f"{cls.__name__}.defaults", "a dict of option name -> number", defaults)

    AGGREGATORS.add_class(cls, Aggregator, key="server.aggregator", check=check)
    return cls


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@register_aggregator
class FedProx(Aggregator):
    """FedAvg on the server; the clients train with a proximal term ``mu/2 ||w - w_global||^2``
    (:func:`proximal_mu` reads ``mu`` from the scenario)."""

    name = "fedprox"
    defaults = {"mu": 0.01}


def trained_elements(name: str, shape: tuple[int, ...], updates: Sequence[ClientUpdate]) -> np.ndarray:
    """Boolean array: the elements of tensor ``name`` that some update (with a positive weight) trained."""
    out = np.zeros(shape, dtype=bool)
    for upd in updates:
        if name not in upd.arrays or upd.weight <= 0:
            continue
        if name not in upd.channel_masks:
            return np.ones(shape, dtype=bool)
        mask = np.asarray(upd.channel_masks[name])
        if mask.ndim == 1 and len(shape) > 1:
            mask = mask.reshape((-1,) + (1,) * (len(shape) - 1))
        out |= np.broadcast_to(mask > 0, shape)
    return out


class ServerOptimizer(Aggregator):
    """A server optimizer over the partial FedAvg pseudo-gradient (see the module doc)."""

    defaults = {"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-9}

    def __init__(self, options: Mapping[str, Any] | None = None, tensor_names: Sequence[str] = ()):
        super().__init__(options, tensor_names)
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, current: dict[str, np.ndarray], updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
        averaged = aggregate_partial(current, updates)
        o = self.options
        eta, b1, tau = float(o["eta"]), float(o["beta_1"]), float(o["tau"])
        for name in self.tensor_names:
            x = current.get(name)
            if x is None or np.asarray(x).dtype.kind != "f":
                continue
            trained = trained_elements(name, x.shape, updates)
            if not trained.any():
                continue  # averaged[name] is the current value
            x64 = np.asarray(x, dtype=np.float64)
            delta = np.asarray(averaged[name], dtype=np.float64) - x64
            m = self.m.get(name, np.zeros(x.shape))
            v = self.v.get(name, np.zeros(x.shape))
            self.m[name] = m = np.where(trained, b1 * m + (1 - b1) * delta, m)
            self.v[name] = v = np.where(trained, self.second_moment(v, delta), v)
            averaged[name] = np.where(trained, x64 + eta * m / (np.sqrt(v) + tau), x64).astype(x.dtype, copy=False)
        return averaged

    def state(self) -> dict[str, np.ndarray]:
        return {**{f"m/{k}": v for k, v in self.m.items()}, **{f"v/{k}": v for k, v in self.v.items()}}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.m = {k[2:]: np.asarray(v, dtype=np.float64) for k, v in state.items() if k.startswith("m/")}
        self.v = {k[2:]: np.asarray(v, dtype=np.float64) for k, v in state.items() if k.startswith("v/")}


@register_aggregator
class FedAdam(ServerOptimizer):
    name = "fedadam"

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        b2 = float(self.options["beta_2"])
        return b2 * v + (1 - b2) * delta**2


@register_aggregator
class FedYogi(ServerOptimizer):
    name = "fedyogi"
    defaults = {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        b2 = float(self.options["beta_2"])
        return v - (1 - b2) * delta**2 * np.sign(v - delta**2)


def make_aggregator(server: Any, tensor_names: Sequence[str], src: str = "<scenario>") -> Aggregator:
    """The aggregator ``server.aggregator`` names, with ``server.aggregator_options`` (checked)."""
    name = getattr(server, "aggregator", "fedavg")
    options = dict(getattr(server, "aggregator_options", {}) or {})
    cls = AGGREGATORS.get(name)
    if cls is None:
        raise ConfigError(src, "server.aggregator", f"one of {sorted(AGGREGATORS)}", name)
    for key, value in options.items():
        if key not in cls.defaults:
            raise ConfigError(
                src, f"server.aggregator_options.{key}", f"one of {sorted(cls.defaults)} (unknown key)", key
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value) or value < 0:
            raise ConfigError(src, f"server.aggregator_options.{key}", "a finite number >= 0", value)
    return cls(options, tensor_names)


def proximal_mu(scenario: Any) -> float:
    """FedProx's ``mu`` when a :class:`~fedelastic.scenario.Scenario` sets ``server.aggregator = "fedprox"``
    (else 0: no proximal term). Untyped: ``scenario`` imports this module."""
    server = scenario.server
    if getattr(server, "aggregator", "fedavg") != "fedprox":
        return 0.0
    return float(server.aggregator_options.get("mu", FedProx.defaults["mu"]))
