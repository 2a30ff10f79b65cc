"""Sparse Update's claims: training fits 256 KB (emulated, ``emulate.py``) with accuracy close to full
fine-tuning and above last layer and bias-only (a small transfer run on CPU).

    python benchmarks/reproduce/sparse_update/run.py [--seeds 0 1 2] [--steps 200] [--pretrain-epochs 15]
        [--lrs 1e-3 1e-2 0.1] [--arms full last_layer bn_bias sparse_update] [--budget-kib 256]
        [--strategy-option KEY=VALUE ...]

Accuracy (setting in ``../fewshot.py`` and the README): the pretrained ``mcu_net`` (digits 0-4, clean)
transferred to digits 5-9 rotated 90 degrees: per seed, 100 training and 100 test images per class
drawn afresh (validation: 50 per class, seed 100), 200 steps at batch 10 (4 epochs), memory priced on
``stm32f746`` set to 256 KiB at batch 1. Arms: full and bn_bias (do not fit: unconstrained host
references), last layer and sparse_update within the budget. Writes ``result.json`` beside this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fs = _load("fewshot", HERE.parent / "fewshot.py")
emulate = _load("sparse_update_emulate", HERE / "emulate.py")

TRAIN, VAL, TEST, STEPS, BATCH = 100, 50, 100, 200, 10
LRS = (1e-3, 1e-2, 1e-1)  # README: the stated grid {0.01, 0.03, 0.1} moved down a decade after the few-shot collapse


def split(d: dict, seed: int, n_test: int) -> tuple[tuple, tuple]:
    rng = np.random.default_rng(seed)
    tr, te = [], []
    for c in range(fs.WAYS):
        idx = rng.permutation(np.flatnonzero(d["tgt_y"] == c))
        tr.append(idx[:TRAIN])
        te.append(idx[TRAIN : TRAIN + n_test])
    tr, te = np.concatenate(tr), np.concatenate(te)
    return (d["tgt_x"][tr], d["tgt_y"][tr]), (d["tgt_x"][te], d["tgt_y"][te])


def arms(budget_kib: float = emulate.BUDGET_KIB, options: dict | None = None) -> list[dict]:
    """The arms; ``options`` go to the ``sparse_update`` strategy's config (none: its defaults)."""
    base = {"device": fs.mcu_device("stm32f746", budget_kib), "profile": "stm32f746"}
    return [
        {"label": "full", "strategy": "full", "reference": True, **base},
        {"label": "last_layer", "strategy": "last_layer", "reference": True, **base},
        {"label": "bn_bias", "strategy": "bn_bias", "reference": True, **base},
        {"label": "sparse_update", "strategy": "sparse_update", "options": dict(options or {}), **base},
    ]


def strategy_option(text: str) -> tuple[str, object]:
    """Parse ``KEY=VALUE``; VALUE is read as JSON (``8``, ``0.5``, ``[0.25, 1]``), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def untrained_head(group: dict, seeds: list[int]) -> dict:
    """Per seed, the test accuracy of the prototype head before any step (each run's ``before``)."""
    return {"per_seed": [float(np.mean([r["before"] for r in group["runs"] if r["seed_group"] == s])) for s in seeds]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per run (batch 10)")
    ap.add_argument("--pretrain-epochs", type=int, default=15)
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="the validation lr grid")
    ap.add_argument("--arms", nargs="+", default=[a["label"] for a in arms()], help="the arms to run")
    ap.add_argument(
        "--budget-kib",
        type=float,
        default=emulate.BUDGET_KIB,
        help="the accuracy arms' device training memory in KiB (the emulated table stays at 256)",
    )
    ap.add_argument(
        "--strategy-option",
        type=strategy_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the sparse_update strategy's config (repeatable; e.g. max_weight_layers=8)",
    )
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-emulation", action="store_true", help="the accuracy side only")
    ap.add_argument("--out", type=Path, default=HERE / "result.json")
    args = ap.parse_args(argv)
    start = time.time()
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)}}
    rows = emulate.run() if not args.skip_emulation else []
    doc["emulated"] = rows
    print(emulate.table(rows), flush=True)
    if not args.skip_accuracy:
        d = fs.setup(args.pretrain_epochs)
        doc["source_accuracy"] = d["source_accuracy"]
        print(f"pretrained mcu_net: source accuracy {d['source_accuracy']:.3f}", flush=True)

        def tasks(kind: str, seed: int):
            if kind == "val":
                return [(*split(d, 100, VAL), args.steps, BATCH, 100)]
            return [(*split(d, seed, TEST), args.steps, BATCH, seed)]

        out = fs.tune_and_run(
            [a for a in arms(args.budget_kib, dict(args.strategy_option)) if a["label"] in args.arms],
            tasks,
            args.seeds,
            lrs=tuple(args.lrs),
        )
        doc["accuracy"] = out
        doc["gains"] = {f"sparse_update - {b}": fs.gain(out, "sparse_update", b) for b in ("full", "last_layer", "bn_bias")
                        if "sparse_update" in out and b in out}  # fmt: skip
        doc["untrained_head"] = untrained_head(next(iter(out.values())), args.seeds)
        for label in out:
            doc["gains"][f"{label} - untrained head"] = fs.gain(
                {label: out[label], "none": doc["untrained_head"]}, label, "none"
            )
        print(f"untrained prototype head: per seed {[round(v, 3) for v in doc['untrained_head']['per_seed']]}")
        print(
            f"\n| arm | lr (validation) | test accuracy, mean ± 95% ({len(args.seeds)} seeds) | per seed | fits {args.budget_kib:g} KiB | trained share | peak KiB (batch 1) | diverged |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for label, g in out.items():
            print(f"| {label} | {g['lr']:g} | {g['mean']:.3f} ± {g['ci95']:.3f} | {[round(v, 3) for v in g['per_seed']]} | "
                  f"{'yes' if g['fits_device'] else 'no: ' + g['reason'][:80]} | {g['trained_fraction']:.2f} | {g['peak_memory_kib']:.0f} | {g['diverged']}/{g['n']} |")  # fmt: skip
        for k, v in doc["gains"].items():
            print(f"{k}: {v['mean']:+.1f} points [{v['lo']:+.1f}, {v['hi']:+.1f}]")
    doc["wall_s"] = time.time() - start
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out} in {doc['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
