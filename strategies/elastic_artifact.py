"""ElasticTrainer as the published artifact selects (pittisl/ElasticTrainer), its own cost prior included.

:mod:`strategies.elastic_tensor` is an *idealised* ElasticTrainer: it selects with the same measured
cost model that charges the time, so it never overruns ``rho x full``. The artifact does not: it
selects with its own prior (``train.py``, ``selection_solver_DP.py``; read, not copied):

* **a fixed forward:backward ratio of 1:2**: the backward budget is ``(rho - 1/3) * 3/2`` of the
  whole backward (``rho_for_backward_pass``), whatever the device's real forward share;
* **its profiled per-layer times**: each tensor costs its own gradient ``t_dw`` and passes the
  error gradient for ``t_dx`` (here the device's measured or modelled per-layer times, the
  artifact's profile); the optimizer update and the backward time no tensor owns are not in it;
* **its grid DP**: times rounded *down* to ``resolution`` units (``Tq = 1e3``) spanning the whole
  backward, its DP with its quirks (:func:`fedelastic.selection.budgeted.select_artifact_dp`,
  ``artifact_grid=True``).

So its selections may take more (or less) than ``rho x full`` on the device: the mis-pricing the
Accelerated ElasticTrainer paper names as the cause of ElasticTrainer's overrun. Memory is still
respected (floors raised as in :mod:`fedelastic.strategies.budget`), as the project's runs need.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedelastic.config import field
from fedelastic.errors import ConfigError
from fedelastic.selection.strategy import SelectionContext, register

from .budget import BudgetedStrategy, ElasticConfig, Solver, require_importance

#: the artifact's prior: the forward is a third of a step (forward:backward 1:2)
FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class ArtifactConfig(ElasticConfig):
    """Options of the artifact-style ElasticTrainer: its DP by default."""

    solver: Solver = field(
        "artifact_dp",
        help="'artifact_dp' (default: the artifact's DP on its own round-down grid over the whole backward), "
        "or 'exact', 'grid', 'greedy' on the same prior",
    )


def artifact_budget(rho: float, t_dw: np.ndarray, t_dx: np.ndarray) -> float:
    """The artifact's backward budget: ``(rho - 1/3) * 3/2`` of its whole backward ``sum(t_dw + t_dx)``."""
    return (rho - FORWARD_SHARE) / (1.0 - FORWARD_SHARE) * float(t_dw.sum() + t_dx.sum())


@register
class ElasticArtifact(BudgetedStrategy):
    """ElasticTrainer as published: tensor selection on its own 1:2 prior and grid DP (may overrun rho x full)."""

    name = "elastic_artifact"
    config_cls = ArtifactConfig
    probe = "importance"
    score_name = "importance"
    respects_time = False  # selects on its prior; the device's step may exceed rho x full
    artifact_grid = True

    def scores(self, ctx: SelectionContext) -> np.ndarray:
        return require_importance(ctx, self.name)

    def prior(self, ctx: SelectionContext) -> tuple[float, np.ndarray, np.ndarray, float]:
        dw, dx = ctx.cost.t_dw.copy(), ctx.cost.t_dx.copy()
        budget = artifact_budget(self.config.rho, dw, dx)
        if budget <= 0 and self.config.infeasible == "error":
            raise ConfigError(f"<strategy {self.name}>", "train.options.rho",
                              "more than the artifact's forward share 1/3 (its prior leaves no backward time)",
                              self.config.rho)  # fmt: skip
        return budget, dw, dx, 0.0
