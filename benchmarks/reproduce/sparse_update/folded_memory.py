"""The accuracy runs' memory side, re-derived without training: on the graph those runs train
(``mcu_net`` width 16, 32x32, 3 channels, norms folded into the convs, cosine head), each arm's
selection at batch 1 on ``stm32f746`` with its training memory set to the run's budget, priced by
the cost model with the frozen weights in flash (the profile's ``memory.flash``) and, for
comparison, with every weight in SRAM (the cost model before ``memory.flash``). The weights'
values do not enter: only the graph's shapes.

    python benchmarks/reproduce/sparse_update/folded_memory.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
_spec = importlib.util.spec_from_file_location("fewshot", HERE.parent / "fewshot.py")
fs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fs)  # type: ignore[union-attr]

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, make_strategy  # noqa: E402

CAPS = {"max_weight_layers": 8, "bias_last_k": 12}
VARIANTS = [  # (label, strategy, options, budget KiB)
    ("full", "full", {}, 256),
    ("last layer", "last_layer", {}, 256),
    ("bias-only (bn_bias)", "bn_bias", {}, 256),
    ("sparse_update, default caps", "sparse_update", {}, 256),
    ("sparse_update, default caps", "sparse_update", {}, 512),
    ("sparse_update, default caps", "sparse_update", {}, 1024),
    ("sparse_update, caps 8 / 12", "sparse_update", CAPS, 1024),
    ("sparse_update, caps 8 / 12", "sparse_update", CAPS, 256),
]


def folded_info():
    model, shape = fs.new_model()
    fs.fold_batchnorm(model)
    model[-1] = fs.CosineHead(model[-1], 10.0)
    return describe(model, torch.zeros(1, *shape), model_name="mcu_net")


def price(info, strategy: str, options: dict, budget_kib: float, flash: bool) -> dict:
    device = fs.mcu_device("stm32f746", budget_kib)
    if not flash:
        device = dataclasses.replace(device, memory_flash_bytes=None)
    cost = CostModel(info, device, 1, optimizer="momentum", bn_mode="frozen")
    sel = make_strategy(strategy, options).select(SelectionContext(info, cost, 0, np.random.default_rng(0)))
    if strategy == "full":
        sel_ratios, sparse = np.ones(info.num_tensors), None
    else:
        sel_ratios, sparse = sel.ratios, sel.input_sparse
    m = cost.memory(sel_ratios, sparse)
    weights = [k for k, r in enumerate(info.tensor_roles) if r == "weight"]
    return {
        "sram_kib": m.total_bytes / 1024,
        "flash_kib": m.flash_bytes / 1024,
        "fits": bool(cost.fits(sel_ratios, sparse)),
        "tensors": f"{int((sel_ratios[[k for k in range(info.num_tensors) if k not in weights]] > 0).sum())} other + "
        f"{int((sel_ratios[weights] > 0).sum())} weights",
        "tensor_share": float(np.mean(sel_ratios > 0)),
        "param_share": float(sel_ratios @ info.tensor_numel / info.tensor_numel.sum()),
    }


def main() -> None:
    info = folded_info()
    print(f"folded mcu_net: {info.num_params} parameters, {info.num_tensors} tensors")
    print("| arm | budget KiB | all weights in SRAM: peak KiB, fits, trained | frozen weights in flash: SRAM KiB, flash KiB, fits, trained |")
    print("|---|---|---|---|")
    for label, strategy, options, budget in VARIANTS:
        old = price(info, strategy, options, budget, flash=False)
        new = price(info, strategy, options, budget, flash=True)
        cell = lambda r: f"{r['fits'] and 'yes' or 'no'}, {r['tensors']} ({r['tensor_share']:.2f} / {r['param_share']:.2f})"  # noqa: E731
        print(f"| {label} | {budget} | {old['sram_kib']:.0f}, {cell(old)} | {new['sram_kib']:.0f}, {new['flash_kib']:.0f}, {cell(new)} |")


if __name__ == "__main__":
    main()
