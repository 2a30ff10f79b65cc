"""Partial-aware federated averaging, pure numpy.

Each client sends only the tensors it trained, plus a 0/1 mask for the tensors it trained only
in part: 1-D over output channels (dim 0), or any array that broadcasts to the tensor (e.g.
``(1, C_in, 1, 1)`` for a conv trained on some input channels). Every element is averaged, weighted by number of examples,
over the clients that trained it; an element that no client trained keeps its global value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ClientUpdate:
    weight: float  # number of examples
    arrays: Mapping[str, np.ndarray]
    channel_masks: Mapping[str, np.ndarray] = field(default_factory=dict)


def aggregate_partial(global_state: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
    """New global state: per element, the weighted mean over the clients that trained it."""
    new_state = {}
    for name, current in global_state.items():
        num = np.zeros(current.shape, dtype=np.float64)
        den = np.zeros(current.shape, dtype=np.float64)
        for upd in updates:
            if name not in upd.arrays:
                continue
            value = np.asarray(upd.arrays[name], dtype=np.float64)
            if value.shape != current.shape:
                raise ValueError(f"tensor {name!r}: update shape {value.shape} != global {current.shape}")
            w = np.full(current.shape, float(upd.weight))
            if name in upd.channel_masks:
                mask = np.asarray(upd.channel_masks[name], dtype=np.float64)
                if mask.ndim == 1:
                    mask = mask.reshape((-1,) + (1,) * (current.ndim - 1))
                w = w * np.broadcast_to(mask, current.shape)
            num += w * value
            den += w
        trained = den > 0
        merged = np.where(trained, num / np.where(trained, den, 1.0), current)
        new_state[name] = merged.astype(current.dtype, copy=False)
    return new_state
