"""Real steps as the ground truth of every time verdict under ``benchmarks/reproduce/`` (issue 41 section 2).

    python benchmarks/realsteps.py [--repeats 30] [--claims et,tinytrain,sparse] [--out benchmarks/results/realsteps.json]
    python benchmarks/realsteps.py --device cuda --out $OUT/realsteps_gpu.json      # the same pairs on a GPU

The reproduce folders price their selections with the cost model (emulated). Here the **same
selections** (made exactly as those folders make them, on the same device profile, importance or
Fisher draw 0) are applied to the real model, as the trainer applies them
(:class:`fedelastic.train.trainer._Applied`: unselected tensors frozen, norms in eval mode, channel masks),
and timed for real: zero_grad + forward + loss + backward + optimizer step (SGD with momentum 0.9).

* ``et``: ``elastic_tensor`` (ElasticTrainer), ``elastic_layer`` (Accelerated ElasticTrainer) and
  ``elastic_artifact`` (ElasticTrainer on its artifact's own prior) at rho 0.4 / 0.5 / 0.6 against
  ``full``, for ResNet-50, MobileNetV2 and ViT-B/16, selected on the ``jetson_tx2`` profile at 224x224,
  batch 4, 200 classes (``../reproduce/elastictrainer_time`` and ``../reproduce/accelerated_elastictrainer``).
* ``tinytrain``: TinyTrain's selection for MobileNetV2 at 224x224 on the Pi Zero 2 W (batch 1, 1 MiB
  budget, ``../reproduce/tinytrain/emulate.py``) against ``full``.
* ``sparse``: Sparse Update's scheme for ``mcu_net`` width 16 at 32x32 on the STM32F746 (256 KiB,
  ``../reproduce/sparse_update/emulate.py``) against ``full`` (no time verdict there; for completeness).

Each model's configurations are timed **interleaved**, round-robin, ``--repeats`` rounds after 2
warm-up rounds, so drift on the shared host hits them alike. Clock on the CPU: CPU time of the calling
thread (``time.thread_time``) with one torch thread (autograd then runs the CPU backward on the
caller, so this is the work done, robust to other jobs); on CUDA: CUDA events around the step. Each
pair's ratio is the geometric mean of the per-round ratios (paired: the same round) with a 95%
t-interval on their logarithms, and the median per-round ratio. The host's batch and input size are
in ``HOST`` (the papers' 224x224 where the 2-core host can time 30 rounds in minutes; ViT at 112);
a selection is a per-tensor mask, so it applies at any input size. On CUDA every model runs at
224x224, batch 4.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.models import build_with_input, describe_model  # noqa: E402
from fedelastic.selection.strategy import Selection, SelectionContext, make_strategy  # noqa: E402
from fedelastic.train.probes import ordered_params  # noqa: E402
from fedelastic.train.trainer import _Applied  # noqa: E402

RHOS = (0.4, 0.5, 0.6)
ELASTIC = ("elastic_tensor", "elastic_layer", "elastic_artifact")
ET_MODELS = ("resnet50", "mobilenetv2", "vit_b16")
#: (input size, batch) each model is timed at on the host CPU
HOST = {"resnet50": (224, 1), "mobilenetv2": (224, 1), "vit_b16": (112, 1), "mcu_net": (32, 1)}
GPU = (224, 4)
MOMENTUM = 0.9


# ----------------------------------------------------------------------------- timing


def step_once(model, x, y, opt, applied: _Applied, trains: bool) -> None:
    """One training step under an applied selection (forward only when nothing trains)."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    if trains:
        loss.backward()
        applied.step(opt)


