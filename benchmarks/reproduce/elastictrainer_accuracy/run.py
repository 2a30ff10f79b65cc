"""ElasticTrainer's accuracy claim, single device as in the paper: a pretrained ResNet-50 / MobileNetV2
fine-tuned on a shifted domain with full training, last layer, and ElasticTrainer at rho 0.4 / 0.5.

    python benchmarks/reproduce/elastictrainer_accuracy/run.py [--quick] [--device cuda]

The paper's regime, for anyone with a network (``../sources.py``: torchvision's ImageNet weights, CUB-200
from the Hugging Face Hub; nothing was run at this size here):

    python benchmarks/reproduce/elastictrainer_accuracy/run.py --device cuda --models resnet50 \
        --dataset Donghyun99/CUB-200-2011 --image-size 224 --weights torchvision

The domain-gap ablation (README) runs the same setting under several target shifts in one invocation,
at a size the 2-core CPU host fits (``--shifts``, ``--width-mult``, ``--source-n``, ``--target-n``).

The paper's regime (ALGORITHMS.md): an ImageNet-pretrained model fine-tuned on a new dataset,
BatchNorm in inference mode, SGDW with a cosine schedule, re-selection every 4 epochs. Here, at a
reduced input size so that it runs in minutes:

* Source: 8,000 SynthDigits images (32x32 RGB, 10 classes), clean. The model pretrains on them
  (BatchNorm on batch statistics, AdamW lr 1e-3, cosine, 30 epochs), once per architecture, and
  must reach 0.5 on its source data or it is not fine-tuned (the run exits 1).
* Target: 4,000 other SynthDigits images rotated by 90 degrees (a new domain): 2,000 to train, of
  which 20% are held out for validation, and 2,000 to test. ``--shifts`` names other target shifts
  (``fedelastic.data.shifts.Shift`` fields, e.g. ``rotation=45`` or ``blur=1.5,noise=0.1``); each is
  fine-tuned from the same pretrained state, and its gap is measured as the pretrained model's
  accuracy on the shifted test split before any fine-tuning (``before``; chance is 0.1).
* Fine-tuning: fedelastic's own trainer (``train_local``) for 8 epochs (two re-selections at the
  artifact's 4-epoch interval), batch 32, BatchNorm frozen (the seeds') after its statistics are
  recalibrated on the source and folded into the convs (same function, unamplified gradients),
  SGDW momentum 0.9, weight decay 5e-4, cosine schedule. The budget is priced on the TX2 profile's
  kernel model (its measured tables are for 224x224 inputs, so they are dropped here).
* Each strategy gets its own learning rate: the best of {0.003, 0.01, 0.03} on the validation
  split (seed 0), the grid widened one geometric step at a time past the edge the pick sits at (up
  to ``--max-widen`` rates, default 3; a pick still at an edge is marked), then 3 seeds at that
  rate, scored on the test split.
* A run whose loss goes non-finite, or whose predictions fall into one class, is reported as
  diverged and never averaged.

Writes ``result.json`` beside this file (or ``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from fedelastic.comparisons.comparison import tune_lr  # noqa: E402
from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.data import ArrayDataset  # noqa: E402
from fedelastic.data.shifts import Shift, apply_shift  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models import build_with_input  # noqa: E402
from fedelastic.selection.strategy import make_strategy  # noqa: E402
from fedelastic.train.trainer import LocalTraining, train_local  # noqa: E402

_spec = importlib.util.spec_from_file_location("reproduce_sources", Path(__file__).resolve().parents[1] / "sources.py")
sources = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(sources)  # type: ignore[union-attr]

STRATEGIES = {"full": ("full", {}), "last_layer": ("last_layer", {}),
              "elastic_0.5": ("elastic_tensor", {"rho": 0.5}), "elastic_0.4": ("elastic_tensor", {"rho": 0.4})}  # fmt: skip
LRS = (0.003, 0.01, 0.03)
MIN_SOURCE_ACCURACY = 0.5  # a pretrained model below this on its own source data is not "pretrained"


def parse_shift(text: str) -> tuple[Shift, int]:
    """``rotation=90`` or ``blur=1.5,noise=0.1`` (``Shift`` fields; ``clean``: none) as a :class:`Shift`, and
    a label offset: ``labels=K`` relabels class ``y`` as ``(y + K) % 10`` (new classes on the same images)."""
    if text == "clean":
        return Shift(), 0
    fields = {f.name for f in dataclasses.fields(Shift)}
    kv, offset = {}, 0
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key == "labels" and value.isdigit():
            offset = int(value) % 10
        elif key not in fields or not value:
            raise SystemExit(
                f"--shifts: {part!r}: expected FIELD=NUMBER with FIELD one of {sorted(fields | {'labels'})}"
            )
        else:
            kv[key] = float(value)
    return Shift(**kv), offset


def shift_label(text: str) -> str:
    shift, offset = parse_shift(text)
    return (
        ",".join(([] if shift.is_identity else [shift.label()]) + ([f"labels+{offset}"] if offset else [])) or "clean"
    )


def load_data(path: Path | None, quick: bool, source_n: int = 8000, target_n: int = 4000) -> dict[str, np.ndarray]:
    """Clean source and target splits as float32 arrays in [0, 1]; from ``path`` (an .npz of uint8 images) or
    generated. The target (``target_n`` images after the source) splits 40% train, 10% validation, 50% test;
    :func:`shifted` applies a shift to it."""
    if path is not None and path.exists():
        raw = dict(np.load(path))
    else:
        from fedelastic.data import synth

        x, y = synth.generate(source_n + target_n, seed=0)
        raw = {"x": x, "y": y}
    x, y = raw["x"].astype(np.float32) / 255.0, raw["y"].astype(np.int64)
    if len(x) < source_n + target_n:
        raise SystemExit(f"{path}: {len(x)} images, fewer than --source-n + --target-n = {source_n + target_n}")
    tr, va = (target_n * 2) // 5, target_n // 2
    tx, ty = x[source_n : source_n + target_n], y[source_n : source_n + target_n]
    split = {"src_x": x[:source_n], "src_y": y[:source_n], "tr_x": tx[:tr], "tr_y": ty[:tr],
             "va_x": tx[tr:va], "va_y": ty[tr:va], "te_x": tx[va:], "te_y": ty[va:]}  # fmt: skip
    if quick:
        split = {k: v[: len(v) // 10] for k, v in split.items()}
    return split


def shifted(d: dict[str, np.ndarray], text: str) -> dict[str, np.ndarray]:
    """``d`` with its target splits under the shift ``text`` names (:func:`parse_shift`; seeded as the first
    run's: one image, one shifted image), their labels offset as it says."""
    shift, offset = parse_shift(text)
    n_tr, n_va = len(d["tr_x"]), len(d["va_x"])
    tgt = apply_shift(np.concatenate([d["tr_x"], d["va_x"], d["te_x"]]), shift, seed=1)
    out = {**d, "tr_x": tgt[:n_tr], "va_x": tgt[n_tr : n_tr + n_va], "te_x": tgt[n_tr + n_va :]}
    for split in ("tr", "va", "te"):
        out[f"{split}_y"] = (d[f"{split}_y"] + offset) % 10 if offset else d[f"{split}_y"]
    return out


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, dev: str) -> tuple[float, float]:
    """(accuracy, the largest share of predictions in one class)."""
    model.eval()
    with torch.no_grad():
        pred = torch.cat(
            [model(torch.from_numpy(x[i : i + 500]).to(dev)).argmax(1).cpu() for i in range(0, len(x), 500)]
        )
    counts = np.bincount(pred.numpy(), minlength=10)
    return float((pred.numpy() == y).mean()), float(counts.max() / counts.sum())


