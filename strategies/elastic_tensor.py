"""ElasticTrainer (Huang, Yang, Gao, MobiSys 2023): elastic tensor selection under a time budget.

Every ``interval`` steps the trainer runs the ``importance`` probe (``I[k] = -sum g * dw`` from one
real optimizer step, weights and optimizer state restored) and this strategy picks the tensors
that maximise total importance within the backward budget of ``rho`` (see
:mod:`fedelastic.strategies.budget` for the budget, cost and memory conventions). Tensors dropped at one
re-selection can come back at the next.
"""

from __future__ import annotations

import numpy as np

from fedelastic.selection.strategy import SelectionContext, register

from .budget import BudgetedStrategy, ElasticConfig, require_importance


@register
class ElasticTensor(BudgetedStrategy):
    """ElasticTrainer: the most important tensors within rho x full step time, re-selected every interval."""

    name = "elastic_tensor"
    config_cls = ElasticConfig
    probe = "importance"
    score_name = "importance"

    def scores(self, ctx: SelectionContext) -> np.ndarray:
        return require_importance(ctx, self.name)