def time_interleaved(
    model, info, selections: dict[str, Selection], x, y, *, repeats: int, warmup: int = 2, bn_mode: str = "frozen"
) -> dict[str, list[float]]:
    """Seconds per step of each selection, ``repeats`` interleaved rounds (round-robin) after ``warmup``.

    CPU tensors: the calling thread's CPU time (call with one torch thread); CUDA: CUDA events.
    """
    params = ordered_params(model, info)
    opt = torch.optim.SGD(params, lr=1e-5, momentum=MOMENTUM)
    modules = dict(model.named_modules())
    cuda = x.is_cuda
    samples: dict[str, list[float]] = {k: [] for k in selections}
    for r in range(warmup + repeats):
        for key, sel in selections.items():
            applied = _Applied(model, info, params, sel, bn_mode, modules)
            trains = bool(sel.mask.any())
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step_once(model, x, y, opt, applied, trains)
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.thread_time()
                step_once(model, x, y, opt, applied, trains)
                seconds = time.thread_time() - t0
            if r >= warmup:
                samples[key].append(seconds)
    for p in params:
        p.requires_grad_(True)
    model.train()
    return samples


def paired_ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """``num / den`` per round: geometric mean with a 95% t-interval on the log ratios, and the median."""
    logs = np.log(np.asarray(num)) - np.log(np.asarray(den))
    n = len(logs)
    half = stats.t.ppf(0.975, n - 1) * logs.std(ddof=1) / math.sqrt(n) if n > 1 else float("nan")
    mean = float(logs.mean())
    return {"ratio": math.exp(mean), "lo": math.exp(mean - half), "hi": math.exp(mean + half),
            "median": float(np.median(np.exp(logs))), "n": n}  # fmt: skip


# ----------------------------------------------------------------------------- the reproduce folders' selections


def _load(folder: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"rs_{folder}", ROOT / "benchmarks" / "reproduce" / folder / name)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def et_selections(model: str) -> tuple[dict, dict, CostModel, dict]:
    """ElasticTrainer / Accelerated ElasticTrainer / artifact selections on the TX2 (importance draw 0).

    Returns (model options, selections by key, the TX2 cost model, importance kept by key).
    """
    opts = {"num_classes": 200}
    info = describe_model(model, input_size=224, **opts)
    cost = CostModel(info, load_profile(ROOT / "device_profiles" / "jetson_tx2.toml"), 4, optimizer="momentum",
                     bn_mode="frozen")  # fmt: skip
    importance = np.random.default_rng(0).lognormal(0.0, 1.0, info.num_tensors)
    sels = {"full": Selection.from_mask(np.ones(info.num_tensors))}
    kept = {}
    for rho in RHOS:
        for strat in ELASTIC:
            ctx = SelectionContext(info, cost, 0, np.random.default_rng(0))
            ctx.importance = importance
            sel = make_strategy(strat, {"rho": rho}).select(ctx)
            sels[f"{strat}@{rho}"] = sel
            kept[f"{strat}@{rho}"] = float(importance[sel.mask].sum())
    return opts, sels, cost, kept


def tinytrain_selections() -> tuple[dict, dict, CostModel]:
    emulate = _load("tinytrain", "emulate.py")
    info, cost = emulate.setting("mobilenetv2", "raspberry_pi_zero_2w", 1)
    sel = make_strategy("tinytrain", {}).select(emulate.context(info, cost, 0))
    return {"num_classes": 5}, {"full": Selection.from_mask(np.ones(info.num_tensors)), "tinytrain": sel}, cost


def sparse_selections() -> tuple[dict, dict, CostModel]:
    emulate = _load("sparse_update", "emulate.py")
    info, cost = emulate.setting(32)
    sel = make_strategy("sparse_update", {}).select(SelectionContext(info, cost, 0, np.random.default_rng(0)))
    return {"num_classes": 5, "width": 16}, {"full": Selection.from_mask(np.ones(info.num_tensors)), "sparse_update": sel}, cost


# ----------------------------------------------------------------------------- one model


