"""Everything a run derives from its scenario, built once per process and cached.

The server and every Ray actor build the same :class:`RunEnvironment` from the scenario alone,
deterministically: data partitions, the device of each partition, the model description and
the cost models. Nothing large travels with the messages but the model arrays.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from functools import cached_property

import numpy as np
import torch
from torch import nn

from .cost.costmodel import CostModel
from .data import ArrayDataset, FederatedData, carve_validation, hf, load_dataset, partition, train_test_split
from .data import transform as apply_transform
from .data.shifts import Shift, apply_shift
from .data.stream import Stream
from .devices.profile import DeviceProfile, assign_fleet, get_profile
from .errors import ConfigError
from .modelinfo import ModelInfo, describe
from .models import build_model
from .scenario import Scenario
from .selection.strategy import SelectionStrategy, make_strategy


class RunEnvironment:
    """Deterministic per-run state derived from a :class:`Scenario`."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self._costs: dict[str, CostModel] = {}
        self._profiles: dict[str, DeviceProfile] = {}
        self._strategies: dict[float | None, tuple[type[SelectionStrategy], object]] = {}  # see strategy()
        self.figures: dict[tuple, tuple] = {}  # reply figures worked out once (fl.client.round_figures)

    @cached_property
    def external(self) -> FederatedData | None:
        """A Hugging Face dataset or local copy, partitioned by flwr-datasets (once, then read from the cache)."""
        sc = self.scenario
        if not hf.is_external(sc.data.dataset):
            return None
        return hf.prepare(sc.data, sc.num_clients, sc.seed, src=sc.source or "<scenario>", split_seed=sc.split_seed)

    @cached_property
    def split(self) -> tuple[ArrayDataset, ArrayDataset]:
        """Raw (train, test) split of the whole dataset; the test part is never trained on."""
        sc = self.scenario
        if self.external is not None:
            return self.external.train, self.external.test
        ds = load_dataset(sc.data.dataset, src=sc.source, size=sc.data.size)
        train_idx, test_idx = train_test_split(ds.y, sc.data.test_fraction, sc.split_seed)
        return ds.subset(train_idx), ds.subset(test_idx)

    def view(self, ds: ArrayDataset, classes: tuple[int, ...], kind: str, shift: Shift | None = None) -> ArrayDataset:
        """``ds`` restricted to ``classes`` (all if empty), shifted by the transform ``kind`` and by ``shift``."""
        if classes:
            ds = ds.subset(np.flatnonzero(np.isin(ds.y, classes)))
        ds = apply_transform(ds, kind, self.scenario.seed)
        if shift is not None and not shift.is_identity:
            ds = ArrayDataset(apply_shift(ds.x, shift, [self.scenario.seed, 0x5F, len(ds)]), ds.y)
        return ds

    @cached_property
    def data(self) -> FederatedData:
        """The target task: client partitions of the training split, and the server's test set."""
        sc, d = self.scenario, self.scenario.data
        self._check_hue(d.shift, "data.shift.hue")
        if self.external is not None:  # classes were kept, and partitions made, by flwr-datasets
            train, test = (self.view(part, (), d.transform, d.shift) for part in self.split)
            return self._carve(FederatedData(train, test, self.external.partitions))
        train, test = (self.view(part, d.classes, d.transform, d.shift) for part in self.split)
        n, src = sc.num_clients, sc.source or "<scenario>"
        if len(test) == 0:
            raise ConfigError(src, "data.test_fraction", "a fraction that leaves the server some test samples", d.test_fraction)
        parts = partition(
            train.y, n, d.partitioner, sc.seed, alpha=d.alpha,
            shards_per_partition=d.shards_per_partition, min_size=d.min_partition_size, src=src,
        )  # fmt: skip
        return self._carve(FederatedData(train, test, parts))

    def _carve(self, data: FederatedData) -> FederatedData:
        """``data`` with ``data.validation`` of each client's partition held out as the validation set."""
        fraction = self.scenario.data.validation
        if fraction <= 0:
            return data
        parts, held = carve_validation(data.partitions, fraction, self.scenario.seed)
        return dataclasses.replace(data, partitions=parts, validation=held)

    def _check_hue(self, shift: Shift, key: str) -> None:
        channels = self.split[0].x.shape[1]
        if shift.hue and channels != 3:
            raise ConfigError(
                self.scenario.source or "<scenario>", key, f"no hue shift: the images have {channels} channel(s)"
            )

    @cached_property
    def stream(self) -> Stream | None:
        """The continual stream of the run, if the scenario has one."""
        sc = self.scenario
        if sc.stream is None:
            return None
        for i, shift in enumerate(sc.stream.domains):
            self._check_hue(shift, f"stream.domains[{i}].hue")
        try:
            return Stream(sc.stream, self.data, sc.server.rounds, sc.seed)
        except ValueError as exc:
            key, _, expected = str(exc).partition(": ")
            raise ConfigError(sc.source or "<scenario>", key, expected) from None

    def client_data(self, pid: int, server_round: int) -> ArrayDataset:
        """What partition ``pid`` trains on in ``server_round``: its partition, or its stream buffer."""
        if self.stream is not None:
            return self.stream.client_data(pid, server_round)
        return self.data.client(pid)

    @cached_property
    def num_classes(self) -> int:
        train, test = self.split
        return int(max(train.y.max(initial=0), test.y.max(initial=0))) + 1

    @cached_property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.split[0].x.shape[1:])

    @cached_property
    def devices(self) -> list[str]:
        """Device name of each partition."""
        return assign_fleet(self.scenario.fleet, self.scenario.seed)

    def profile(self, name: str) -> DeviceProfile:
        """The device's profile, loaded once per run (the server asks for it once per client per round)."""
        if name not in self._profiles:
            self._profiles[name] = get_profile(
                name, self.scenario.device_dirs, context=self.scenario.source or "<scenario>"
            )
        return self._profiles[name]

    def new_model(self) -> nn.Module:
        """The architecture, with the factory's own initialisation (seeded)."""
        torch.manual_seed(self.scenario.seed)
        shape = self.input_shape
        return build_model(
            self.scenario.model.name,
            context=self.scenario.source or "<scenario>",
            num_classes=self.num_classes,
            in_channels=shape[0],
            input_size=shape[-1],
            **self.scenario.model.options,
        )

    @cached_property
    def client_model(self) -> nn.Module:
        """One model instance per process, reused by every client call (weights are loaded each time)."""
        return self.new_model()

    @cached_property
    def training_path(self) -> tuple[bool, str]:
        """(vectorised?, why): ``simulation.vectorize`` resolved once (:func:`fedelastic.train.vectorized.choose_path`)."""
        from .train.vectorized import choose_path

        return choose_path(self)

    @cached_property
    def info(self) -> ModelInfo:
        model = self.new_model()
        return describe(model, torch.zeros(1, *self.input_shape), model_name=self.scenario.model.name)

    def cost(self, device: str) -> CostModel:
        if device not in self._costs:
            t = self.scenario.train
            optimizer = "momentum" if t.momentum > 0 else "sgd"  # the state the trainer's SGD/SGDW keeps
            self._costs[device] = CostModel(self.info, self.profile(device), t.batch_size, optimizer, self.bn_mode)
        return self._costs[device]

    @property
    def bn_mode(self) -> str:
        """``train.bn_mode`` with ``auto`` resolved: frozen statistics only when starting from trained weights."""
        sc = self.scenario
        if sc.train.bn_mode != "auto":
            return sc.train.bn_mode
        return "frozen" if sc.model.pretrain is not None or sc.model.weights else "train"

    def strategy(self, rho: float | None = None) -> SelectionStrategy:
        """The train strategy; ``rho`` (from a deadline) replaces the scenario's rho option.

        A fresh instance each call, of a class and (frozen) config validated once per ``rho``; the
        last :data:`STRATEGY_CACHE` rhos are kept (a deadline policy sends each client its own).
        """
        known = self._strategies.get(rho)
        if known is not None:
            cls, config = known
            return cls(config)
        t = self.scenario.train
        options = t.options if rho is None else {**t.options, "rho": rho}
        strategy = make_strategy(t.strategy, options, src=self.scenario.source or "<scenario>")
        config = strategy.config
        params = getattr(type(config), "__dataclass_params__", None)  # a dataclass's parameters; None otherwise
        if params is not None and params.frozen:
            if len(self._strategies) >= STRATEGY_CACHE:
                del self._strategies[next(iter(self._strategies))]  # the oldest
            self._strategies[rho] = (type(strategy), config)  # shared by its instances: it cannot change
        return strategy


