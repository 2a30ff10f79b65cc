"""The held-out check of ``benchmarks/heldout.py`` on a GPU: kernels sampled and steps timed on CUDA.

    pip install --no-deps torchvision==0.28.0
    python benchmarks/heldout_gpu.py --out $OUT/heldout_gpu            # ~3 min on one H200
    python benchmarks/heldout_gpu.py --device cpu --sample-seconds 5 --models squeezenet1_1 --reps 1 --out /tmp/x  # dry run

On ``--device`` (default ``cuda``), every stamp waits for the device (``torch.cuda.synchronize``,
the ``cuda`` clock of :mod:`fedelastic.profiling.measure`): it samples the kernel classes for
``--sample-seconds`` (:func:`fedelastic.devices.kernelsample.sample_kernels`), fits the predictors,
calibrates their forward on resnet_small and mcu_net (:func:`fedelastic.profiling.commands.calibrate`, the
leave-one-model-out errors are the band), then runs the held-out torchvision models' four
selections for real (interleaved) and measures their per-layer tables, and writes
``heldout_gpu.json`` under ``--out`` with the same figures as ``heldout.py``. Without CUDA it
writes ``{"skipped": ...}`` and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from heldout import HELD_OUT, import_torchvision, median_uncertainty, real_step_times, selections, summary  # noqa: E402

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.kernelsample import fit_predictors  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models import build_with_input  # noqa: E402
from fedelastic.profiling.commands import calibrate  # noqa: E402
from fedelastic.profiling.measure import get_clock, measure_layers  # noqa: E402
from fedelastic.profiling.roofline_fit import _start_device  # noqa: E402

TUNING = ("resnet_small", "mcu_net")


def _total(t) -> float:
    return t.fwd_s + t.dx_s + t.dw_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for heldout_gpu.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sample-seconds", type=float, default=60.0)
    parser.add_argument("--models", nargs="*", default=list(HELD_OUT))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dest = args.out / "heldout_gpu.json"
    if args.device == "cuda" and not torch.cuda.is_available():
        dest.write_text(json.dumps({"skipped": "no CUDA device (torch.cuda.is_available() is False)"}))
        print("skipped: no CUDA")
        return 0
    dev = torch.device(args.device)
    clock_name = "cuda" if dev.type == "cuda" else "wall"
    clock = get_clock(clock_name)
    t_start = time.perf_counter()
    zoo = import_torchvision()
    from fedelastic.devices.kernelsample import sample_kernels

    samples = sample_kernels(args.sample_seconds, batch=8, clock=clock_name, device=str(dev), progress=print)
    predictors: dict = dict(fit_predictors(samples))
    pairs = []
    for name in TUNING:
        torch.manual_seed(0)
        model, shape = build_with_input(name)
        x = torch.randn(8, *shape)
        info = describe(model, x[:1], model_name=name)
        table = measure_layers(model.to(dev), x.to(dev), model_name=name, repeats=5, warmup=2, clock=clock_name)
        pairs.append((info, table))
    predictors["calibration"], tuning_errs = calibrate(predictors, pairs, print)
    band = float(np.sqrt(np.mean(np.square(tuning_errs))))
    device = dataclasses.replace(_start_device(1e12), sampled=predictors)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model = getattr(zoo, name)(weights=None)
        x = torch.randn(8, 3, 64, 64)
        y = torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(0))
        info = describe(model, x[:1], model_name=name)
        model, x, y = model.to(dev), x.to(dev), y.to(dev)
        sels = selections(info)
        real = real_step_times(model, info, x, y, sels, args.reps, clock)
        table = measure_layers(model, x, model_name=name, repeats=5, warmup=2, clock=clock_name)
        cost = CostModel(info, device, 8)
        rng = np.random.default_rng(0)
        names = [layer.name for layer in info.layers if layer.name in table.layers and layer.name in cost.measured.layers]
        pred = np.array([_total(cost.measured.layers[n]) for n in names])
        meas = np.array([_total(table.layers[n]) for n in names])
        rows.append({
            "model": name,
            "real_s": {k: float(np.median(v)) for k, v in real.items()},
            "real_median_rel_sd": {k: median_uncertainty(v, rng) for k, v in real.items()},
            "pred_s": {"sampled": {k: cost.step_time_s(r) for k, r in sels.items()}},
            "layer_err": {"sampled": (pred[meas > 0] / meas[meas > 0] - 1).tolist()},
        })  # fmt: skip
        print(name, {k: f"{rows[-1]['pred_s']['sampled'][k] / rows[-1]['real_s'][k] - 1:+.0%}" for k in sels}, flush=True)
        dest.write_text(json.dumps({"partial": True, "rows": rows}))
    res = {
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else str(dev),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "configurations": sum(map(len, samples.values())),
        "tuning_errors": dict(zip(TUNING, tuning_errs)),
        "calibration": predictors["calibration"],
        "summary": summary(rows, "sampled", band),
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
    }
    dest.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
