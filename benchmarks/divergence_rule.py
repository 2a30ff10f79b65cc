"""Choose the divergence rule from data: trace the detector's inputs on sound and broken runs, then
replay them through the rule before and after.

Every run goes to its end (``simulation.on_divergence = "continue"``) in-process, with the
detector's inputs of every round recorded (the train loss, the test loss, the weights' norm, the
trained and rejected clients, the predictions and labels per class). The traces are then fed to
the detector of a git revision (``--before``, default the last commit before the collapse rule
changed) and to the one installed now, and the false-positive rate (sound runs called diverged)
and false-negative rate (broken runs not called diverged) are written for each.

* **sound** runs: the shipped scenarios (two seeds, full size), the shipped comparison's settings
  (each fleet and strategy, two learning rates inside its grid), and short smoke runs like the
  trust review's scenario B (10 strategies, 2 and 8 steps, two fleets, sync and async, 4 seeds);
* **broken** runs, the trust work's: lr 0.5 with frozen BatchNorm, lr 50, a third of the images
  NaN (the loader's check turned off to let them in), a forward that returns NaN on half the
  training batches, and the asynchronous run whose test loss turned NaN for four rounds.

A run is counted broken, whatever its setting, when its trace holds a non-finite train loss, test
loss or weight norm (an asynchronous smoke run of the same scenario turns out so): a NaN is never
sound.

    python benchmarks/divergence_rule.py                 # trace (about 25 min on 2 cores), then replay
    python benchmarks/divergence_rule.py --replay-only   # replay the saved traces (seconds)
    python benchmarks/divergence_rule.py --only broken --merge   # re-trace some cases, keep the rest

Traces: ``benchmarks/results/divergence_traces.json.gz``; table: ``benchmarks/results/divergence_rule.json``.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRACES = RESULTS / "divergence_traces.json.gz"
TABLE = RESULTS / "divergence_rule.json"
BEFORE = "363ca27"  # main before the rule changed (collapse alone counted)

SMOKE = {  # scenario B of the trust review
    "data": {"dataset": "digits", "partitioner": "iid"},
    "model": {"name": "small_cnn"},
    "train": {"strategy": "full", "local_epochs": 1, "max_steps": 2},
    "server": {"rounds": 3},
    "simulation": {"backend": "inprocess"},
}
FLEETS = {"B": {"raspberry_pi_4": 2, "jetson_nano": 1}, "B4": {"raspberry_pi_4": 2, "jetson_nano": 1, "stm32h743": 1}}
STRATEGIES = [
    ("full", {}),
    ("elastic_tensor", {"rho": 0.4}),
    ("elastic_tensor", {"rho": 0.5}),
    ("static_elastic", {}),
    ("elastic_layer", {}),
    ("random_budget", {}),
    ("last_layer", {}),
    ("bn_bias", {}),
    ("tinytrain", {}),
    ("sparse_update", {}),
]


def merge(base: dict, **over) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in over.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) and key != "fleet" else value
    return out


def cases() -> list[dict]:
    """(name, label, scenario dict or shipped path, overrides, injected fault) of every traced run."""
    out: list[dict] = []
    for fleet_name, fleet in FLEETS.items():
        for strategy, options in STRATEGIES:
            for steps, rounds in ((2, 3), (8, 8)):
                for seed in range(4):
                    tag = f"{strategy}{options.get('rho', '')}"
                    raw = merge(SMOKE, fleet=fleet, seed=seed, train={"strategy": strategy, "options": options,
                                "max_steps": steps}, server={"rounds": rounds})
                    out.append({"name": f"smoke/{fleet_name}/{tag}/steps{steps}/s{seed}", "label": "sound", "raw": raw})
    for strategy in ("full", "static_elastic"):
        for seed in range(4):
            raw = merge(SMOKE, fleet=FLEETS["B4"], seed=seed, train={"strategy": strategy, "max_steps": 8},
                        server={"rounds": 8, "policy": "async", "concurrency": 2})
            out.append({"name": f"smoke/async/{strategy}/s{seed}", "label": "sound", "raw": raw})
    for path in sorted((ROOT / "simulations").glob("*.toml")):
        if path.stem == "compare_fleets":
            continue
        for seed in (0, 1):
            out.append({"name": f"shipped/{path.stem}/s{seed}", "label": "sound", "path": str(path),
                        "over": {"seed": seed, "simulation.backend": "inprocess"}})
    compare = ROOT / "simulations" / "compare_fleets.toml"
    fleets = {"gpu": {"jetson_tx2": 6, "jetson_nano": 6}, "mcu": {"stm32h743": 6, "stm32f746": 6}}
    for fleet_name, fleet in fleets.items():
        for strategy, options in (("full", {}), ("last_layer", {}), ("bn_bias", {}), ("elastic_tensor", {"rho": 0.4})):
            for lr in (0.03, 0.1):
                out.append({"name": f"study/compare_fleets/{fleet_name}/{strategy}/lr{lr}", "label": "sound",
                            "path": str(compare), "compare_base": True,
                            "over": {"fleet": fleet, "train.strategy": strategy, "train.options": options,
                                     "train.lr": lr}})
    # 15 rounds (30 at lr 0.5): at lr 0.5 with frozen statistics one seed predicts one class at a
    # flat loss for 11 rounds (indistinguishable from a slow start) before it blows up in round 12
    broken = merge(SMOKE, fleet=FLEETS["B4"], train={"max_steps": 8}, server={"rounds": 15})
    for seed in range(5):
        out.append({"name": f"broken/lr0.5_frozen/s{seed}", "label": "broken",
                    "raw": merge(broken, seed=seed, train={"lr": 0.5, "bn_mode": "frozen"}, server={"rounds": 30})})
        out.append({"name": f"broken/nan_data/s{seed}", "label": "broken", "raw": merge(broken, seed=seed),
                    "fault": "nan_data"})
        out.append({"name": f"broken/nan_forward/s{seed}", "label": "broken", "raw": merge(broken, seed=seed),
                    "fault": "nan_forward"})
    for seed in range(3):
        out.append({"name": f"broken/lr50_frozen/s{seed}", "label": "broken",
                    "raw": merge(broken, seed=seed, train={"lr": 50.0, "bn_mode": "frozen", "max_steps": 3})})
        # the fault scenario's async variant whose test loss turned NaN in rounds 3 to 6 (seed 3)
        fault = {"name": "tiny", "seed": 3 + seed, "fleet": FLEETS["B4"],
                 "data": {"partitioner": "dirichlet", "alpha": 0.5},
                 "model": {"name": "small_cnn", "options": {"width": 8}},
                 "train": {"strategy": "full", "batch_size": 16, "max_steps": 8},
                 "server": {"rounds": 8, "policy": "async", "concurrency": 2},
                 "simulation": {"backend": "inprocess"}}
        out.append({"name": f"broken/async_nan_test_loss/s{3 + seed}", "label": "broken", "raw": fault})
    return out


# ---- injected faults (in this process: the runs are in-process) ------------------------------------
def inject(fault: str | None):
    """Turn on ``fault``; returns a function that turns it off."""
    import torch

    if fault == "nan_data":
        import fedelastic.data.registry as registry

        real = registry.as_dataset
        check = getattr(registry, "check_finite", None)

        def nan_third(out, name, context="<scenario>"):
            from fedelastic.data import ArrayDataset

            ds = real(out, name, context)
            x = ds.x.copy()  # never the cached arrays: later runs would see the NaNs
            x[::3] = np.nan  # one image in three
            return ArrayDataset(x, ds.y)

        registry.as_dataset = nan_third
        if check is not None:
            registry.check_finite = lambda *a, **k: None

        def undo():
            registry.as_dataset = real
            if check is not None:
                registry.check_finite = check

        return undo
    if fault == "nan_forward":
        cls = torch.nn.Sequential  # small_cnn is one: a NaN output on half the training batches
        real_forward = cls.forward
        gen = torch.Generator().manual_seed(0)

        def forward(self, x):
            y = real_forward(self, x)
            if self.training and torch.rand((), generator=gen) < 0.5:
                y = y * float("nan")
            return y

        cls.forward = forward
        return lambda: setattr(cls, "forward", real_forward)
    return lambda: None


# ---- tracing -----------------------------------------------------------------------------------------
def trace(case: dict, out_dir: Path) -> dict:
    import fedelastic as fe
    from fedelastic.sim import divergence

    calls: list[dict] = []
    real = divergence.Detector.observe

    def observe(self, rnd, **kw):
        row = {"round": rnd, "classes": self.classes}
        for key, value in kw.items():
            row[key] = None if value is None else (np.asarray(value).tolist() if key in ("predicted", "actual") else value)
        calls.append(row)
        return real(self, rnd, **kw)

    divergence.Detector.observe = observe
    undo = inject(case.get("fault"))
    start = time.perf_counter()
    try:
        over = {"output_dir": str(out_dir), "simulation.on_divergence": "continue", **case.get("over", {})}
        if "raw" in case:
            scenario = fe.load({"name": case["name"].replace("/", "_"), **case["raw"]}, overrides=over)
        else:
            scenario = fe.load(case["path"], overrides=over)
        result = fe.run(scenario)
        status = result.status.get("status")
        rounds = result.rounds
        test_loss = [float(v) for v in rounds["test_loss"]]
    except Exception as exc:  # noqa: BLE001 (a run that failed is recorded, not hidden)
        status, test_loss = f"error: {type(exc).__name__}: {exc}", []
    finally:
        divergence.Detector.observe = real
        undo()
    return {**{k: case[k] for k in ("name", "label")}, "status": status, "wall_s": time.perf_counter() - start,
            "calls": calls, "test_loss": test_loss}


def load_compare_base(path: str) -> dict:
    """The shipped comparison's base scenario (its [compare] table left out), as a dict."""
    import tomllib

    raw = tomllib.loads(Path(path).read_text())
    raw.pop("compare", None)
    return raw


