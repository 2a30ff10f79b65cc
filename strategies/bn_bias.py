"""BN + Bias baseline: norm gamma/beta, every bias and the classifier head train."""

import numpy as np

from fedelastic.selection.strategy import Selection, SelectionContext, SelectionStrategy, register

TRAINED_ROLES = ("norm_weight", "norm_bias", "bias")


@register
class BnBias(SelectionStrategy):
    """Norm scales and shifts, all biases and the head (last layer); a fixed scheme."""

    name = "bn_bias"

    def select(self, ctx: SelectionContext) -> Selection:
        info = ctx.info
        mask = np.array([role in TRAINED_ROLES for role in info.tensor_roles], dtype=float)
        mask[list(info.layers[-1].tensors)] = 1
        return Selection.from_mask(mask)
