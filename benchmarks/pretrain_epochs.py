"""Pretraining: held-out accuracy, CPU time and wall time against epochs, in one run.

    .venv/bin/python benchmarks/pretrain_epochs.py [scenario.toml] [--epochs 30] [--batch-size 32 --lr 0.05]

Trains the scenario's ``[model.pretrain]`` source task as :func:`fedelastic.train.pretrain.pretrain` does
(its seed, optimizer and batches; ``simulation.torch_threads`` threads) and prints, at epochs 1, 2,
3, 5, 8, 10, 15, 20 and 30, the accuracy on the source task's *test* split, the process's CPU
seconds and the wall seconds so far. CPU seconds are what the code costs; on a shared machine the
wall is CPU / the share of a core the process gets.
"""

from __future__ import annotations

import argparse
import time

import torch

from fedelastic.environment import RunEnvironment
from fedelastic.scenario import load_scenario
from fedelastic.train.optim import SGD
from fedelastic.train.trainer import batches, evaluate_model, seed_everything, torch_threads

REPORT = (1, 2, 3, 5, 8, 10, 15, 20, 30, 40, 50)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?", default="simulations/adapt_rotated_mcu.toml")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=0, help="default: the scenario's")
    ap.add_argument("--lr", type=float, default=0.0, help="default: the scenario's")
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    cfg = sc.model.pretrain
    assert cfg is not None, f"{args.scenario} has no [model.pretrain] table"
    bs, lr = args.batch_size or cfg.batch_size, args.lr or cfg.lr
    env = RunEnvironment(sc)
    source = env.view(env.split[0], cfg.classes, cfg.transform)
    test = env.view(env.split[1], cfg.classes, cfg.transform)
    with torch_threads(sc.simulation.torch_threads):
        rng = seed_everything([sc.split_seed, 0x9E])
        model = env.new_model()
        opt = SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        x, y = torch.from_numpy(source.x), torch.from_numpy(source.y)
        per_epoch = -(-len(source) // bs)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        print(f"{sc.model.name}: {len(source)} source samples, batch {bs}, lr {lr}, "
              f"{sc.simulation.torch_threads} torch thread(s)")  # fmt: skip
        for step, idx in enumerate(batches(len(source), bs, args.epochs, rng)):
            model.train()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            epoch, end = divmod(step + 1, per_epoch)
            if end == 0 and epoch in REPORT:
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                accuracy, _ = evaluate_model(model, test.x, test.y)
                print(f"epoch {epoch:3d}: held-out accuracy {accuracy:.3f}  cpu {cpu:6.1f} s  wall {wall:6.1f} s",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
