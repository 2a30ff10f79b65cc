"""TinyTrain's memory, compute, time and energy side, emulated by the cost model (no host training).

Imported by ``run.py``; ``python benchmarks/reproduce/tinytrain/emulate.py`` prints it alone.
See the README beside this file for the setting and the tolerances.
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

MODELS = {"mobilenetv2": {"input_size": 224, "num_classes": 5}, "mcu_net": {"input_size": 32, "num_classes": 5, "width": 16}}
DEVICES = ("raspberry_pi_zero_2w", "jetson_nano")
BATCHES = (1, 25)
STEPS = 40  # an episode: 40 training steps
BUDGET_BYTES = 1024 * 1024  # TinyTrain's backward budget: 1 MiB on top of inference


def backward_bytes(cost: CostModel, ratios: np.ndarray) -> float:
    m = cost.memory(ratios)
    return float(m.activations_bytes + m.gradients_bytes + m.optimizer_bytes)


def setting(model: str, device_name: str, batch: int) -> tuple:
    """``(info, cost)``: ``model`` on the device with TinyTrain's budget, inference + 1 MiB."""
    info = describe_model(model, **MODELS[model])
    base = load_profile(ROOT / "device_profiles" / f"{device_name}.toml")
    probe_cost = CostModel(info, base, batch, optimizer="momentum", bn_mode="frozen")
    inference = probe_cost.peak_memory_bytes(np.zeros(info.num_tensors))
    device = dataclasses.replace(base, memory_train_bytes=Quantity(inference + BUDGET_BYTES, "inference + 1 MiB"))
    return info, CostModel(info, device, batch, optimizer="momentum", bn_mode="frozen")


def context(info, cost, seed: int) -> SelectionContext:
    """A selection context with seed ``seed``'s per-channel Fisher (log-normal) on every conv and linear layer."""
    rng = np.random.default_rng(seed)
    ctx = SelectionContext(info, cost, 0, rng)
    ctx.fisher = {li: rng.lognormal(0.0, 1.0, info.layers[li].out_channels or 1)
                  for li, layer in enumerate(info.layers) if layer.kind in ("conv", "linear")}  # fmt: skip
    return ctx


def one(model: str, device_name: str, batch: int, seeds: int) -> dict:
    info, cost = setting(model, device_name, batch)
    full = np.ones(info.num_tensors)
    fwd_macs = cost.step_macs(np.zeros(info.num_tensors))
    t_full = cost.step_time_s(full)
    e_full = cost.energy_j(STEPS * t_full, 0, 0, STEPS * cost.step_macs(full))
    rows = []
    for seed in range(seeds):
        ctx = context(info, cost, seed)
        before = cost.evaluations
        sel = make_strategy("tinytrain", {}).select(ctx)
        overhead = cost.probe_time_s("fisher") + cost.selector_time_s(cost.evaluations - before, ctx.ops)
        t_sel = cost.step_time_s(sel.ratios)
        episode = STEPS * t_sel + overhead
        rows.append({
            "seed": seed,
            "trained_fraction": float((sel.ratios * info.tensor_numel).sum() / info.tensor_numel.sum()),
            "layers": int(len({int(info.tensor_layer[k]) for k in np.flatnonzero(sel.ratios)})),
            "backward_mem_ratio": backward_bytes(cost, full) / max(backward_bytes(cost, sel.ratios), 1.0),
            "backward_kib": backward_bytes(cost, sel.ratios) / 1024,
            "backward_macs_ratio": (cost.step_macs(full) - fwd_macs) / max(cost.step_macs(sel.ratios) - fwd_macs, 1.0),
            "step_speedup": t_full / t_sel,
            "episode_speedup": STEPS * t_full / episode,
            "energy_ratio": e_full / cost.energy_j(episode, 0, 0, STEPS * cost.step_macs(sel.ratios)),
            "overhead_share": overhead / episode,
        })  # fmt: skip
    agg = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if k != "seed"}
    return {"model": model, "device": device_name, "batch": batch, "full_backward_mib": backward_bytes(cost, full) / 2**20,
            "forward_share": cost.forward_time_s / t_full, "full_step_s": t_full, **agg, "per_seed": rows}  # fmt: skip


def run(seeds: int = 5) -> list[dict]:
    return [one(m, d, b, seeds) for m in MODELS for d in DEVICES for b in BATCHES]


def table(rows: list[dict]) -> str:
    lines = ["| model | device | batch | full backward MiB | TinyTrain backward KiB | backward memory, full / TinyTrain | "
             "backward MACs, full / TinyTrain | forward share of a full step | step speedup | episode speedup (probe incl.) | energy, full / TinyTrain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['model']} | {r['device']} | {r['batch']} | {r['full_backward_mib']:.1f} | {r['backward_kib']:.0f} | "
                     f"{r['backward_mem_ratio']:.0f}x | {r['backward_macs_ratio']:.1f}x | {r['forward_share']:.2f} | "
                     f"{r['step_speedup']:.2f}x | {r['episode_speedup']:.2f}x | {r['energy_ratio']:.2f}x |")  # fmt: skip
    return "\n".join(lines)



def batch_sweep(batches=(1, 2, 4, 8, 16, 25), seeds: int = 3) -> list[dict]:
    """Ablation: the backward-memory ratio of MobileNetV2 at 224x224 on the Pi Zero 2 W as the batch grows."""
    return [one("mobilenetv2", "raspberry_pi_zero_2w", b, seeds) for b in batches]


def sweep_table(rows: list[dict]) -> str:
    lines = ["| batch | full backward MiB | TinyTrain backward KiB | ratio | trained share of parameters | layers trained |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['batch']} | {r['full_backward_mib']:.0f} | {r['backward_kib']:.0f} | {r['backward_mem_ratio']:.0f}x | "
                     f"{r['trained_fraction']:.4f} | {r['layers']:.1f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()))
    print(sweep_table(batch_sweep()))