# ---- replay ------------------------------------------------------------------------------------------
def detector_module(rev: str | None):
    """fedelastic.sim.divergence at git revision ``rev`` (None: the installed one)."""
    if rev is None:
        from fedelastic.sim import divergence

        return divergence
    source = subprocess.run(["git", "show", f"{rev}:fedelastic/sim/divergence.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    spec = importlib.util.spec_from_loader(f"divergence_{rev}", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:fedelastic/sim/divergence.py", "exec"), module.__dict__)  # noqa: S102 (our own history)
    return module


def replay(module, run: dict, **settings) -> tuple[int, str] | None:
    """The first (round, reason) the detector of ``module`` reports on ``run``'s trace (None: none)."""
    det = module.Detector(**settings)
    for call in run["calls"]:
        det.classes = call["classes"]
        kw = {k: v for k, v in call.items() if k not in ("round", "classes")}
        for key in ("predicted", "actual"):
            if kw.get(key) is not None:
                kw[key] = np.asarray(kw[key])
        det.observe(call["round"], **kw)
        if det.first is not None:
            return det.first.round, det.first.reason
    return None


def non_finite(run: dict) -> bool:
    """Whether a train loss, test loss or weights' norm in ``run``'s trace is non-finite."""
    for call in run["calls"]:
        for key in ("test_loss", "train_loss", "norm"):
            value = call.get(key)
            if value is not None and not math.isfinite(value):
                return True
    return False


