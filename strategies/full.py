"""Full fine-tuning: every tensor trains."""

import numpy as np

from fedelastic.selection.strategy import Selection, SelectionContext, SelectionStrategy, register


@register
class Full(SelectionStrategy):
    """Full fine-tuning: every tensor trains (a fixed scheme)."""

    name = "full"

    def select(self, ctx: SelectionContext) -> Selection:
        return Selection.from_mask(np.ones(ctx.info.num_tensors))
