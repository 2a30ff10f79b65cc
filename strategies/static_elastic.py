"""Static-rho ablation: ElasticTrainer's first selection, kept.

The importance probe runs once, before the first step, and the selection it gives is never
revised. After that selection the instance sets its ``probe`` to ``None`` and returns the same
selection from :meth:`select`. The selection is the strategy's :meth:`state`, which the client
keeps across rounds, so later rounds reuse it without paying for the probe again.
"""

from __future__ import annotations

import numpy as np

from fedelastic.selection.strategy import Selection, SelectionContext, register

from .budget import BudgetConfig, BudgetedStrategy, require_importance


@register
class StaticElastic(BudgetedStrategy):
    """ElasticTrainer's first selection kept forever (ablation of elasticity)."""

    name = "static_elastic"
    config_cls = BudgetConfig
    probe = "importance"
    score_name = "importance"

    def __init__(self, config=None):
        super().__init__(config)
        self._first: Selection | None = None

    def should_reselect(self, step: int, steps_per_epoch: int = 0) -> bool:
        return False

    def scores(self, ctx: SelectionContext) -> np.ndarray:
        return require_importance(ctx, self.name)

    def select(self, ctx: SelectionContext) -> Selection:
        if self._first is None:
            self._first = super().select(ctx)
            self.probe = None  # instance attribute: later selections need no probe
        return self._first

    def state(self) -> dict[str, np.ndarray]:
        return {} if self._first is None else {"ratios": self._first.ratios}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        if "ratios" in state:
            self._first = Selection(np.asarray(state["ratios"], dtype=float))
            self.probe = None
