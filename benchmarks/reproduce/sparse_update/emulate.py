"""Sparse Update's memory side, emulated by the cost model (no host training).

Peak training memory (int8 accounting, batch 1) of full, last layer, bias-only (``bn_bias``) and
``sparse_update`` (its own scheme under the budget) for ``mcu_net`` (width 16) on the ``stm32f746``
profile with 256 KiB of training memory, at 32x32 and at larger inputs (where it stops fitting).
Imported by ``run.py``; ``python benchmarks/reproduce/sparse_update/emulate.py`` prints it alone.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import Quantity, load_profile  # noqa: E402
from fedelastic.models import describe_model  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, make_strategy  # noqa: E402

BUDGET_KIB = 256
SIZES = (32, 64, 128)
ARMS = ("full", "last_layer", "bn_bias", "sparse_update")


def setting(size: int) -> tuple:
    """``(info, cost)``: ``mcu_net`` width 16 at ``size`` on the STM32F746 with 256 KiB, batch 1."""
    info = describe_model("mcu_net", num_classes=5, input_size=size, width=16)
    base = load_profile(ROOT / "device_profiles" / "stm32f746.toml")
    device = dataclasses.replace(base, memory_train_bytes=Quantity(BUDGET_KIB * 1024, "the paper's 256 KB"))
    return info, CostModel(info, device, 1, optimizer="momentum", bn_mode="frozen")


def one(size: int) -> dict:
    info, cost = setting(size)
    out = {"size": size, "budget_kib": BUDGET_KIB, "inference_kib": cost.peak_memory_bytes(np.zeros(info.num_tensors)) / 1024, "arms": {}}
    weights = [k for k, r in enumerate(info.tensor_roles) if r == "weight"]
    for arm in ARMS:
        ctx = SelectionContext(info, cost, 0, np.random.default_rng(0))
        sel = make_strategy(arm, {}).select(ctx)
        m = cost.memory(sel.ratios, sel.input_sparse)
        out["arms"][arm] = {
            "peak_kib": m.total_bytes / 1024,
            "fits": bool(m.total_bytes <= BUDGET_KIB * 1024),
            "tensors": int((sel.ratios > 0).sum()),
            "weights_trained": int(sum(sel.ratios[k] > 0 for k in weights)),
            "trained_params": float(sel.ratios @ info.tensor_numel),
            "note": ctx.note,
        }
    # full training priced without a budget (what it would need)
    out["arms"]["full"]["peak_kib"] = cost.peak_memory_bytes(np.ones(info.num_tensors)) / 1024
    out["arms"]["full"]["fits"] = bool(out["arms"]["full"]["peak_kib"] <= BUDGET_KIB)
    return out


def run() -> list[dict]:
    return [one(s) for s in SIZES]


def table(rows: list[dict]) -> str:
    lines = ["| input | inference KiB | " + " | ".join(f"{a}: KiB (fits 256?) / weights trained" for a in ARMS) + " |",
             "|---|---|" + "---|" * len(ARMS)]  # fmt: skip
    for r in rows:
        cells = [f"{a['peak_kib']:.0f} ({'yes' if a['fits'] else 'no'}) / {a['weights_trained']}" for a in r["arms"].values()]
        lines.append(f"| {r['size']}x{r['size']} | {r['inference_kib']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    rows = run()
    print(table(rows))
    for r in rows:
        print(r["size"], {a: v["note"] for a, v in r["arms"].items() if v["note"]})
