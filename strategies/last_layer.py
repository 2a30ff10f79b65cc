"""Last layer only: the classifier head trains, the backbone is frozen."""

import numpy as np

from fedelastic.selection.strategy import Selection, SelectionContext, SelectionStrategy, register


@register
class LastLayer(SelectionStrategy):
    """Last layer only: the classifier head trains, the backbone is frozen."""

    name = "last_layer"

    def select(self, ctx: SelectionContext) -> Selection:
        mask = np.zeros(ctx.info.num_tensors)
        mask[list(ctx.info.layers[-1].tensors)] = 1
        return Selection.from_mask(mask)
