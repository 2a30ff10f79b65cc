"""Accelerated ElasticTrainer (Ha and Kim, IEEE Access 2025, our reading): elastic layer selection.

Whole layers are the units, so every kernel that runs stays large: a layer's importance is the sum
of its tensors' importance, its cost the sum of their ``t_dw + t_opt`` (roofline-timed, launch
overhead included, by the cost model) and its chain cost the layer's ``t_dx``. The same budgeted
selector as :mod:`strategies.elastic_tensor` runs over layers and the result is expanded to
tensors; budget, re-selection and memory conventions are those of :mod:`fedelastic.strategies.budget`.
"""

from __future__ import annotations

import numpy as np

from fedelastic.selection.strategy import SelectionContext, register

from .budget import BudgetedStrategy, ElasticConfig, require_importance


@register
class ElasticLayer(BudgetedStrategy):
    """Accelerated ElasticTrainer: whole layers by summed importance within rho x full step time."""

    name = "elastic_layer"
    config_cls = ElasticConfig
    probe = "importance"
    score_name = "importance"

    def scores(self, ctx: SelectionContext) -> np.ndarray:
        return require_importance(ctx, self.name)

    def units(self, ctx: SelectionContext) -> np.ndarray:
        return np.asarray(ctx.info.tensor_layer, dtype=np.int64)
