"""Cost-model reach of an ElasticTrainer budget (TX2 kernel model, 32x32, batch 32, frozen norms, momentum).

    python benchmarks/reproduce/elastictrainer_accuracy/budget_reach.py

Per model: the forward share of a full step, the rho budget as a share of the full backward, the
earliest tensor (depth as a share of the tensors, 0 = the stem) a budget can train alone (its activation
gradient must reach it), and the earliest depth from which every tensor fits together. No training.
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models import build_with_input  # noqa: E402

MODELS = [("mobilenetv2", {"width_mult": 1.0}), ("mobilenetv2", {"width_mult": 0.5}), ("mcu_net", {"width": 32})]


def reach(name: str, opts: dict) -> dict:
    model, shape = build_with_input(name, num_classes=10, input_size=32, in_channels=3, **opts)
    info = describe(model, torch.zeros(1, *shape), model_name=name)
    tx2 = load_profile(ROOT / "device_profiles" / "jetson_tx2.toml")
    cost = CostModel(info, dataclasses.replace(tx2, measured={}), 32, optimizer="momentum", bn_mode="frozen")
    n, full = info.num_tensors, cost.full_step_time_s()
    backward = full - cost.forward_time_s
    alone = np.array([cost.backward_time_s(np.eye(n)[k]) for k in range(n)])
    suffix = np.array([cost.backward_time_s(np.r_[np.zeros(k), np.ones(n - k)]) for k in range(n)])
    out = {"params": sum(p.numel() for p in model.parameters()), "tensors": n,
           "forward_share": round(cost.forward_time_s / full, 3), "stem_alone_share": round(alone[0] / backward, 3)}  # fmt: skip
    for rho in (0.5, 0.4):
        budget = cost.backward_budget_s(rho)
        out[f"rho{rho}"] = {"budget_share": round(budget / backward, 3),
                            "earliest_alone": round(np.flatnonzero(alone <= budget).min() / n, 2),
                            "all_from": round(np.flatnonzero(suffix <= budget).min() / n, 2)}  # fmt: skip
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, opts in MODELS:
        print(name, opts, reach(name, opts), flush=True)