def run_model(name: str, claim: str, options: dict, sels: dict, cost: CostModel, pairs: list[tuple[str, str]],
              repeats: int, device: str) -> dict:  # fmt: skip
    """Time ``sels`` for real on ``name`` and report every ``(numerator, denominator)`` pair."""
    size, batch = GPU if device == "cuda" else HOST[name]
    torch.manual_seed(0)
    model, shape = build_with_input(name, input_size=size, **options)
    from fedelastic.modelinfo import describe

    info = describe(model, torch.zeros(1, *shape), model_name=name)
    model = model.to(device).train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=gen).to(device)
    y = torch.randint(0, options["num_classes"], (batch,), generator=gen).to(device)
    print(f"[{claim}/{name}] {len(sels)} configurations x {repeats} rounds at {size}x{size}, batch {batch}", flush=True)
    t0 = time.time()
    samples = time_interleaved(model, info, sels, x, y, repeats=repeats)
    rows = []
    for num, den in pairs:
        real = paired_ratio(samples[num], samples[den])
        emulated = cost.step_time_s(sels[num].ratios) / cost.step_time_s(sels[den].ratios)
        rows.append({"pair": f"{num} / {den}", "real": real, "emulated": emulated,
                     "real_ms": [1e3 * float(np.median(samples[num])), 1e3 * float(np.median(samples[den]))]})  # fmt: skip
    return {"claim": claim, "model": name, "input_size": size, "batch": batch, "selected_on": cost.device.name,
            "selected_batch": cost.batch_size, "wall_s": time.time() - t0, "pairs": rows,
            "median_ms": {k: 1e3 * float(np.median(v)) for k, v in samples.items()}}  # fmt: skip


def et_pairs() -> list[tuple[str, str]]:
    pairs = [(f"elastic_tensor@{r}", "full") for r in RHOS]  # step time ratio: 1 / speedup
    pairs += [(f"elastic_layer@{r}", f"elastic_tensor@{r}") for r in RHOS]
    pairs += [(f"elastic_layer@{r}", f"elastic_artifact@{r}") for r in RHOS]
    pairs += [(f"elastic_artifact@{r}", "full") for r in RHOS]
    return pairs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--claims", default="et,tinytrain,sparse", help="comma-separated: et, tinytrain, sparse")
    ap.add_argument("--models", default=",".join(ET_MODELS), help="the ElasticTrainer models to time")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--size", type=int, default=0, help="input size of every model on the CPU (default: HOST's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "realsteps.json"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to time (skipped)")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"skipped": "no CUDA device"}))
        return
    torch.set_num_threads(1)
    if args.size:
        HOST.update({k: (args.size, batch) for k, (_, batch) in HOST.items()})
    claims = args.claims.split(",")
    out = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "repeats": args.repeats,
           "clock": "CUDA events" if args.device == "cuda" else "thread CPU time, 1 torch thread",
           "torch": torch.__version__, "results": []}  # fmt: skip
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    start = time.time()
    jobs = {"tinytrain": (tinytrain_selections, "mobilenetv2", [("tinytrain", "full")]),
            "sparse": (sparse_selections, "mcu_net", [("sparse_update", "full")])}  # fmt: skip
    for claim in claims:
        for name in args.models.split(",") if claim == "et" else [jobs[claim][1]]:
            try:  # one claim's failure (say, on a new GPU stack) is recorded, the others still run
                if claim == "et":
                    options, sels, cost, kept = et_selections(name)
                    res = run_model(name, claim, options, sels, cost, et_pairs(), args.repeats, args.device)
                    res["importance_kept"] = kept
                else:
                    options, sels, cost = jobs[claim][0]()
                    res = run_model(name, claim, options, sels, cost, jobs[claim][2], args.repeats, args.device)
            except Exception as exc:  # noqa: BLE001
                print(f"[{claim}/{name}] failed: {exc!r}", flush=True)
                res = {"claim": claim, "model": name, "error": repr(exc), "pairs": []}
            out["results"].append(res)
    out["wall_s"] = time.time() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(out))


def table(doc: dict) -> str:
    """Markdown: per pair, the emulated and the real step-time ratio (and speedup) with its interval."""
    lines = ["| claim | model | pair (step time ratio) | emulated | real [95% CI] | real median | real speedup |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for res in doc["results"]:
        for row in res["pairs"]:
            r = row["real"]
            lines.append(f"| {res['claim']} | {res['model']} | {row['pair']} | {row['emulated']:.3f} | "
                         f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] | {r['median']:.3f} | {1 / r['ratio']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
