"""Beyond the paper: where TinyTrain's compute claim (7.4x fewer backward MACs) stops paying across a fleet.

    python benchmarks/reproduce/tinytrain/beyond.py [--cached-only]

``tinytrain`` (its defaults: the device's whole training memory, 30% of full's backward MACs)
against ``full`` in fedelastic's own simulation (in-process), along the four axes of
``../beyond_common.py``: half of a TX2 fleet replaced by MCUs; a round deadline (``deadline_drop``)
on TX2s and Nanos; Dirichlet non-IID clients; a continual rotation shift. Each panel plots full's
figure over TinyTrain's: the round clock, and where accuracy matters the simulated time to 0.6 test
accuracy or to recover 90% of the pre-shift accuracy; the fleet panel adds the backward MACs per
step of a TX2 client (training MACs less the forward, from the run's ``emulated_macs``). One seed;
runs are cached in ``runs/beyond/cache`` (``full``'s are shared with the ElasticTrainer figure);
writes ``beyond.json`` and ``beyond.png`` beside this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import beyond_common as bc  # noqa: E402

ARM, SHORT = "tinytrain", "TinyTrain"
MACS, STEP, FLOOR = 7.4, 2.4, 1.5  # single device: backward MACs (MobileNetV2) and step speedup (mcu_net, Nano)


def forward_macs_per_step() -> float:
    """Forward MACs of one training step of ``BASE``'s model and batch (the part every selection pays)."""
    from fedelastic.cost.costmodel import CostModel
    from fedelastic.devices.profile import load_profile
    from fedelastic.models import describe_model

    info = describe_model("mcu_net", num_classes=10, input_size=32, width=bc.BASE["model"]["options"]["width"])
    device = load_profile(bc.ROOT / "device_profiles" / "jetson_tx2.toml")
    return CostModel(info, device, bc.BASE["train"]["batch_size"]).step_macs(np.zeros(info.num_tensors))


def backward_macs(summary: dict, device: str, forward: float) -> float:
    d = summary["devices"][device]
    return d["mean_macs"] / d["mean_steps"] - forward if d["mean_steps"] > 0 else float("nan")


def main() -> None:
    bc.CACHED_ONLY = "--cached-only" in sys.argv[1:]
    panels, runs = bc.panels_for(ARM, SHORT)
    forward = forward_macs_per_step()
    fleet = runs["mcu_next_to_jetson"]
    panels[0]["series"][f"TX2 client's backward MACs per step, full / {SHORT}"] = [
        bc.value_ratio(fleet[x]["full"], fleet[x][ARM], lambda s: backward_macs(s, "jetson_tx2", forward))
        for x in fleet
    ]
    bc.write(HERE, "beyond", {"arm": ARM, "claim_backward_macs": MACS, "single_device_step": STEP, "floor": FLOOR,
                              "target": bc.TARGET, "forward_macs_per_step": forward, "base": bc.BASE, "arms": bc.ARMS,
                              "panels": panels, "runs": runs})  # fmt: skip
    bc.plot_panels(
        panels, HERE / "beyond.png", "TinyTrain against full across a fleet",
        {"single device, backward MACs": MACS, "single device, step": STEP}, FLOOR, "full / TinyTrain (x less)",
    )  # fmt: skip
    bc.print_panels(panels)


if __name__ == "__main__":
    main()
