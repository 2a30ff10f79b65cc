"""How far a rounding-level difference carries in local training: vectorised vs per-client, against
the per-client loop started from weights perturbed by 1e-7 (relative).

    python benchmarks/vmap_drift.py

Three clients of 160 digits each, small_cnn width 16 (quickstart's model), 3 epochs of batch 16
(30 steps), SGD lr 0.05, momentum 0.9, weight decay 5e-4, ``full``, fp32; BatchNorm on batch
statistics (``train``) and frozen. Prints the largest weight difference of each pair. Uses the
equality tests' helpers (tests/unit/train/test_vectorized.py).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]

from test_vectorized import CostModel, loop, make_strategy, setup, small_cnn, train_cohort_vmap  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    for bn in ("train", "frozen"):
        model, info, costs, _, data = setup(lambda: small_cnn(width=16), 16, (160, 160, 160))
        costs = [CostModel(info, c.device, 16, "momentum", bn) for c in costs]
        common = dict(epochs=3, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode=bn)
        seeds = [[1, 1, i] for i in range(3)]

        def fresh():
            return [make_strategy("full", {}) for _ in range(3)]

        ref = loop(model, info, fresh(), costs, data, seeds, [0] * 3, **common)
        got = train_cohort_vmap(model, info, fresh(), costs, data, seeds=seeds, **common)
        perturbed = copy.deepcopy(model)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for p in perturbed.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=g))
        per = loop(perturbed, info, fresh(), costs, data, seeds, [0] * 3, **common)

        def diff(a_results, b_results) -> float:
            return max(
                float(np.abs(a.trained[k] - b.trained[k]).max())
                for a, b in zip(a_results, b_results)
                for k in a.trained
                if "running" not in k
            )

        print(f"bn_mode {bn}: {ref[0].steps} steps; vectorised vs loop {diff(ref, got):.1e}; "
              f"loop from weights perturbed by 1e-7 vs loop {diff(ref, per):.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
