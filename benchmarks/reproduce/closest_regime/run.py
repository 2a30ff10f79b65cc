"""The closest regime to ImageNet -> CUB buildable here: a backbone pretrained for real on many images,
transferred to classes it never saw, with the seven strategies of the seed papers, 5 seeds each.

    python benchmarks/reproduce/closest_regime/run.py --device cuda          # the full size (one GPU, minutes)
    python benchmarks/reproduce/closest_regime/run.py --quick               # the CPU quick size

The structure of ImageNet -> CUB-200: the source is large and the backbone trained on it to convergence;
the target keeps the source's low-level statistics (the same renderer, fonts, clutter, colours) and asks
the head for classes held out of pretraining. Here:

* Source: SynthDigits (60,000 generated 32x32 RGB digits, the largest source the project makes, no
  download), digits 0-4 of the first 50,000 images: pretrained on, with 2,000 held out to draw the
  convergence curve. MobileNetV2 (Keras layout) from scratch, AdamW 1e-3, cosine, batch 128, BatchNorm on
  batch statistics; then its norms' statistics re-estimated over the source and folded into the convs
  (``elastictrainer_accuracy/run.py``'s functions: the same function, unamplified gradients).
* Target: digits 5-9 of the last 10,000 images (new classes, same images' statistics), a **new head**
  (freshly initialised, the same for every arm and seed), ``--target-train`` training images, 25% as many
  for validation, the rest of them to test.
* Fine-tuning: fedelastic's trainer (``train_local``), 8 epochs, batch 32, BatchNorm frozen, SGDW
  momentum 0.9, weight decay 5e-4, cosine schedule; budgets priced on the Jetson TX2 profile's kernel
  model (its measured tables are for 224x224 inputs and are dropped), as in ``elastictrainer_accuracy``.
* Arms: full, last layer, bias-only (``bn_bias``: biases, norm shifts and scales, the head), ElasticTrainer
  (``elastic_tensor`` rho 0.5, re-selection every 4 epochs), Accelerated ElasticTrainer (``elastic_layer``
  rho 0.5), TinyTrain (``tinytrain``, its defaults: backward work 0.3 of full's, TX2 memory) and Sparse
  Update (``sparse_update``, its defaults: last 6 biases, 4 weight layers; no contributions file, so its
  depth heuristic stands in for the contribution search); on request, Sparse Update with its search
  (``sparse_update_searched``: the contribution analysis runs first on a proxy task, the held-out source
  images rotated 45 degrees under a fresh head, and the scheme is searched over its measured gains, with
  the caps of ``sparse_update/run.py``'s searched arm: 12 biases, at most 8 weight layers; TX2 memory).
* Learning rate per arm on the validation split (seed 0): the grid {0.003, 0.01, 0.03} widens one step
  of the ladder 1e-4, 3e-4, ..., 1 at a time while the best rate sits at an edge; the result says where
  the ladder's end bound instead. Then ``--seeds`` seeds at that rate on the test split; differences to
  full are paired by seed. A run whose loss goes non-finite or whose predictions fall into one class is
  diverged: never picked, never averaged.

Runs go to ``--workers`` processes (on a GPU they share it: the small model is launch-bound). Writes
``--out`` (JSON, as it goes) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.data import ArrayDataset, synth  # noqa: E402
from fedelastic.data.shifts import Shift, apply_shift  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.results.seedstats import ci95  # noqa: E402
from fedelastic.selection.strategy import make_strategy  # noqa: E402
from fedelastic.train.trainer import LocalTraining, train_local  # noqa: E402

_spec = importlib.util.spec_from_file_location("et_accuracy", HERE.parent / "elastictrainer_accuracy" / "run.py")
eta = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(eta)  # type: ignore[union-attr]

ARMS = {
    "full": ("full", {}),
    "last_layer": ("last_layer", {}),
    "bias_only": ("bn_bias", {}),
    "elastictrainer": ("elastic_tensor", {"rho": 0.5}),
    "accelerated_elastictrainer": ("elastic_layer", {"rho": 0.5}),
    "tinytrain": ("tinytrain", {}),
    "sparse_update": ("sparse_update", {}),
    # the paper's method: the scheme searched over gains measured on a proxy task (contribution_analysis);
    # the caps of sparse_update/run.py's searched arm. Not in the default arms: the analysis trains ~100 schemes
    "sparse_update_searched": ("sparse_update", {"bias_last_k": 12, "max_weight_layers": 8, "search": "contribution"}),
}
DEFAULT_ARMS = [a for a in ARMS if a != "sparse_update_searched"]
PROXY_ROTATION = 45.0  # the proxy task's shift: the source's held-out images, rotated (fewshot.py's proxy)
LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
START = (3e-3, 1e-2, 3e-2)
SOURCE_CLASSES = 5  # digits 0-4 are the source; 5-9 the target's new classes


def load_data(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Source (digits 0-4 of the first ``n - 10,000`` images) and target (5-9 of the last 10,000) splits."""
    n = args.images
    x, y = synth.load(n, seed=0)
    x, y = x.astype(np.float32) / 255.0, y.astype(np.int64)
    cut = n - n // 6  # 50,000 of 60,000
    src = np.flatnonzero(y[:cut] < SOURCE_CLASSES)
    tgt = cut + np.flatnonzero(y[cut:] >= SOURCE_CLASSES)
    sv, tr, va = args.source_val, args.target_train, args.target_train // 4
    if len(src) <= sv or len(tgt) <= tr + va + 100:
        raise SystemExit(f"--images {n}: too few source ({len(src)}) or target ({len(tgt)}) images for the split")
    return {"src_x": x[src[sv:]], "src_y": y[src[sv:]], "sv_x": x[src[:sv]], "sv_y": y[src[:sv]],
            "tr_x": x[tgt[:tr]], "tr_y": y[tgt[:tr]], "va_x": x[tgt[tr:tr + va]], "va_y": y[tgt[tr:tr + va]],
            "te_x": x[tgt[tr + va:]], "te_y": y[tgt[tr + va:]]}  # fmt: skip


