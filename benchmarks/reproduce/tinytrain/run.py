"""TinyTrain's claims: accuracy on few-shot cross-domain episodes (CPU, small), and memory, compute,
time and energy emulated on MobileNetV2 at 224x224 (``emulate.py``).

    python benchmarks/reproduce/tinytrain/run.py [--val-episodes 5] [--episodes 10] [--seeds 0 1 2]

Accuracy (the setting in ``../fewshot.py`` and the README): a pretrained ``mcu_net`` (digits 0-4,
clean) adapted to 5-way 10-shot episodes of digits 5-9 rotated 90 degrees (20 queries per class),
40 steps at batch 10, memory priced on ``stm32h743`` (512 KiB) at batch 1, norms folded into the
convs and a cosine prototype head (temperature 10; ``../fewshot.py``). Arms: none (prototype head),
full (does not fit: unconstrained host reference), last layer, Sparse Update and TinyTrain within the
budget. Each arm's lr: best of {1e-4, 1e-3, 1e-2} on the validation episodes, the grid widened past
the edge its pick sits at (up to ``--max-widen`` rates; a pick still at an edge is marked); then
``--episodes`` episodes per seed. Writes ``result.json`` beside this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fs = _load("fewshot", HERE.parent / "fewshot.py")
emulate = _load("tinytrain_emulate", HERE / "emulate.py")

SHOTS, QUERIES, STEPS, BATCH = 10, 20, 40, 10


def arms() -> list[dict]:
    dev = fs.mcu_device("stm32h743", None)  # 512 KiB
    base = {"device": dev, "profile": "stm32h743"}
    return [
        {"label": "none", "strategy": "none"},
        {"label": "full", "strategy": "full", "reference": True, **base},
        {"label": "last_layer", "strategy": "last_layer", "reference": True, **base},
        {"label": "sparse_update", "strategy": "sparse_update", **base},
        {"label": "tinytrain", "strategy": "tinytrain", **base},
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--val-episodes", type=int, default=5)
    ap.add_argument("--episodes", type=int, default=10, help="test episodes per seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pretrain-epochs", type=int, default=15)
    ap.add_argument("--max-widen", type=int, default=3, help="most rates added past the grid's edge per arm")
    ap.add_argument("--pretrain-device", default="cpu", help="where the backbone pretrains (cuda: seconds)")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes (one core each)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-emulation", action="store_true", help="the accuracy side only")
    ap.add_argument("--out", type=Path, default=HERE / "result.json")
    args = ap.parse_args(argv)
    start = time.time()
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)}}
    rows = emulate.run() if not args.skip_emulation else []
    doc["emulated"] = rows
    print(emulate.table(rows), flush=True)
    sweep = emulate.batch_sweep() if not args.skip_emulation else []
    doc["batch_sweep"] = sweep
    print(emulate.sweep_table(sweep), flush=True)
    if not args.skip_accuracy:
        d = fs.setup(args.pretrain_epochs, args.pretrain_device)
        doc["source_accuracy"] = d["source_accuracy"]
        print(f"pretrained mcu_net: source accuracy {d['source_accuracy']:.3f}", flush=True)

        def tasks(split: str, seed: int):
            if split == "val":
                keys = [100 + i for i in range(args.val_episodes)]
            else:
                keys = [1000 * (seed + 1) + i for i in range(args.episodes)]
            return [(*fs.episode(d, k, SHOTS, QUERIES), STEPS, BATCH, k) for k in keys]

        out = fs.tune_and_run_parallel(arms(), tasks, args.seeds, args.jobs, max_widen=args.max_widen)
        doc["accuracy"] = out
        doc["gains"] = {f"tinytrain - {b}": fs.gain(out, "tinytrain", b) for b in ("full", "last_layer", "sparse_update", "none")}
        print("\n| arm | lr (validation; edge: the widening limit bound) | query accuracy, mean ± 95% (3 seeds) | per seed | fits 512 KiB | peak KiB (batch 1) | diverged |")
        print("|---|---|---|---|---|---|---|")
        for label, g in out.items():
            print(f"| {label} | {fs.lr_cell(g)} | {g['mean']:.3f} ± {g['ci95']:.3f} | {[round(v, 3) for v in g['per_seed']]} | "
                  f"{'yes' if g['fits_device'] else 'no: ' + g['reason'][:80]} | {g['peak_memory_kib']:.0f} | {g['diverged']}/{g['n']} |")  # fmt: skip
        for k, v in doc["gains"].items():
            print(f"{k}: {v['mean']:+.1f} points [{v['lo']:+.1f}, {v['hi']:+.1f}]")
    doc["wall_s"] = time.time() - start
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out} in {doc['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
