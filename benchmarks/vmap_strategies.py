"""Vectorised vs per-client training for the strategies with a Fisher probe or channel-sparse selections.

    python benchmarks/vmap_strategies.py --workload mcu --rounds 4                               # adapt_rotated_mcu's training (TinyTrain)
    python benchmarks/vmap_strategies.py --workload shipped --strategy sparse_update --rounds 4  # the shipped training, Sparse Update
    python benchmarks/vmap_strategies.py --workload shipped --strategy tinytrain --rounds 4

``benchmarks/vmap.py`` (its options and table: ``loop`` and ``vmap`` interleaved round by round)
with one more workload, ``mcu``: simulations/adapt_rotated_mcu.toml's training without its
pretraining (mcu_net from its seeded initial weights, so the selections are those of a fresh
model): 12 clients (6 stm32h743, 6 stm32f746, both int8 with QAS), all of them a round,
Dirichlet(0.5) digits rotated by 90 degrees, TinyTrain, 2 local epochs of batch 16, lr 0.05,
momentum 0.9, BatchNorm on batch statistics.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vmap  # noqa: E402

vmap.WORKLOADS["mcu"] = dict(
    clients=12, per_round=12,
    scenario={
        "fleet": {"stm32h743": 6, "stm32f746": 6},
        "data": {"dataset": "digits", "partitioner": "dirichlet", "alpha": 0.5, "transform": "rotate90", "test_fraction": 0.2},
        "model": {"name": "mcu_net"},
        "train": {"strategy": "tinytrain", "local_epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9,
                  "numerics": "device", "bn_mode": "train"},
    },
)  # fmt: skip

if __name__ == "__main__":
    if "--variants" not in sys.argv:
        sys.argv += ["--variants", "loop", "vmap"]  # the bare loop has no selections
    vmap.main()