def freeze_heap() -> None:
    """``gc.freeze()``: what the process holds once a run is set up (modules, data, model; ~230k
    objects in an in-process run) leaves the collector's generations.

    CPython's full collection walks every tracked object; it starts after enough new objects have
    survived (every few dozen rounds of the peers workload), and walking the start-up's objects
    would make it a 130 ms pause in one round. Frozen
    objects are never collected, so what the start-up left as garbage stays until
    :func:`gc.unfreeze` (the driver calls it when the run ends; a worker process ends with its run).
    """
    gc.freeze()


def warm_up(scenario: Scenario, info: ModelInfo | None = None) -> None:
    """Build what every client call needs (data, model, its description, the strategy's module and
    config) while the run starts; ``info``: a description already made (the driver's), used
    instead of describing the model again."""
    env = environment(scenario)
    if info is not None:
        env.__dict__.setdefault("info", info)  # cached_property's slot
    _ = env.data, env.info, env.client_model, env.training_path
    env.strategy()  # imports the strategy's module and validates its config once, before round 1


_CACHE: dict[str, RunEnvironment] = {}
STRATEGY_CACHE = 64  # validated strategy configs kept per environment (by rho)


def environment(scenario: Scenario) -> RunEnvironment:
    """The process-wide cached environment of ``scenario``."""
    last = _CACHE.get("")
    if last is not None and last.scenario is scenario:  # the same (frozen) object: no need to compare contents
        return last
    key = json.dumps(scenario.to_dict(), sort_keys=True)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = RunEnvironment(scenario)
    _CACHE[""] = _CACHE[key]
    return _CACHE[key]
