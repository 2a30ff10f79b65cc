"""Which BatchNorm mode, learning rate, optimizer and schedule train the shipped models soundly.

    python benchmarks/settings_study.py [--setups a,b] [--out benchmarks/results/settings_study.json]

For each shipped model at its shipped scale (the setups below, each taken from a shipped scenario
with its own data, pretraining and batch size), it fine-tunes the scenario's starting weights
with the project's trainer (:func:`fedelastic.train.trainer.train_local`, strategy ``full``) over the
grid ``bn_mode`` in {frozen, train} x ``lr`` in {0.005, 0.01, 0.02, 0.05} x (optimizer, schedule) in
{(sgd, constant), (sgdw, cosine)}, momentum 0.9 and weight decay 5e-4 throughout, in two regimes:

* ``client``: one client's local training in the first round: the scenario's partition 0 (at
  most 256 samples), 2 epochs at the scenario's batch size;
* ``central``: the pooled training split of the target task (at most ``--central-cap``
  samples), 5 one-epoch calls (the optimizer state restarts each call, as in federated rounds).

Each run reports the test accuracy (the scenario's test set of the target task), the train loss
of each call, and ``diverged``: a non-finite loss or weight, or a test loss above 10x the starting
model's. The starting weights are the scenario's own (its cached pretrain, or the factory's
initialisation). Written to ``--out`` as JSON, with a markdown table printed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic import api  # noqa: E402
from fedelastic.config import read_toml  # noqa: E402
from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.environment import environment  # noqa: E402
from fedelastic.selection.strategy import make_strategy  # noqa: E402
from fedelastic.train.pretrain import initial_state  # noqa: E402
from fedelastic.train.trainer import LocalTraining, evaluate_model, train_local  # noqa: E402

# name -> (scenario file, overrides, what ships it)
SETUPS = {
    "small_cnn_digits_new_classes": (
        "simulations/adapt_new_classes.toml",
        {},
        "adapt_new_classes, compare_fleets, deadline_elastic",
    ),
    "mcu_net_digits_rotated": ("simulations/adapt_rotated_mcu.toml", {}, "adapt_rotated_mcu"),
    "mcu_net_digits_new_classes": ("benchmarks/strategy_study.toml", {}, "strategy_study, continual_study"),
    "small_cnn_w8_synth_new_classes": ("simulations/continual_classes.toml", {}, "continual_classes"),
    "small_cnn_w8_synth_clean": ("simulations/single_device.toml", {}, "single_device, continual_domain"),
    "small_cnn_digits_scratch": ("simulations/quickstart.toml", {}, "quickstart (no pretraining)"),
}
BN_MODES = ("frozen", "train")
LRS = (0.005, 0.01, 0.02, 0.05)
OPTIMS = (("sgd", "constant"), ("sgdw", "cosine"))
COST_DEVICE = "jetson_tx2"  # prices steps only; every selection fits its memory


def finite_model(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in model.state_dict().values() if v.is_floating_point())


def fine_tune(env, state, data, test, *, bn_mode, lr, optimizer, schedule, calls, epochs, seed) -> dict:
    """``calls`` calls of train_local (``epochs`` each) from ``state``; accuracy and loss after each."""
    sc = env.scenario
    model = env.new_model()
    model.load_state_dict(state)
    cost = CostModel(env.info, env.profile(COST_DEVICE), sc.train.batch_size, "momentum", bn_mode)
    start_acc, start_loss = evaluate_model(model, test.x, test.y)
    losses, accs = [], []
    diverged = False
    for call in range(calls):
        strategy = make_strategy("full", {})
        res = train_local(
            model,
            env.info,
            strategy,
            cost,
            data,
            LocalTraining(
                epochs=epochs,
                batch_size=sc.train.batch_size,
                lr=lr,
                momentum=0.9,
                weight_decay=5e-4,
                bn_mode=bn_mode,
                optimizer=optimizer,
                lr_schedule=schedule,
            ),
            seed=[seed, call],
        )
        losses.append(res.train_loss)
        if not math.isfinite(res.train_loss) or not finite_model(model):
            diverged = True
            accs.append(float("nan"))
            break
        acc, loss = evaluate_model(model, test.x, test.y)
        accs.append(acc)
        if not math.isfinite(loss) or loss > 10 * max(start_loss, 1.0):
            diverged = True
            break
    final = accs[-1] if accs and not diverged else float("nan")
    return {
        "start_accuracy": start_acc, "start_test_loss": start_loss, "train_losses": losses, "accuracies": accs,
        "final_accuracy": final, "diverged": diverged,
    }  # fmt: skip


def run_setup(name: str, central_cap: int, calls: int) -> list[dict]:
    path, overrides, ships = SETUPS[name]
    raw = read_toml(ROOT / path, "scenario")
    raw.pop("compare", None)  # a comparison file: its base scenario
    raw["train"] = {**raw.get("train", {}), "strategy": "full", "options": {}}
    sc = api.load(raw, overrides)
    env = environment(sc)
    t0 = time.perf_counter()
    state = initial_state(env)  # the scenario's own (cached) pretrain
    pretrain_s = time.perf_counter() - t0
    test = env.data.test
    rng = np.random.default_rng(0)
    client = env.data.client(0)
    if len(client) > 256:
        client = client.subset(np.sort(rng.choice(len(client), 256, replace=False)))
    pooled = env.data.train
    if len(pooled) > central_cap:
        pooled = pooled.subset(np.sort(rng.choice(len(pooled), central_cap, replace=False)))
    rows = []
    for regime, data, n_calls, epochs in (("client", client, 1, 2), ("central", pooled, calls, 1)):
        for bn_mode in BN_MODES:
            for optimizer, schedule in OPTIMS:
                for lr in LRS:
                    t = time.perf_counter()
                    got = fine_tune(
                        env, state, data, test, bn_mode=bn_mode, lr=lr, optimizer=optimizer, schedule=schedule,
                        calls=n_calls, epochs=epochs, seed=sc.seed,
                    )  # fmt: skip
                    row = {
                        "setup": name, "scenario": path, "ships_in": ships, "model": sc.model.name,
                        "pretrained": sc.model.pretrain is not None, "regime": regime, "samples": len(data),
                        "batch_size": sc.train.batch_size, "bn_mode": bn_mode, "lr": lr, "optimizer": optimizer,
                        "schedule": schedule, "chance": 1 / env.num_classes, "wall_s": time.perf_counter() - t, **got,
                    }  # fmt: skip
                    rows.append(row)
                    flag = "DIVERGED" if got["diverged"] else f"{got['final_accuracy']:.3f}"
                    print(
                        f"{name:32s} {regime:7s} {bn_mode:6s} {optimizer}/{schedule:8s} lr {lr:<6} -> {flag}",
                        flush=True,
                    )
    print(f"{name}: starting weights in {pretrain_s:.1f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per (setup, regime, optimizer), final accuracy per (bn_mode, lr); 'div' = diverged."""
    head = "| setup | regime | optimizer | " + " | ".join(f"{bn} {lr}" for bn in BN_MODES for lr in LRS) + " |"
    lines = [head, "|" + "---|" * (3 + len(BN_MODES) * len(LRS))]
    keys = sorted(
        {(r["setup"], r["regime"], r["optimizer"], r["schedule"]) for r in rows},
        key=lambda k: (list(SETUPS).index(k[0]), k[1] != "client", k[2]),
    )
    for setup, regime, opt, sched in keys:
        cells = []
        for bn in BN_MODES:
            for lr in LRS:
                (r,) = [
                    x
                    for x in rows
                    if (x["setup"], x["regime"], x["optimizer"], x["bn_mode"], x["lr"]) == (setup, regime, opt, bn, lr)
                ]
                cells.append("div" if r["diverged"] else f"{r['final_accuracy']:.3f}")
        lines.append(f"| {setup} | {regime} | {opt}/{sched} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma-separated setups (default: all)")
    ap.add_argument("--central-cap", type=int, default=3000, help="most pooled samples in the central regime")
    ap.add_argument("--calls", type=int, default=5, help="one-epoch calls in the central regime")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "settings_study.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    names = args.setups.split(",")
    # rows of other setups already in --out are kept: setups can be run (or rerun) a few at a time
    rows = [r for r in json.loads(out.read_text())["rows"] if r["setup"] not in names] if out.exists() else []
    for name in names:
        rows.extend(run_setup(name, args.central_cap, args.calls))
        md = table(rows)
        doc = {
            "command": "python benchmarks/settings_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": platform.node(), "torch": torch.__version__, "threads": 1, "table": md, "rows": rows,
        }  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=float))  # after each setup
    print(md)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