def build(name: str, opts: dict) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The model; ``opts`` may override the 10 classes and 32x32 inputs (``--dataset``)."""
    return build_with_input(name, **{"num_classes": 10, "input_size": 32, "in_channels": 3, **opts})


def pretrain(name: str, opts: dict, d: dict, dev: str, epochs: int, start: dict | None = None, cycle: int = 0) -> dict:
    """AdamW at 1e-3 with a cosine schedule (SGD at lr 0.05 left both models at chance: README), from
    ``start`` (an earlier cycle's weights: a warm restart, fresh optimizer) or the factory's init."""
    torch.manual_seed(cycle)
    model, _ = build(name, opts)
    if start is not None:
        model.load_state_dict(start)
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=5e-4)
    steps = epochs * (len(d["src_x"]) // 64)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    x, y = torch.from_numpy(d["src_x"]).to(dev), torch.from_numpy(d["src_y"]).to(dev)
    rng = np.random.default_rng(cycle)
    for epoch in range(epochs):
        if epoch % 5 == 0:
            print(
                f"  {name} pretrain epoch {epoch}: source accuracy {accuracy(model, d['src_x'][:1000], d['src_y'][:1000], dev)[0]:.3f}",
                flush=True,
            )
        model.train()
        order = torch.from_numpy(rng.permutation(len(x))).to(dev)
        for i in range(0, len(x) - 63, 64):
            idx = order[i : i + 64]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def finetune(name: str, opts: dict, state: dict, strategy: str, lr: float, seed: int, d: dict, dev: str, epochs: int,
             evalx: str) -> dict:  # fmt: skip
    t0 = time.time()
    model, shape = build(name, opts)
    info = describe(model, torch.zeros(1, *shape), model_name=name)
    model.load_state_dict(state)
    model.to(dev)
    tx2 = load_profile(ROOT / "device_profiles" / "jetson_tx2.toml")
    cost = CostModel(info, dataclasses.replace(tx2, measured={}), 32, optimizer="momentum", bn_mode="frozen")
    kind, options = STRATEGIES[strategy]
    before_acc, _ = accuracy(model, d[f"{evalx}_x"], d[f"{evalx}_y"], dev)
    local = LocalTraining(epochs=epochs, batch_size=32, lr=lr, momentum=0.9, weight_decay=5e-4,
                          bn_mode="frozen", optimizer="sgdw", lr_schedule="cosine")  # fmt: skip
    r = train_local(
        model, info, make_strategy(kind, options), cost, ArrayDataset(d["tr_x"], d["tr_y"]), local, seed=seed
    )
    acc, share = accuracy(model, d[f"{evalx}_x"], d[f"{evalx}_y"], dev)
    diverged = not np.isfinite(r.train_loss) or share > 0.9
    return {"strategy": strategy, "lr": lr, "seed": seed, "split": evalx, "accuracy": acc, "before": before_acc,
            "max_class_share": share, "train_loss": r.train_loss, "diverged": bool(diverged), "steps": r.steps,
            "selections": r.selections, "emulated_train_s": r.train_time_s, "overhead_s": r.overhead_time_s,
            "fraction_trained": float(np.mean(r.ratios > 0)) if r.ratios is not None else 0.0,
            "first_trained_depth": first_trained(r.ratios), "forward_share": cost.forward_time_s / cost.full_step_time_s(),
            "wall_s": time.time() - t0}  # fmt: skip


def first_trained(ratios: np.ndarray | None) -> float:
    """Depth of the earliest tensor any selection trained, as a share of the tensors (0: the first layer)."""
    if ratios is None or not np.any(ratios > 0):
        return 1.0
    return float(np.argmax(ratios > 0) / len(ratios))


def ci95(v: list[float]) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.975, len(v) - 1) * np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")


def recalibrate_norms(name: str, opts: dict, state: dict, x: np.ndarray, dev: str) -> dict:
    """``state`` with every BatchNorm's running statistics re-estimated over ``x`` (an exact average).

    MobileNetV2's norms keep Keras' momentum (0.001 in PyTorch terms): after a few hundred pretraining
    steps their running statistics are still mostly their initial 0 / 1, so an eval-mode (or frozen-BN)
    model predicts one class. Averaging them over the source once, as a deployed model would be
    calibrated, removes that; after the 3,750 steps of the GPU recipe it changes them little.
    """
    model, _ = build(name, opts)
    model.load_state_dict(state)
    model.to(dev).train()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches seen
    with torch.no_grad():
        for i in range(0, len(x), 250):
            model(torch.from_numpy(x[i : i + 250]).to(dev))
    fresh = model.state_dict()
    return {k: (fresh[k].detach().clone() if "running" in k or "num_batches" in k else v) for k, v in state.items()}


def fold_norms(name: str, opts: dict, state: dict) -> dict:
    """``state`` with every BatchNorm that directly follows a conv folded into that conv: the same function.

    The conv gets ``w * g / s`` (``s = sqrt(var + eps)``), the norm weight 1, bias ``b - m g / s``, mean 0
    and variance ``1 - eps`` (an identity plus the bias). Frozen but unfolded, a norm multiplies its conv's
    gradient by ``g / s``, and recalibrated statistics of dead channels (variance ~1e-12 here) make that
    31x: full fine-tuning then collapsed to one class at every lr (README).
    """
    model, _ = build(name, opts)
    out, prev = dict(state), None
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.BatchNorm2d) and prev is not None and isinstance(prev[1], torch.nn.Conv2d):
            conv, bn = prev[0], mod_name
            scale = out[f"{bn}.weight"] / torch.sqrt(out[f"{bn}.running_var"] + mod.eps)
            out[f"{conv}.weight"] = out[f"{conv}.weight"] * scale.view(-1, 1, 1, 1)
            out[f"{bn}.bias"] = out[f"{bn}.bias"] - out[f"{bn}.running_mean"] * scale
            out[f"{bn}.weight"] = torch.ones_like(scale)
            out[f"{bn}.running_mean"] = torch.zeros_like(scale)
            out[f"{bn}.running_var"] = torch.full_like(scale, 1 - mod.eps)
        if not list(mod.children()):
            prev = (mod_name, mod)
    return out


def pretrained_state(name: str, opts: dict, d: dict, args: argparse.Namespace, cycles: list[int]) -> tuple[dict, float]:
    """The pretrained weights after ``cycles`` cosine cycles of that many epochs each (each cycle's read from
    ``--pretrained-cache`` when it holds that exact recipe), their norms' statistics recalibrated on the
    source (:func:`recalibrate_norms`) and folded into the convs (:func:`fold_norms`), and the time
    pretraining took here."""
    t0 = time.time()
    state: dict | None = None
    for i in range(len(cycles)):
        done = "+".join(map(str, cycles[: i + 1]))
        key = "-".join([name, *(f"{k}{v}" for k, v in sorted(opts.items())), f"src{len(d['src_x'])}", f"ep{done}"])
        path = args.pretrained_cache / f"{key}.pt" if args.pretrained_cache else None
        if path is not None and path.exists():
            print(f"{name}: pretrained state (epochs {done}) read from {path}", flush=True)
            state = torch.load(path, map_location=args.device, weights_only=True)
            continue
        state = pretrain(name, opts, d, args.device, cycles[i], state, cycle=i)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
    assert state is not None
    state = fold_norms(name, opts, recalibrate_norms(name, opts, state, d["src_x"], args.device))
    return state, time.time() - t0


def tune_and_run(name: str, opts: dict, state: dict, d: dict, args: argparse.Namespace, epochs: int) -> dict:
    """Per strategy: the best of ``--lrs`` on the validation split (seed 0), the grid widened past its edge
    while the pick sits there (up to ``--max-widen`` rates; :func:`fedelastic.comparisons.comparison.tune_lr`), then
    ``--seeds`` test runs at it."""
    out: dict = {"tuning": [], "runs": [], "searches": {}}
    for strategy in args.strategies:

        def score(lr: float, strategy=strategy) -> float:
            s = finetune(name, opts, state, strategy, lr, 0, d, args.device, epochs, "va")
            print(f"  {strategy} lr {lr:g} validation: {s['accuracy']:.3f}{' (diverged)' if s['diverged'] else ''}")
            out["tuning"].append(s)
            return float("nan") if s["diverged"] else s["accuracy"]

        search = tune_lr(score, tuple(args.lrs), args.max_widen)
        best = search.chosen if search.chosen is not None else min(args.lrs)  # none usable: the smallest rate
        out["searches"][strategy] = {"chosen": best, "edge": search.edge, "added": search.added}
        if search.edge:
            print(f"  {strategy}: lr {best:g} still at the {search.edge} edge after {search.added} rate(s) added")
        for seed in range(args.seeds):
            r = finetune(name, opts, state, strategy, best, seed, d, args.device, epochs, "te")
            out["runs"].append(r)
            print(f"  {strategy} lr {best:g} seed {seed}: {r['accuracy']:.3f} (before {r['before']:.3f}, "
                  f"{r['wall_s']:.0f} s{', DIVERGED' if r['diverged'] else ''})", flush=True)  # fmt: skip
    return out


def table(doc: dict) -> list[str]:
    """The markdown table of ``doc``'s runs: per model, shift and strategy."""
    lines = ["| model | shift | before (gap) | strategy | lr (val) | test accuracy, mean ± 95% | vs full (points) | "
             "diverged | tensors trained | emulated s (TX2 kernels) |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, entry in doc["models"].items():
        if "void" in entry:
            lines.append(f"| {name} | | | (all) | | void: {entry['void']} | | | | |")
            continue
        for label, sh in entry["shifts"].items():
            runs = sh["runs"]
            full = [r["accuracy"] for r in runs if r["strategy"] == "full" and not r["diverged"]]
            for strategy in dict.fromkeys(r["strategy"] for r in runs):
                rs = [r for r in runs if r["strategy"] == strategy]
                ok = [r["accuracy"] for r in rs if not r["diverged"]]
                gap = 100 * (np.mean(ok) - np.mean(full)) if ok and full else float("nan")
                edge = sh.get("searches", {}).get(strategy, {}).get("edge", "")
                lines.append(
                    f"| {name} | {label} | {sh['before']:.3f} | {strategy} | {rs[0]['lr']:g}{f' ({edge} edge)' if edge else ''} | "
                    f"{np.mean(ok) if ok else float('nan'):.3f} ± {ci95(ok):.3f} | {gap:+.1f} | "
                    f"{sum(r['diverged'] for r in rs)}/{len(rs)} | {np.mean([r['fraction_trained'] for r in rs]):.0%} | "
                    f"{np.mean([r['emulated_train_s'] for r in rs]):.1f} |"
                )  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the data, 2 epochs: a smoke test")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", type=Path, default=None, help=".npz with x (uint8 N,3,32,32) and y; default: generate")
    ap.add_argument("--models", nargs="+", default=["resnet50", "mobilenetv2"])
    ap.add_argument(
        "--width-mult", type=float, default=1.0, help="MobileNetV2's width multiplier (other models: ignored)"
    )
    ap.add_argument("--model-option", action="append", default=[], metavar="KEY=INT",
                    help="a factory option for every model, e.g. width=32 for mcu_net")  # fmt: skip
    ap.add_argument("--shifts", nargs="+", default=["rotation=90"], help="target shifts, e.g. rotation=90 blur=1.5")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--source-n", type=int, default=8000, help="clean source images to pretrain on")
    ap.add_argument("--target-n", type=int, default=4000, help="target images: 40%% train, 10%% validation, 50%% test")
    ap.add_argument("--lrs", nargs="+", type=float, default=list(LRS), help="the validation split's lr grid")
    ap.add_argument("--max-widen", type=int, default=3, help="most rates added past the grid's edge per strategy")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--pretrain-epochs", type=int, nargs="+", default=[30],
                    help="epochs of each cosine cycle (several: warm restarts from the previous cycle's weights)")  # fmt: skip
    ap.add_argument("--pretrained-cache", type=Path, default=None, help="folder to keep / reuse pretrained weights in")
    ap.add_argument(
        "--probe-shifts", nargs="*", default=[], help="shifts whose gap (before) is measured, not fine-tuned"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    sources.add_arguments(ap)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("result.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    if args.dataset and not args.weights:
        raise SystemExit("--dataset is the target task: give --weights too (there is no source to pretrain on)")
    d = sources.target_splits(args.dataset, args.image_size) if args.dataset else load_data(args.data, args.quick, args.source_n, args.target_n)
    if args.dataset:
        args.shifts = ["clean"]  # the dataset is the target as it comes
    shifts = {shift_label(t): t for t in args.shifts}
    epochs, pre_epochs = (2, [1]) if args.quick else (8, args.pretrain_epochs)
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "torch": torch.__version__, "quick": args.quick, "argv": sys.argv[1:] if argv is None else argv,
                 "sizes": {k: len(v) for k, v in d.items() if k.endswith("_y")}, "models": {}}  # fmt: skip
    for name in args.models:
        t0 = time.time()
        opts = {"width_mult": args.width_mult} if name == "mobilenetv2" else {}
        opts.update({k: int(v) for k, _, v in (o.partition("=") for o in args.model_option)})
        if args.weights:  # ImageNet weights, a new head: no pretraining here, no source to score
            opts.update(layout="torchvision", **({"num_classes": sources.num_classes(d), "input_size": d["tr_x"].shape[-1]} if args.dataset else {}))
            state, pretrain_s = sources.imagenet_start(build(name, opts)[0], args.weights), 0.0
        else:
            state, pretrain_s = pretrained_state(name, opts, d, args, pre_epochs)
        probe_model, _ = build(name, opts)
        probe_model.load_state_dict(state)
        probe_model.to(args.device)
        src_acc = float("nan") if args.weights else accuracy(probe_model, d["src_x"][:2000], d["src_y"][:2000], args.device)[0]
        clean_acc, _ = accuracy(probe_model, d["te_x"], d["te_y"], args.device)  # with --weights: a new head's
        entry: dict = {"options": opts, "pretrain_s": pretrain_s, "source_train_accuracy": src_acc,
                       "clean_target_test_accuracy": clean_acc, "probe_gaps": {}, "shifts": {}}  # fmt: skip
        print(f"{name} {opts}: source {src_acc:.3f}, clean target test {clean_acc:.3f}", flush=True)
        for text in args.probe_shifts:
            probe = shifted(d, text)
            acc = accuracy(probe_model, probe["te_x"], probe["te_y"], args.device)[0]
            entry["probe_gaps"][shift_label(text)] = acc
            print(f"  gap probe {shift_label(text)}: pretrained accuracy {acc:.3f}", flush=True)
        if src_acc < MIN_SOURCE_ACCURACY:  # fine-tuning a model that learned nothing tells nothing about the claim
            entry["void"] = f"pretraining reached {src_acc:.3f} on the source, below {MIN_SOURCE_ACCURACY}"
            print(f"{name}: {entry['void']}: not fine-tuned", flush=True)
            doc["models"][name] = entry
            args.out.write_text(json.dumps(doc, indent=1))
            continue
        doc["models"][name] = entry
        for label, shift in shifts.items():
            t1 = time.time()
            ds = shifted(d, shift)
            before = accuracy(probe_model, ds["te_x"], ds["te_y"], args.device)[0]
            print(f"{name} on {label}: pretrained accuracy {before:.3f} before fine-tuning", flush=True)
            entry["shifts"][label] = {"before": before, **tune_and_run(name, opts, state, ds, args, epochs)}
            entry["shifts"][label]["wall_s"] = time.time() - t1
            args.out.write_text(json.dumps(doc, indent=1))  # as it goes
        entry["wall_s"] = time.time() - t0
    doc["wall_s"] = time.time() - start
    args.out.write_text(json.dumps(doc, indent=1))
    print("\n".join(table(doc)))
    print(f"wall {doc['wall_s']:.0f} s on {doc['device']}; wrote {args.out}")
    if any("void" in e for e in doc["models"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