def pretrain(d: dict, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Train from scratch on the source; the curve: held-out source accuracy after every epoch."""
    torch.manual_seed(0)
    model, _ = eta.build("mobilenetv2", {"width_mult": args.width_mult})
    model.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=5e-4)
    per_epoch = len(d["src_x"]) // args.pretrain_batch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.pretrain_epochs * per_epoch)
    x, y = torch.from_numpy(d["src_x"]).to(args.device), torch.from_numpy(d["src_y"]).to(args.device)
    rng, curve = np.random.default_rng(0), []
    for epoch in range(args.pretrain_epochs):
        model.train()
        order = torch.from_numpy(rng.permutation(len(x))).to(args.device)
        losses = []
        for i in range(per_epoch):
            idx = order[i * args.pretrain_batch : (i + 1) * args.pretrain_batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        acc = batch_stat_accuracy(model, d["sv_x"], d["sv_y"], args.device)
        curve.append({"epoch": epoch + 1, "train_loss": float(np.mean(losses)), "source_val_accuracy_batch_stats": acc})
        print(
            f"  pretrain epoch {epoch + 1}: loss {np.mean(losses):.3f}, held-out source {acc:.3f} (batch statistics)",
            flush=True,
        )
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, curve


def batch_stat_accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, dev: str) -> float:
    """Accuracy with every norm on batch statistics (chunks of 500), the rest in eval mode; nothing changed.

    MobileNetV2's norms keep Keras' momentum (0.001): their running statistics lag the weights by
    thousands of steps, so an eval-mode curve would show that lag, not what the network has learned."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in norms]
    model.eval()
    for m in norms:
        m.train()
    with torch.no_grad():
        pred = torch.cat(
            [model(torch.from_numpy(x[i : i + 500]).to(dev)).argmax(1).cpu() for i in range(0, len(x), 500)]
        )
    for m, (mean, var, count) in zip(norms, saved):
        m.running_mean.copy_(mean), m.running_var.copy_(var), m.num_batches_tracked.copy_(count)
    return float((pred.numpy() == y).mean())


def new_head(state: dict, width_mult: float) -> dict:
    """``state`` with a freshly initialised classifier (seed 1: the same for every arm and seed)."""
    torch.manual_seed(1)
    fresh, _ = eta.build("mobilenetv2", {"width_mult": width_mult})
    return {
        **state,
        "dense.weight": fresh.dense.weight.detach().clone(),
        "dense.bias": fresh.dense.bias.detach().clone(),
    }


_W: dict = {}  # a worker's data, starting state and settings


def _init(data_path: str, state_path: str, settings: dict) -> None:
    torch.set_num_threads(settings["threads"])
    with np.load(data_path) as f:
        _W["d"] = {k: f[k] for k in f.files}
    _W["state"] = torch.load(state_path, map_location="cpu", weights_only=True)
    _W.update(settings)


def tx2_model(width_mult: float, state: dict, dev: str):
    """(model holding ``state`` on ``dev``, its ModelInfo, the TX2 kernel-model cost at batch 32, BN frozen)."""
    model, shape = eta.build("mobilenetv2", {"width_mult": width_mult})
    info = describe(model, torch.zeros(1, *shape), model_name="mobilenetv2")
    model.load_state_dict(state)
    model.to(dev)
    tx2 = load_profile(ROOT / "device_profiles" / "jetson_tx2.toml")
    cost = CostModel(info, dataclasses.replace(tx2, measured={}), 32, optimizer="momentum", bn_mode="frozen")
    return model, info, cost


def contribution_analysis(d: dict, state: dict, args: argparse.Namespace, path: Path) -> dict:
    """Sparse Update's offline analysis on a proxy task: the source's held-out images (digits 0-4, never
    trained on; the target's are 5-9), rotated 45 degrees, under a fresh head (seed 2), half to train and
    half to validate, 2 epochs at batch 16, lr ``--analysis-lr``, the fine-tuning's optimizer (SGDW momentum
    0.9, cosine). Written to ``path``; the searched arm's runs read it."""
    from fedelastic.train.contribution import analyse

    x = apply_shift(d["sv_x"], Shift(rotation=PROXY_ROTATION), seed=2)
    y, half = d["sv_y"], len(d["sv_y"]) // 2
    torch.manual_seed(2)
    fresh, _ = eta.build("mobilenetv2", {"width_mult": args.width_mult})
    head = {"dense.weight": fresh.dense.weight.detach().clone(), "dense.bias": fresh.dense.bias.detach().clone()}
    model, info, cost = tx2_model(args.width_mult, {**state, **head}, args.device)
    return analyse(
        model, info, cost, ArrayDataset(x[:half], y[:half]), ArrayDataset(x[half:], y[half:]),
        bias_last_k=ARMS["sparse_update_searched"][1]["bias_last_k"], lr=args.analysis_lr, path=path,
        data=f"proxy: {len(y)} held-out source images (digits 0-4) rotated {PROXY_ROTATION:g} degrees, fresh head, "
        f"{half} train / {len(y) - half} validation", momentum=0.9, weight_decay=5e-4, optimizer="sgdw", lr_schedule="cosine",
    )  # fmt: skip


def finetune(arm: str, lr: float, seed: int, split: str) -> dict:
    """One fine-tuning run of ``arm`` from the worker's starting state, scored on ``split``."""
    t0, d, dev = time.time(), _W["d"], _W["device"]
    model, info, cost = tx2_model(_W["width_mult"], _W["state"], dev)
    kind, options = ARMS[arm]
    if arm == "sparse_update_searched":
        options = {**options, "contributions": _W["contributions"]}
    local = LocalTraining(epochs=_W["epochs"], batch_size=32, lr=lr, momentum=0.9, weight_decay=5e-4,
                          bn_mode="frozen", optimizer="sgdw", lr_schedule="cosine")  # fmt: skip
    r = train_local(
        model, info, make_strategy(kind, options), cost, ArrayDataset(d["tr_x"], d["tr_y"]), local, seed=seed
    )
    acc, share = eta.accuracy(model, d[f"{split}_x"], d[f"{split}_y"], dev)
    trained = r.ratios if r.ratios is not None else np.zeros(info.num_tensors)
    return {"arm": arm, "strategy": kind, "options": options, "lr": lr, "seed": seed, "split": split,
            "accuracy": acc, "max_class_share": share, "train_loss": r.train_loss, "steps": r.steps,
            "diverged": bool(not np.isfinite(r.train_loss) or share > 0.9), "fits": r.fits,
            "fraction_trained": float(np.mean(trained > 0)), "first_trained_depth": eta.first_trained(r.ratios),
            "emulated_train_s": r.train_time_s, "wall_s": time.time() - t0}  # fmt: skip


def job(arm: str, lr: float, seed: int, split: str) -> dict:
    """:func:`finetune`, or a failed run's record (counted with the diverged, never averaged) if it raised."""
    try:
        return finetune(arm, lr, seed, split)
    except Exception as exc:  # noqa: BLE001 (one arm's fault must not end the other arms' runs)
        kind = ARMS[arm][0]
        print(f"  {arm} lr {lr:g} seed {seed} FAILED: {type(exc).__name__}: {exc}", flush=True)
        return {"arm": arm, "strategy": kind, "options": ARMS[arm][1], "lr": lr, "seed": seed, "split": split,
                "accuracy": float("nan"), "diverged": True, "error": f"{type(exc).__name__}: {exc}",
                "fraction_trained": float("nan"), "first_trained_depth": float("nan"),
                "emulated_train_s": float("nan")}  # fmt: skip


def score(runs: list[dict], lr: float) -> float:
    r = next(r for r in runs if r["lr"] == lr)
    return -1.0 if r["diverged"] else r["accuracy"]


def widen(runs: list[dict]) -> tuple[float, list[float], str]:
    """(best lr, rates still to try, how the pick stands): one ladder step beyond an edge pick, if any."""
    tried = sorted({r["lr"] for r in runs})
    # ties: an interior rate before an edge one (a tie is no sign that the best lies beyond), then the smaller
    best = max(tried, key=lambda lr: (score(runs, lr), lr not in (tried[0], tried[-1]), -lr))
    i = LADDER.index(best)
    if best == tried[0] and i > 0:
        return best, [LADDER[i - 1]], "edge"
    if best == tried[-1] and i < len(LADDER) - 1:
        return best, [LADDER[i + 1]], "edge"
    if best in (tried[0], tried[-1]):
        return best, [], f"at the ladder's {'lowest' if best == tried[0] else 'highest'} rate {best:g}: the limit binds"
    return best, [], "interior"


class _Inline:  # a one-process "pool": runs in this process, in order
    map = staticmethod(map)


def run_all(pool, arms: list[str], seeds: int, log, save) -> dict:
    """Tune every arm on validation (widening while its pick is at an edge), then its seeds on test;
    ``save(partial)`` after every run, so a run stopped early keeps what finished."""
    out: dict = {"tuning": {a: [] for a in arms}, "picks": {}, "runs": []}
    todo = [(a, lr) for a in arms for lr in START]
    while todo:
        for r in pool.map(job, *zip(*[(a, lr, 0, "va") for a, lr in todo])):
            out["tuning"][r["arm"]].append(r)
            log(f"  {r['arm']} lr {r['lr']:g} validation {r['accuracy']:.3f}{' DIVERGED' if r['diverged'] else ''}")
            save(out)
        todo = [(a, lr) for a in arms for lr in widen(out["tuning"][a])[1]]
    picks = {a: widen(out["tuning"][a]) for a in arms}
    out["picks"] = {a: {"lr": p[0], "status": p[2]} for a, p in picks.items()}
    for r in pool.map(job, *zip(*[(a, picks[a][0], s, "te") for a in arms for s in range(seeds)])):
        out["runs"].append(r)
        log(
            f"  {r['arm']} lr {r['lr']:g} seed {r['seed']}: test {r['accuracy']:.3f}{' DIVERGED' if r['diverged'] else ''}"
        )
        save(out)
    return out


def summary(doc: dict) -> list[dict]:
    """Per arm: mean and 95% interval of test accuracy, and the paired difference to full (points)."""
    runs = doc["runs"]
    full = {r["seed"]: r["accuracy"] for r in runs if r["arm"] == "full" and not r["diverged"]}
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        ok = {r["seed"]: r["accuracy"] for r in rs if not r["diverged"]}
        paired = [100 * (ok[s] - full[s]) for s in ok if s in full]
        rows.append({"arm": arm, "strategy": rs[0]["strategy"], "lr": rs[0]["lr"], "lr_status": doc["picks"][arm]["status"],
                     "mean": float(np.mean(list(ok.values()))) if ok else float("nan"), "ci95": ci95(list(ok.values())),
                     "per_seed": [r["accuracy"] for r in rs], "diverged": sum(r["diverged"] for r in rs), "seeds": len(rs),
                     "vs_full_points": float(np.mean(paired)) if paired and arm != "full" else float("nan"),
                     "vs_full_ci95": ci95(paired) if arm != "full" else float("nan"),
                     "tensors_trained": float(np.mean([r["fraction_trained"] for r in rs])),
                     "first_trained_depth": float(np.mean([r["first_trained_depth"] for r in rs])),
                     "emulated_tx2_s": float(np.mean([r["emulated_train_s"] for r in rs]))})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| arm | strategy | lr (validation; pick) | test accuracy, mean ± 95% [seeds] | vs full, paired (points ± 95%) "
             "| diverged | tensors trained | earliest trained depth | emulated TX2 s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        diff = "" if r["arm"] == "full" else f"{r['vs_full_points']:+.1f} ± {r['vs_full_ci95']:.1f}"
        seeds = ", ".join(f"{a:.3f}" for a in r["per_seed"])
        lines.append(f"| {r['arm']} | {r['strategy']} | {r['lr']:g} ({r['lr_status']}) | {r['mean']:.3f} ± {r['ci95']:.3f} "
                     f"[{seeds}] | {diff} | {r['diverged']}/{r['seeds']} | {r['tensors_trained']:.0%} | "
                     f"{r['first_trained_depth']:.2f} | {r['emulated_tx2_s']:.1f} |")  # fmt: skip
    return "\n".join(lines)


QUICK = {  # the CPU quick size: exercises every step; its figures are not the verdict's
    "images": 12000,
    "source_val": 500,
    "target_train": 200,
    "pretrain_epochs": 3,
    "pretrain_batch": 64,
    "width_mult": 0.35,
    "epochs": 4,
    "seeds": 2,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the CPU quick size: " + json.dumps(QUICK))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--images", type=int, default=60000, help="SynthDigits images generated (source: first 5/6)")
    ap.add_argument("--source-val", type=int, default=2000, help="source images held out for the convergence curve")
    ap.add_argument(
        "--target-train", type=int, default=1000, help="target training images (validation: a quarter as many)"
    )
    ap.add_argument("--width-mult", type=float, default=1.0)
    ap.add_argument("--pretrain-epochs", type=int, default=25)
    ap.add_argument("--pretrain-batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=8, help="fine-tuning epochs")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    ap.add_argument("--analysis-lr", type=float, default=0.01, help="the searched arm's contribution analysis's lr")
    ap.add_argument("--workers", type=int, default=0, help="processes (0: 8 on cuda, 1 on cpu)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    ap.add_argument(
        "--out", type=Path, default=None, help="result JSON, or a folder for result.json (default: beside this file)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing run (use --device cpu, or --quick)")
        return
    out = args.out or HERE / ("result_quick_cpu.json" if args.quick else "result.json")
    out = out / "result.json" if out.suffix != ".json" else out
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    workers = args.workers or (8 if args.device == "cuda" else 1)
    start = time.time()
    d = load_data(args)
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv, "settings": vars(args) | {"out": str(out)},
                 "sizes": {k: len(v) for k, v in d.items() if k.endswith("_y")}}  # fmt: skip
    print(
        f"source {len(d['src_y'])} images (digits 0-4), target train/val/test {len(d['tr_y'])}/{len(d['va_y'])}/{len(d['te_y'])} (5-9)"
    )
    state, doc["pretrain_curve"] = pretrain(d, args)
    doc["pretrain_s"] = time.time() - start
    state = eta.fold_norms("mobilenetv2", {"width_mult": args.width_mult},
                           {k: v.cpu() for k, v in eta.recalibrate_norms("mobilenetv2", {"width_mult": args.width_mult}, state, d["src_x"], args.device).items()})  # fmt: skip
    probe, _ = eta.build("mobilenetv2", {"width_mult": args.width_mult})
    probe.load_state_dict(state)
    probe.to(args.device)
    doc["source_val_accuracy"] = eta.accuracy(probe, d["sv_x"], d["sv_y"], args.device)[0]  # recalibrated, folded
    print(
        f"pretrained in {doc['pretrain_s']:.0f} s: held-out source accuracy {doc['source_val_accuracy']:.3f}",
        flush=True,
    )
    state = {k: v.cpu() for k, v in new_head(state, args.width_mult).items()}
    tmp = Path(tempfile.mkdtemp(prefix="closest_regime-"))
    np.savez(tmp / "data.npz", **{k: v for k, v in d.items() if not k.startswith(("src", "sv"))})
    torch.save(state, tmp / "state.pt")
    settings = {"device": args.device, "width_mult": args.width_mult, "epochs": args.epochs, "threads": args.threads,
                "contributions": str(out.with_name(out.stem + "_contributions.json"))}  # fmt: skip
    if "sparse_update_searched" in args.arms:
        t0 = time.time()
        analysis = contribution_analysis(d, state, args, Path(settings["contributions"]))
        doc["contribution_analysis"] = {"file": Path(settings["contributions"]).name, "wall_s": time.time() - t0,
                                        "base_accuracy": analysis["base_accuracy"],
                                        "layers_measured": len(analysis["weight"])}  # fmt: skip
        print(f"contribution analysis (proxy) in {time.time() - t0:.0f} s", flush=True)
    initargs = (str(tmp / "data.npz"), str(tmp / "state.pt"), settings)

    def log(line: str) -> None:
        print(line, flush=True)

    def save(partial: dict) -> None:
        out.write_text(json.dumps(doc | partial | {"partial": True}, indent=1))

    t1 = time.time()
    if workers == 1:
        _init(*initargs)
        doc.update(run_all(_Inline, args.arms, args.seeds, log, save))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=initargs) as pool:
            doc.update(run_all(pool, args.arms, args.seeds, log, save))
    shutil.rmtree(tmp)  # the workers' copies of the data and the starting state
    doc["finetune_s"], doc["wall_s"] = time.time() - t1, time.time() - start
    doc["summary"] = summary(doc)
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc["summary"]))
    print(
        f"wall {doc['wall_s']:.0f} s ({doc['pretrain_s']:.0f} s pretraining) on {doc['device']}, {workers} workers; wrote {out}"
    )


if __name__ == "__main__":
    main()
