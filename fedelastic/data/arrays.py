"""The in-memory dataset every loader returns (re-exported by :mod:`fedelastic.data`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrayDataset:
    """Images ``x`` (N, C, H, W) float32 and labels ``y`` (N,) int64."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.x[idx], self.y[idx])

    @property
    def num_classes(self) -> int:
        return int(self.y.max()) + 1
