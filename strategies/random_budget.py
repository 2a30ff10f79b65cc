"""Random-rho ablation: random tensors under ElasticTrainer's time budget.

Each selection draws an importance uniformly in [0, 1) per tensor from ``ctx.rng`` (so a seed
fixes it) and feeds it to the same selector, budget, memory fallback and re-selection interval
as :mod:`strategies.elastic_tensor`. No probe runs. Compared with ElasticTrainer at the same
``rho`` it shows what the importance estimate is worth.
"""

from __future__ import annotations

import numpy as np

from fedelastic.selection.strategy import SelectionContext, register

from .budget import BudgetedStrategy, ElasticConfig


@register
class RandomBudget(BudgetedStrategy):
    """Random tensors within rho x full step time (ablation of ElasticTrainer's importance)."""

    name = "random_budget"
    config_cls = ElasticConfig
    probe = None

    def scores(self, ctx: SelectionContext) -> np.ndarray:
        return ctx.rng.random(ctx.info.num_tensors)