def label(run: dict) -> str:
    """'broken' for the broken settings and for any run whose trace holds a NaN or inf, else 'sound'."""
    return "broken" if run["label"] != "sound" or non_finite(run) else "sound"


def rates(module, runs: list[dict], **settings) -> dict:
    sound = [r for r in runs if label(r) == "sound"]
    broken = [r for r in runs if label(r) == "broken"]
    fp = [r["name"] for r in sound if replay(module, r, **settings) is not None]
    fn = [r["name"] for r in broken if replay(module, r, **settings) is None]
    return {"sound": len(sound), "false_positives": len(fp), "fp_rate": len(fp) / max(len(sound), 1),
            "broken": len(broken), "false_negatives": len(fn), "fn_rate": len(fn) / max(len(broken), 1),
            "fp_runs": fp, "fn_runs": fn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replay-only", action="store_true", help="replay the saved traces")
    ap.add_argument("--before", default=BEFORE, help="git revision of the rule before (default %(default)s)")
    ap.add_argument("--only", default="", help="trace only the cases whose name contains this")
    ap.add_argument("--traces", default=str(TRACES), help="the traces file (default %(default)s)")
    ap.add_argument("--table", default=str(TABLE), help="the table file (default %(default)s)")
    ap.add_argument("--merge", action="store_true", help="replace the traced cases in the traces file, keep the others")
    args = ap.parse_args()
    traces, table_path = Path(args.traces), Path(args.table)
    if not args.replay_only:
        todo = [c for c in cases() if args.only in c["name"]]
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, case in enumerate(todo):
                if case.get("compare_base"):
                    case = {**case, "raw": load_compare_base(case["path"])}
                    case["raw"]["name"] = "compare_fleets"
                    case["raw"]["fleet"] = case["over"].pop("fleet")
                run = trace(case, Path(tmp) / str(i))
                runs.append(run)
                print(f"[{i + 1}/{len(todo)}] {run['name']}: {run['status']} ({run['wall_s']:.1f} s)", flush=True)
        if args.merge and traces.exists():
            fresh_names = {r["name"] for r in runs}
            old = json.loads(gzip.decompress(traces.read_bytes()))
            runs = [r for r in old if r["name"] not in fresh_names] + runs
        traces.write_bytes(gzip.compress(json.dumps(runs).encode()))
    runs = json.loads(gzip.decompress(traces.read_bytes()))
    errors = [r["name"] for r in runs if str(r["status"]).startswith("error")]
    relabelled = [r["name"] for r in runs if r["label"] == "sound" and label(r) == "broken"]
    table = {
        "sound_settings_that_broke": relabelled,
        "date": time.strftime("%Y-%m-%d"),
        "runs": len(runs),
        "errored": errors,
        "before": {"rev": args.before, **rates(detector_module(args.before), runs)},
        "after": {"rev": "installed", **rates(detector_module(None), runs)},
        "sweep": {f"margin {m}, rounds {k}": {key: v for key, v in rates(
            detector_module(None), runs, collapse_margin=m, collapse_rounds=k).items() if key != "fn_runs" or v}
            for m in (0.0, 0.02, 0.05, 0.1, 0.25) for k in (1, 2, 3)},
    }
    table_path.write_text(json.dumps(table, indent=1))
    for side in ("before", "after"):
        t = table[side]
        print(f"{side:6s} ({t['rev']}): false positives {t['false_positives']}/{t['sound']} ({t['fp_rate']:.1%}), "
              f"false negatives {t['false_negatives']}/{t['broken']} ({t['fn_rate']:.1%})")
        for name in t["fp_runs"] + t["fn_runs"]:
            print(f"    {name}")
    for setting, t in table["sweep"].items():
        print(f"collapse {setting}: FP {t['false_positives']}/{t['sound']}, FN {t['false_negatives']}/{t['broken']}")
    if errors:
        print(f"{len(errors)} runs errored: {errors}", file=sys.stderr)


if __name__ == "__main__":
    main()
