"""The importance probe amortised over its re-selection interval, across federated rounds.

    python benchmarks/probe_amortisation.py [--rounds 8] [--steps 4,46]

ElasticTrainer (``elastic_tensor``, rho 0.5, the artifact's interval of 4 epochs) trains a small
MobileNetV2 (width 0.35, 32x32, 10 classes) on the Jetson TX2's cost model, one local epoch of
``steps`` steps a round, the strategy's state handed from round to round as the client keeps it
("carried"), or dropped so that every round starts with a probe ("fresh", how rounds ran before
the interval ran across them). A probe costs about two full steps, so the training clock's ratio
to ``full`` is predicted at ``rho + 2 / steps_per_probe``. Prints one row per (steps, mode).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from fedelastic.cost.costmodel import CostModel
from fedelastic.data import ArrayDataset
from fedelastic.devices.profile import get_profile
from fedelastic.modelinfo import describe
from fedelastic.models.mobilenetv2 import mobilenetv2
from fedelastic.selection.strategy import make_strategy
from fedelastic.train.trainer import LocalTraining, train_local

RHO, BATCH = 0.5, 16


def clock(model, info, cost, data, name: str, options: dict, rounds: int, carried: bool) -> dict:
    start = {k: v.clone() for k, v in model.state_dict().items()}
    state: dict = {}
    time = probe = 0.0
    steps = probes = 0
    for r in range(rounds):
        strategy = make_strategy(name, options)
        if carried:
            strategy.load_state(state)
        result = train_local(
            model, info, strategy, cost, data, LocalTraining(epochs=1, batch_size=BATCH, lr=0.01), seed=r
        )
        state = strategy.state()
        time, probe = time + result.train_time_s, probe + result.probe_time_s
        steps, probes = steps + result.steps, probes + result.probes
    model.load_state_dict(start)
    return {"time": time, "probe": probe, "steps": steps, "probes": probes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", default="4,46", help="steps per round (one local epoch), comma-separated")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = mobilenetv2(0.35, num_classes=10, input_size=32, dropout=0.0)
    info = describe(model, torch.zeros(1, 3, 32, 32), "mobilenetv2")
    cost = CostModel(info, get_profile("jetson_tx2"), BATCH)
    print(f"mobilenetv2 width 0.35, 32x32: {info.num_params:,} parameters; jetson_tx2, batch {BATCH}, rho {RHO}")
    print("| steps/round | mode | probes | steps/probe | probe share | clock / full | rho + 2/steps_per_probe |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for steps in (int(s) for s in args.steps.split(",")):
        n = steps * BATCH
        data = ArrayDataset(rng.standard_normal((n, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, n))
        full = clock(model, info, cost, data, "full", {}, args.rounds, True)
        for carried in (True, False):
            got = clock(model, info, cost, data, "elastic_tensor", {"rho": RHO}, args.rounds, carried)
            per_probe = got["steps"] / max(got["probes"], 1)
            print(
                f"| {steps} | {'carried' if carried else 'fresh'} | {got['probes']} | {per_probe:.0f} | "
                f"{got['probe'] / got['time']:.3f} | {got['time'] / full['time']:.3f} | {RHO + 2 / per_probe:.3f} |"
            )


if __name__ == "__main__":
    main()
