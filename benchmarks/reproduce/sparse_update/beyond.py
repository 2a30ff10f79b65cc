"""Beyond the paper: where Sparse Update's "fits in 256 KB" stops holding across a heterogeneous fleet.

    python benchmarks/reproduce/sparse_update/beyond.py

For ``mcu_net`` (width 16, batch 1) at input sizes 16-64 on each device of a mixed fleet at its own
training memory (nRF52840 256 KiB, STM32F746 320 KiB, STM32H743 512 KiB, Raspberry Pi Zero 2 W,
Jetson Nano), the share of the model's parameters that ``sparse_update``'s scheme trains (0: the
forward alone does not fit, nothing trains) and whether full training fits. Emulated by the cost
model; writes ``beyond.png`` and ``beyond.json`` beside this file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.models import describe_model  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, make_strategy  # noqa: E402

DEVICES = ("nrf52840", "stm32f746", "stm32h743", "raspberry_pi_zero_2w", "jetson_nano")
SIZES = (16, 24, 32, 40, 48, 64)


def main() -> None:
    rows = []
    for size in SIZES:
        info = describe_model("mcu_net", num_classes=5, input_size=size, width=16)
        for name in DEVICES:
            device = load_profile(ROOT / "device_profiles" / f"{name}.toml")
            cost = CostModel(info, device, 1, optimizer="momentum", bn_mode="frozen")
            ctx = SelectionContext(info, cost, 0, np.random.default_rng(0))
            sel = make_strategy("sparse_update", {}).select(ctx)
            share = float(sel.ratios @ info.tensor_numel / info.tensor_numel.sum())
            fits = cost.peak_memory_bytes(sel.ratios, sel.input_sparse) <= device.memory_train_bytes.value
            rows.append({"size": size, "device": name, "memory_kib": device.memory_train_bytes.value / 1024,
                         "trained_share": share if fits else 0.0,
                         "full_fits": bool(cost.peak_memory_bytes(np.ones(info.num_tensors)) <= device.memory_train_bytes.value)})  # fmt: skip
    (HERE / "beyond.json").write_text(json.dumps(rows, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(rows)
    grid = df.pivot(index="device", columns="size", values="trained_share").loc[list(DEVICES)]
    full = df.pivot(index="device", columns="size", values="full_fits").loc[list(DEVICES)]
    labels = grid.map(lambda v: f"{100 * v:.1f}%") + full.map(lambda f: "\nfull fits" if f else "")
    fig, ax = plt.subplots(figsize=(8, 4))
    sns.heatmap(grid * 100, annot=labels, fmt="", cmap="viridis", cbar_kws={"label": "% of parameters Sparse Update trains"}, ax=ax)
    ax.set_xlabel("input size (pixels, square), mcu_net width 16, batch 1")
    ax.set_ylabel("device (its own training memory)")
    ax.set_title("Sparse Update across a mixed fleet (0%: nothing trainable fits the device)")
    fig.tight_layout()
    fig.savefig(HERE / "beyond.png", dpi=120)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
