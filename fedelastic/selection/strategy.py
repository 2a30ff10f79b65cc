"""The selection-strategy interface and registry.

A strategy decides which tensors (and which output channels) train. It is pure Python/numpy:
it sees a :class:`SelectionContext` (the model description, the device's cost model and the
probe results the trainer gathered for it) and returns a :class:`Selection`. It knows nothing of
torch, Flower or Ray.

Strategies live one per module in the ``strategies/`` folder (installed as ``fedelastic.strategies``) and register with
:func:`register`; third parties can register through the ``fedelastic.strategies`` entry point
group. A duplicate name is an error.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar

import numpy as np

from ..config import from_dict
from ..cost.costmodel import CostModel
from ..errors import ConfigError
from ..modelinfo import ModelInfo
from ..plugins import Registry, same_definition

PROBES = ("importance", "fisher")
#: how :attr:`SelectionStrategy.empty_note` starts when its selection was carried from an earlier round
CARRIED = "the selection carried from an earlier round (no probe until its interval is due) trains nothing: "


@dataclass(frozen=True)
class Selection:
    """Per-tensor trained fraction (0 frozen, 1 whole tensor) and, where partial, the channels.

    A partial tensor trains either the output channels listed in ``channels`` or, if
    ``input_sparse[k]`` is set, a ``ratios[k]`` share of its **input** channels (Sparse Update),
    which the trainer picks by weight norm (largest first; a depthwise conv's own channels).
    """

    ratios: np.ndarray
    channels: dict[int, np.ndarray] = field(default_factory=dict)
    input_sparse: np.ndarray | None = None  # bool per tensor: ratio counts input channels

    @classmethod
    def from_mask(cls, mask: np.ndarray) -> Selection:
        return cls(np.asarray(mask, dtype=float))

    @classmethod
    def from_channels(
        cls, info: ModelInfo, channels: dict[int, np.ndarray], whole: np.ndarray | None = None
    ) -> Selection:
        """Whole tensors from ``whole`` plus the listed output channels of other tensors."""
        ratios = np.zeros(info.num_tensors) if whole is None else np.asarray(whole, float).copy()
        kept = {}
        for k, idx in channels.items():
            idx = np.unique(np.asarray(idx, dtype=np.int64))
            if idx.size == 0:
                continue
            ratios[k] = idx.size / info.tensor_channels[k]
            if idx.size < info.tensor_channels[k]:
                kept[k] = idx
        return cls(ratios, kept)

    @property
    def mask(self) -> np.ndarray:
        return self.ratios > 0


@dataclass
class SelectionContext:
    """What a strategy may look at when it selects."""

    info: ModelInfo
    cost: CostModel
    step: int
    rng: np.random.Generator
    importance: np.ndarray | None = None  # per tensor, from the 'importance' probe
    fisher: dict[int, np.ndarray] | None = None  # per layer index, per output channel, from 'fisher'
    ops: float = 0.0  # elementary operations the selection did besides cost-model calls (priced on the device)
    note: str = ""  # why nothing can be trained on this device, with the figures (set by the strategy)

    @property
    def memory_budget_bytes(self) -> float:
        return self.cost.device.memory_train_bytes.value


@dataclass(frozen=True)
class StrategyConfig:
    """Base of the strategies' frozen configs (no options)."""


class SelectionStrategy:
    """Base class: override :meth:`select`, and :meth:`should_reselect` for elastic methods."""

    name: ClassVar[str]
    config_cls: ClassVar[type] = StrategyConfig
    probe: ClassVar[str | None] = None  # which probe the trainer runs before select()
    offline: ClassVar[bool] = False  # the selection is computed offline (not on the device): its work is not charged
    #: the last selection and the steps run since it was made, kept across local trainings while
    #: :meth:`carries_selection` (set by the trainer, saved by :meth:`state`)
    carried: Selection | None = None
    since: int = 0
    #: why the last selection (made in this local training, or carried from an earlier one) trains
    #: nothing although the device could train something, with the figures; "" otherwise (set by
    #: the strategy's :meth:`select`, saved with the carried selection by :meth:`state`)
    empty_note: str = ""

    def __init__(self, config: Any = None):
        self.config = config if config is not None else self.config_cls()

    def select(self, ctx: SelectionContext) -> Selection:
        raise NotImplementedError

    def should_reselect(self, step: int, steps_per_epoch: int = 0) -> bool:
        """Whether to probe and select again after ``step`` steps since the last selection.

        The trainer counts ``step`` from the last selection; a strategy that
        :meth:`carries_selection` counts it across local trainings (rounds), one that does not
        selects afresh at the start of each. ``steps_per_epoch`` is the local trainer's, for
        intervals counted in epochs.
        """
        return False

    def carries_selection(self) -> bool:
        """Whether the last selection, and the steps since it, carry over to the next local training.

        True for strategies that re-select on an interval (ElasticTrainer's every 4 epochs): the
        interval then runs across federated rounds, as the artifact's runs across epochs, instead
        of restarting (and re-probing) at every round. False (default): each local training starts
        with a selection.
        """
        return False

    def probe_scope(self, ctx: SelectionContext) -> np.ndarray | None:
        """Tensors the probe must cover (bool per tensor); None: all. An empty scope skips the probe."""
        return None

    def state(self) -> dict[str, np.ndarray]:
        """What the strategy remembers between local trainings; the client keeps it across rounds.

        Here: the carried selection (:attr:`carried`, :attr:`since`) with the config it was made
        under; a subclass adds its own keys to ``super().state()``.
        """
        sel = self.carried
        if sel is None or not self.carries_selection():
            return {}
        out = {
            "carried.ratios": np.asarray(sel.ratios, float),
            "carried.since": np.array([self.since], np.int64),
            "carried.config": np.frombuffer(repr(self.config).encode(), np.uint8),
        }
        if self.empty_note and not sel.mask.any():
            out["carried.empty_note"] = np.frombuffer(self.empty_note.encode(), np.uint8)
        if sel.input_sparse is not None:
            out["carried.input_sparse"] = np.asarray(sel.input_sparse, bool)
        for k, idx in sel.channels.items():
            out[f"carried.channels.{k}"] = np.asarray(idx, np.int64)
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`state` returned in an earlier round.

        A carried selection made under another config (a deadline's own rho) is dropped: the next
        local training selects afresh.
        """
        if "carried.ratios" not in state or not self.carries_selection():
            return
        if bytes(np.asarray(state["carried.config"], np.uint8)) != repr(self.config).encode():
            return
        sparse = state.get("carried.input_sparse")
        channels = {
            int(key.rsplit(".", 1)[1]): np.asarray(v, np.int64)
            for key, v in state.items()
            if key.startswith("carried.channels.")
        }
        self.carried = Selection(
            np.asarray(state["carried.ratios"], float), channels, None if sparse is None else np.asarray(sparse, bool)
        )
        self.since = int(np.asarray(state["carried.since"]).reshape(-1)[0])
        if "carried.empty_note" in state:
            note = bytes(np.asarray(state["carried.empty_note"], np.uint8)).decode()
            self.empty_note = note if note.startswith(CARRIED) else CARRIED + note


REGISTRY = Registry("strategies", where="<register_strategy>", carried=True, load=lambda: _load())


def register(cls: type[SelectionStrategy]) -> type[SelectionStrategy]:
    """Class decorator (``fedelastic.register_strategy``): register a strategy under ``cls.name``.

    Registering the same class again (a re-run notebook cell) is harmless; a name another class has
    (a built-in's included), or a class that is not a :class:`SelectionStrategy` with a non-empty
    ``name``, a known ``probe`` and a frozen ``config_cls``, is a ConfigError.
    """
    where = "<register_strategy>"
    if not (isinstance(cls, type) and issubclass(cls, SelectionStrategy)):
        raise ConfigError(where, "strategy", "a subclass of fedelastic.selection.strategy.SelectionStrategy", cls)
    if not isinstance(getattr(cls, "name", None), str) or not cls.name.strip():
        raise ConfigError(where, f"{cls.__name__}.name", "a non-empty string", getattr(cls, "name", None))
    _load()  # the built-ins first: a user's class cannot take a built-in name before they load
    if cls.name in REGISTRY and not same_definition(REGISTRY[cls.name], cls):
        raise ConfigError(
            where, f"{cls.__name__}.name", f"a name not registered yet ({REGISTRY[cls.name].__module__} has it)", cls.name
        )  # (the module alone, not Registry.claim's qualified name: messages users have seen)
    if cls.probe is not None and cls.probe not in PROBES:
        raise ConfigError(where, f"{cls.__name__}.probe", f"None or one of {PROBES}", cls.probe)
    if not (dataclasses.is_dataclass(cls.config_cls) and cls.config_cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise ConfigError(where, f"{cls.__name__}.config_cls", "a frozen dataclass", cls.config_cls)
    REGISTRY[cls.name] = cls
    return cls


_loaded = False
_loading: list[bool] = []  # non-empty while _load runs (the modules it imports call register)


def _load() -> None:
    global _loaded
    if _loaded or _loading:
        return
    _loading.append(True)
    try:
        try:
            importlib.import_module("fedelastic.strategies")  # where the strategies/ folder installs
        except ModuleNotFoundError as exc:
            if exc.name != "fedelastic.strategies":
                raise
            importlib.import_module("strategies")  # not installed: a source tree or a Flower app bundle
        for ep in entry_points(group="fedelastic.strategies"):
            ep.load()
    finally:
        _loading.clear()
    _loaded = True
    REGISTRY.loaded()  # what a user registers from here on is carried to Ray's workers


def available() -> list[str]:
    _load()
    return sorted(REGISTRY)


def make_strategy(
    name: str, options: dict | None = None, *, src: str = "<scenario>", key: str = "train"
) -> SelectionStrategy:
    """Instantiate a registered strategy, validating its options into its frozen config."""
    _load()
    if name not in REGISTRY:
        raise ConfigError(src, f"{key}.strategy", f"a registered strategy, one of {sorted(REGISTRY)}", name)
    cls = REGISTRY[name]
    return cls(from_dict(cls.config_cls, options or {}, src, prefix=f"{key}.options"))
