"""Shared pieces of the TinyTrain and Sparse Update reproductions: data, a pretrained ``mcu_net``,
few-shot episodes and transfer runs with fedelastic's own trainer, under an MCU memory budget.

Not a package module: imported by ``tinytrain/run.py`` and ``sparse_update/run.py`` by path.

* Data: 12,000 SynthDigits images (32x32 RGB). Source: digits 0-4 of the first 8,000, clean.
  Target pool: digits 5-9 of the last 4,000 (new classes), rotated 90 degrees (a new domain),
  relabelled 0-4. Proxy pool (Sparse Update's offline contribution analysis): digits 5-9 of the
  first 8,000, rotated 45 degrees, relabelled 0-4 (other images and another shift than the target's).
* Pretraining: ``mcu_net`` (width 16) with 5 outputs on the source, BatchNorm on batch statistics,
  AdamW 1e-3, cosine, 15 epochs, batch 64, one torch thread; cached under ``$FEDELASTIC_CACHE`` (or
  ``~/.cache/fedelastic``). A model below ``MIN_SOURCE_ACCURACY`` on its source is refused.
* Adaptation graph: the pretrained BatchNorms are folded into their convs (``FOLD_BN``,
  :func:`fold_batchnorm`), as an MCU deploys and trains the model. Unfolded, frozen norms with running
  variances down to 0.007 multiply the convs' gradients about 12x (the first, void run's collapse).
* Head: for each task the 5-way head is re-initialised from the training images' class means of the
  penultimate features, as a cosine head with temperature 10 (``HEAD``; the void run used
  ``W = 2 p``, ``b = -|p|^2``), so "none" is a ProtoNet-style classifier on the pretrained features.
* Learning rates (:func:`tune_and_run`): per arm, the best of a grid on validation tasks, the grid
  widened past the edge a pick sits at (up to ``max_widen`` rates; a pick left at an edge is recorded
  and marked); an arm with ``lr_groups`` gives the head and the other biases their own rates
  (:func:`group_lrs`), searched one group at a time. ``tune_and_run_parallel`` runs arms in forked processes.
* Training: :func:`fedelastic.train.trainer.train_local` (SGD momentum 0.9, weight decay 5e-4, cosine,
  norms frozen: none are left after folding). Memory is priced at batch 1 on the MCU profile given (a device that accumulates
  micro-batches of 1: with BatchNorm frozen the gradient is the same as the host's batch). An arm whose
  selection does not fit is recorded as not fitting, with the trainer's reason, and (if asked) run
  again on an unconstrained device as a host reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedelastic.comparisons.comparison import tune_lr  # noqa: E402
from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.data import ArrayDataset, synth  # noqa: E402
from fedelastic.data.shifts import Shift, apply_shift  # noqa: E402
from fedelastic.devices.profile import Quantity, load_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models import build_with_input  # noqa: E402
from fedelastic.selection.strategy import make_strategy  # noqa: E402
from fedelastic.train.optim import register_step_pre_hook  # noqa: E402
from fedelastic.train.trainer import LocalTraining, train_local  # noqa: E402

WIDTH, SIZE, WAYS = 16, 32, 5
MIN_SOURCE_ACCURACY = 0.8
PROXY_ROTATION = 45.0  # the proxy task's shift (Sparse Update's contribution analysis): not the target's 90
LRS = (1e-4, 1e-3, 1e-2)  # the default lr grid (the void run's was 0.01, 0.03, 0.1)
torch.set_num_threads(1)  # a shared 2-core host


def load_data() -> dict[str, np.ndarray]:
    x, y = synth.load(30000, seed=0)  # cached; generated in blocks, so its first 12,000 are generate(12000)'s
    x, y = x[:12000], y[:12000]
    x = x.astype(np.float32) / 255.0
    src = np.flatnonzero(y[:8000] < 5)
    tgt = 8000 + np.flatnonzero(y[8000:] >= 5)
    proxy = np.flatnonzero(y[:8000] >= 5)  # the source pool's other digits: never pretrained on, never target
    return {"src_x": x[src], "src_y": y[src].astype(np.int64),
            "tgt_x": apply_shift(x[tgt], Shift(rotation=90.0), seed=1), "tgt_y": (y[tgt] - 5).astype(np.int64),
            "proxy_x": apply_shift(x[proxy], Shift(rotation=PROXY_ROTATION), seed=2),
            "proxy_y": (y[proxy] - 5).astype(np.int64)}  # fmt: skip


def new_model() -> tuple[torch.nn.Module, tuple]:
    return build_with_input("mcu_net", num_classes=WAYS, input_size=SIZE, in_channels=3, width=WIDTH)


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, largest share of predictions in one class)."""
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(torch.from_numpy(x[i : i + 500])).argmax(1) for i in range(0, len(x), 500)]).numpy()
    counts = np.bincount(pred, minlength=WAYS)
    return float((pred == y).mean()), float(counts.max() / counts.sum())


def pretrained(d: dict, epochs: int = 15, device: str = "cpu") -> dict:
    """The pretrained weights (cached); ``device``: where pretraining runs (``cuda``: seconds instead of
    a CPU core's ~45 s per epoch; its weights differ in the last bits, so they are cached apart)."""
    cache = Path(os.environ.get("FEDELASTIC_CACHE", Path.home() / ".cache" / "fedelastic")) / "reproduce"
    suffix = "" if device == "cpu" else f"_{device}"
    path = cache / f"mcu_net_w{WIDTH}_s{SIZE}_digits0-4_e{epochs}{suffix}.pt"
    if not path.exists() and device != "cpu" and not os.environ.get("FEWSHOT_PRETRAIN_CHILD"):
        # autograd on a GPU in this process would make every later fork_map child refuse autograd
        import subprocess

        env = {**os.environ, "FEWSHOT_PRETRAIN_CHILD": "1"}
        subprocess.run([sys.executable, __file__, "--pretrain", str(epochs), device], check=True, env=env)
    if path.exists():
        return torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model, _ = new_model()
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=5e-4)
    n = len(d["src_y"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * (n // 64))
    x, y = torch.from_numpy(d["src_x"]).to(device), torch.from_numpy(d["src_y"]).to(device)
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        model.train()
        order = torch.from_numpy(rng.permutation(n)).to(device)
        for i in range(0, n - 63, 64):
            idx = order[i : i + 64]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
    model.cpu()
    acc, _ = accuracy(model, d["src_x"], d["src_y"])
    if acc < MIN_SOURCE_ACCURACY:
        raise SystemExit(
            f"pretraining reached {acc:.3f} on its source, below {MIN_SOURCE_ACCURACY}: not a pretrained model"
        )
    cache.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, path)
    return state


class CosineHead(torch.nn.Linear):
    """A Linear whose logits are ``temperature x cos(feature, weight row) + bias``.

    Still an ``nn.Linear`` (same parameters, MACs and saved input for the cost model and the selectors);
    the two normalisations are per-sample and weightless.
    """

    def __init__(self, linear: torch.nn.Linear, temperature: float) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.nn.functional.normalize(self.weight, dim=1)
        return self.temperature * torch.nn.functional.linear(torch.nn.functional.normalize(x, dim=1), w) + self.bias


def fold_batchnorm(module: torch.nn.Module) -> None:
    """Fold every BatchNorm2d that directly follows a Conv2d (in the same Sequential) into that conv, in place.

    The conv gets ``w * g / s`` and a bias ``b - m g / s`` (``s = sqrt(var + eps)``) and the norm becomes an
    ``Identity``: the same function at inference, the graph an MCU deploys and trains (no norm layers).
    Without it, training a BN-trained backbone with the norms frozen multiplies each conv's gradient by
    ``g / s``, with running variances down to 0.007 here: about 12x the stem's weight norm per unit of lr.
    """
    for child in module.children():
        fold_batchnorm(child)
    if not isinstance(module, torch.nn.Sequential):
        return
    for i in range(len(module) - 1):
        conv, bn = module[i], module[i + 1]
        if isinstance(conv, torch.nn.Conv2d) and isinstance(bn, torch.nn.BatchNorm2d):
            with torch.no_grad():
                scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
                new = torch.nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                                      conv.padding, conv.dilation, conv.groups, bias=True)  # fmt: skip
                new.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1))
                bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
                new.bias.copy_((bias - bn.running_mean) * scale + bn.bias)
            module[i], module[i + 1] = new, torch.nn.Identity()


# The episode head (see prototype_head). "cosine" with temperature 10: the fixed setting (README, ablation);
# "dot" is the first, void run's head (logit spread about 18 at initialisation, cross-entropy 2.7).
HEAD: dict = {"kind": "cosine", "temperature": 10.0}
FOLD_BN = True  # fold the norms into the convs before adapting (fold_batchnorm); False: the void run's setting


def prototype_head(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> None:
    """Set the head to nearest-prototype logits of the penultimate features of ``x`` (class means ``p``).

    ``HEAD["kind"]``: ``cosine`` replaces the last Linear by a :class:`CosineHead` with rows ``p`` and
    bias 0 (logits ``T cos(f, p)``, bounded by the temperature ``T``); ``dot`` keeps the Linear with
    ``W = 2 p``, ``b = -|p|^2`` (negative squared distance up to a per-sample constant, unbounded scale).
    """
    model.eval()
    with torch.no_grad():
        feats = model[:-1](torch.from_numpy(x))
        protos = torch.stack([feats[torch.from_numpy(y == c)].mean(0) for c in range(WAYS)])
        if HEAD["kind"] == "cosine":
            model[-1] = CosineHead(model[-1], float(HEAD["temperature"]))
            model[-1].weight.copy_(protos)
            model[-1].bias.zero_()
        elif HEAD["kind"] == "dot":
            model[-1].weight.copy_(2 * protos)
            model[-1].bias.copy_(-(protos**2).sum(1))
        else:
            raise ValueError(f"HEAD kind: expected 'cosine' or 'dot', got {HEAD['kind']!r}")


def mcu_device(profile: str, memory_kib: float | None):
    """``profile`` with its training memory set to ``memory_kib`` KiB (None: the profile's; inf: unconstrained)."""
    device = load_profile(ROOT / "device_profiles" / f"{profile}.toml")
    if memory_kib is None:
        return device
    return dataclasses.replace(device, memory_train_bytes=Quantity(memory_kib * 1024, "set by the reproduction"))


LR_GROUPS = ("head", "bias")  # the groups an arm's ``lr_groups`` may give their own lr (see group_lrs)
WEIGHT_DECAY = 5e-4


@contextlib.contextmanager
def group_lrs(model: torch.nn.Module, lr: dict[str, float]):
    """Train ``model``'s groups at their own rates while inside: ``head`` (the last layer's weight and
    bias) at ``lr["head"]``, which the trainer is given as its lr, and ``bias`` (every other bias) at
    ``lr["bias"]``.

    The trainer's optimizer has one group (coupled weight decay, momentum); before each step a bias's
    gradient ``g`` becomes ``s g + (s - 1) wd p`` (``s``: its rate over the head's), so that with the
    optimizer's own ``+ wd p`` its update is exactly ``s`` times the head's rule: a per-group lr, under
    any schedule, since the cosine schedule scales every group alike.
    """
    unknown = set(lr) - set(LR_GROUPS)
    if unknown or "head" not in lr:
        raise ValueError(f"lr groups: expected 'head' and optionally 'bias', got {sorted(lr)}")
    head = {id(p) for p in model[-1].parameters()}
    scaled = [(p, lr["bias"] / lr["head"]) for n, p in model.named_parameters()
              if "bias" in lr and n.endswith("bias") and id(p) not in head]  # fmt: skip

    def hook(_opt) -> None:
        for p, s in scaled:
            if p.grad is not None:
                p.grad.mul_(s).add_(p.detach(), alpha=(s - 1) * WEIGHT_DECAY)

    handle = register_step_pre_hook(hook)
    try:
        yield lr["head"]
    finally:
        handle.remove()


def run_task(
    state: dict, arm: dict, lr: float | dict, seed: int, train: tuple, test: tuple, steps: int, batch: int
) -> dict:
    """One adaptation: prototype head from ``train``, then ``steps`` steps of ``arm``; scored on ``test``.
    ``lr``: one rate, or one per group (:func:`group_lrs`)."""
    torch.manual_seed(seed)
    model, shape = new_model()
    model.load_state_dict(state)
    if FOLD_BN:
        fold_batchnorm(model)
    prototype_head(model, *train)
    with group_lrs(model, lr) if isinstance(lr, dict) else contextlib.nullcontext(lr) as base_lr:
        return _adapt(model, shape, arm, base_lr, lr, seed, train, test, steps, batch)


def _adapt(
    model, shape, arm: dict, base_lr: float, lr, seed: int, train: tuple, test: tuple, steps: int, batch: int
) -> dict:
    before, _ = accuracy(model, *test)
    row = {"arm": arm["label"], "lr": lr, "seed": seed, "before": before}
    if arm["strategy"] == "none":
        acc, share = before, accuracy(model, *test)[1]
        return {**row, "accuracy": acc, "max_class_share": share, "fits": True, "diverged": False, "steps": 0}
    info = describe(model, torch.zeros(1, *shape), model_name="mcu_net")
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    for device, place in ((arm["device"], "device"), (mcu_device(arm["profile"], float("inf")), "host reference")):
        where = place
        model.load_state_dict(snapshot)
        cost = CostModel(info, device, 1, optimizer="momentum", bn_mode="frozen")
        epochs = -(-steps * batch // len(train[1]))
        local = LocalTraining(epochs=epochs, batch_size=batch, lr=base_lr, momentum=0.9, weight_decay=WEIGHT_DECAY,
                              max_steps=steps, bn_mode="frozen", lr_schedule="cosine")  # fmt: skip
        r = train_local(model, info, make_strategy(arm["strategy"], arm.get("options", {})), cost,
                        ArrayDataset(*train), local, seed=seed)  # fmt: skip
        if r.fits or not arm.get("reference", False):
            break
        row["device_reason"] = r.reason
    acc, share = accuracy(model, *test)
    return {**row, "accuracy": acc, "max_class_share": share, "fits": bool(r.fits), "run_on": where,
            "reason": r.reason, "diverged": bool(not np.isfinite(r.train_loss) or share > 0.9) if r.fits else False,
            "steps": r.steps, "peak_memory_kib": r.peak_memory_bytes / 1024, "trained_fraction":
            float(np.mean(r.ratios > 0)) if r.ratios is not None else 0.0, "emulated_s": r.train_time_s}  # fmt: skip


def episode(d: dict, seed: int, shots: int, queries: int) -> tuple[tuple, tuple]:
    """A 5-way ``shots``-shot episode of the target pool: (train x, y), (query x, y)."""
    rng = np.random.default_rng(seed)
    tr, te = [], []
    for c in range(WAYS):
        idx = rng.permutation(np.flatnonzero(d["tgt_y"] == c))
        tr.append(idx[:shots])
        te.append(idx[shots : shots + queries])
    tr, te = np.concatenate(tr), np.concatenate(te)
    return (d["tgt_x"][tr], d["tgt_y"][tr]), (d["tgt_x"][te], d["tgt_y"][te])


def ci95(v: list[float]) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.975, len(v) - 1) * np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")


def lr_text(lr: float | dict) -> str:
    """An lr for a table: ``0.01``, or per group ``head 0.1, bias 0.003``."""
    return ", ".join(f"{k} {v:g}" for k, v in lr.items()) if isinstance(lr, dict) else f"{lr:g}"


def lr_cell(arm: dict) -> str:
    """An arm's chosen lr (:func:`tune_and_run`'s output), with each search still at its grid's edge marked:
    ``0.1 (lr at top edge)``, where the widening limit bound."""
    edges = ", ".join(f"{x['group']} at {x['edge']} edge" for x in arm.get("searches", ()) if x["edge"])
    return lr_text(arm["lr"]) + (f" ({edges})" if edges else "")


def _search(
    arm: dict, tasks, lrs: tuple, max_widen: int, rec: dict, log, group: str = "", base: dict | None = None
) -> float:
    """One lr search of ``arm`` on ``tasks('val', 0)`` (:func:`fedelastic.comparisons.comparison.tune_lr`): of its
    single lr, or of ``group``'s with the other groups at ``base``; appended to ``rec``."""

    def score(x: float) -> float:
        lr = {**base, group: x} if group and base else x
        rows = [run_task(STATE, arm, lr, ts, tr, te, st, b) for tr, te, st, b, ts in tasks("val", 0)]
        ok = [r["accuracy"] for r in rows if not r["diverged"]]
        rec["tuning"].append({"group": group or "lr", "lr": lr, "mean": float(np.mean(ok)) if ok else float("nan"),
                              "diverged": len(rows) - len(ok)})  # fmt: skip
        return rec["tuning"][-1]["mean"]

    s = tune_lr(score, lrs, max_widen)
    rec["searches"].append({"group": group or "lr", "chosen": s.chosen, "edge": s.edge, "added": s.added})
    if s.edge:
        log(f"  {arm['label']}: {group or 'lr'} {s.chosen:g} still at the {s.edge} edge after {s.added} rate(s) added")
    return s.chosen if s.chosen is not None else min(lrs)  # nothing usable: the smallest rate


def fork_map(fn, items: list, jobs: int, name=str) -> list:
    """``[fn(item) for item in items]``, each call in a forked process, ``jobs`` at a time (forked: nothing
    of this module, loaded by path, is pickled but the results). A call that raises, or whose process
    dies, raises ``RuntimeError`` naming ``name(item)``. Fork only before any backward pass in this
    process: on a machine with a GPU the first one starts autograd's device threads, and forked children
    then refuse autograd (:func:`pretrained` pretrains on a GPU in a subprocess of its own for that)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()

    def work(i: int) -> None:
        try:
            results.put((i, fn(items[i]), ""))
        except BaseException as exc:  # noqa: BLE001 (reported to the parent, which raises it)
            results.put((i, None, f"{type(exc).__name__}: {exc}"))

    parts: dict[int, Any] = {}
    for first in range(0, len(items), jobs):
        procs = {i: ctx.Process(target=work, args=(i,)) for i in range(first, min(first + jobs, len(items)))}
        for p in procs.values():
            p.start()
        while not set(procs) <= set(parts):
            try:
                i, part, error = results.get(timeout=30)
            except queue.Empty:
                dead = [i for i, p in procs.items() if i not in parts and p.exitcode not in (None, 0)]
                if dead:  # killed (e.g. out of memory) before it could report
                    raise RuntimeError(
                        f"{name(items[dead[0]])}: its process died (exit {procs[dead[0]].exitcode})"
                    ) from None
                continue
            if error:
                raise RuntimeError(f"{name(items[i])}: {error}")
            parts[i] = part
        for p in procs.values():
            p.join()
    return [parts[i] for i in range(len(items))]


def tune_and_run_parallel(
    arms: list[dict], tasks, seeds: list[int], jobs: int, lrs: tuple = LRS, max_widen: int = 3
) -> dict:
    """:func:`tune_and_run` with each arm in its own forked process (one torch thread each): the same runs
    and numbers (each run seeds itself), except that an arm with ``start`` makes its own single-lr search
    first (the one it would have started from, again). Call it before any backward pass in this process:
    on a machine with a GPU, torch's first backward, even on the CPU, starts the autograd device threads,
    after which forked children refuse autograd (the void first device run)."""
    if jobs <= 1:
        return tune_and_run(arms, tasks, seeds, lrs=lrs, max_widen=max_widen)

    def one(arm: dict) -> dict:
        alone = {k: v for k, v in arm.items() if k != "start"}
        return tune_and_run([alone], tasks, seeds, lrs=lrs, max_widen=max_widen)

    parts = fork_map(one, arms, jobs, name=lambda arm: f"arm {arm['label']}")
    return {k: v for part in parts for k, v in part.items()}


def tune_and_run(arms: list[dict], tasks, seeds: list[int], log=print, lrs: tuple = LRS, max_widen: int = 3) -> dict:
    """Per arm: the best lr on ``tasks('val', 0)``, then every seed's ``tasks('test', seed)`` list at it.

    ``tasks(split, key)`` returns a list of ``(train, test, steps, batch, task_seed)``. The lr is the
    best of ``lrs``, the grid widened past its edge while the pick sits there, up to ``max_widen``
    rates (:func:`fedelastic.comparisons.comparison.tune_lr`). An arm with ``lr_groups`` (e.g. ``["head", "bias"]``,
    :data:`LR_GROUPS`) gets one lr per group, tuned one group at a time (the others held), starting
    from the chosen lr of the arm named by ``start`` (run earlier) or from its own single-lr search.
    Each search is recorded with its ``edge`` (``top``/``bottom``: the limit bound there) and ``added``.
    An arm's ``prepare`` (a callable) runs first, its result kept as ``prepared``.
    """
    out: dict = {}
    for arm in arms:
        t0 = time.time()
        rec: dict = {"tuning": [], "searches": [], "prepared": arm["prepare"]() if arm.get("prepare") else None}
        if arm["strategy"] == "none":
            lr: float | dict = 0.0
        elif arm.get("lr_groups"):
            start = (
                out[arm["start"]]["lr"] if arm.get("start") in out else _search(arm, tasks, lrs, max_widen, rec, log)
            )
            lr = dict.fromkeys(arm["lr_groups"], start)
            for group in arm["lr_groups"]:
                lr[group] = _search(arm, tasks, lrs, max_widen, rec, log, group, dict(lr))
        else:
            lr = _search(arm, tasks, lrs, max_widen, rec, log)

        runs = []
        for seed in seeds:
            runs += [
                dict(run_task(STATE, arm, lr, ts, tr, te, st, b), seed_group=seed)
                for tr, te, st, b, ts in tasks("test", seed)
            ]
        per_seed = []
        for seed in seeds:
            ok = [r["accuracy"] for r in runs if r["seed_group"] == seed and not r["diverged"]]
            per_seed.append(float(np.mean(ok)) if ok else float("nan"))
        out[arm["label"]] = {"lr": lr, **rec, "runs": runs, "per_seed": per_seed,
                             "mean": float(np.nanmean(per_seed)), "ci95": ci95(per_seed),
                             "diverged": sum(r["diverged"] for r in runs), "n": len(runs),
                             "fits_device": all(r["fits"] for r in runs),
                             "reason": next((r.get("device_reason", "") for r in runs if r.get("device_reason")), ""),
                             "peak_memory_kib": float(np.mean([r.get("peak_memory_kib", 0.0) for r in runs])),
                             "trained_fraction": float(np.mean([r.get("trained_fraction", 0.0) for r in runs])),
                             "wall_s": time.time() - t0}  # fmt: skip
        log(f"  {arm['label']}: lr {lr_text(lr)}, mean {out[arm['label']]['mean']:.3f} ± {out[arm['label']]['ci95']:.3f} "
            f"per seed {np.round(per_seed, 3).tolist()}, diverged {out[arm['label']]['diverged']}, "
            f"fits device {out[arm['label']]['fits_device']}, {time.time() - t0:.0f} s")  # fmt: skip
    return out


def gain(out: dict, a: str, b: str) -> dict:
    """``a - b`` in points: mean over seeds and the 95% interval of the per-seed paired differences."""
    diff = [100 * (x - y) for x, y in zip(out[a]["per_seed"], out[b]["per_seed"])]
    m, h = float(np.mean(diff)), ci95(diff)
    return {"mean": m, "lo": m - h, "hi": m + h, "per_seed": diff}


STATE: dict = {}  # the pretrained weights, set by the caller (setup)


def setup(pretrain_epochs: int = 15, device: str = "cpu") -> dict:
    d = load_data()
    STATE.clear()
    STATE.update(pretrained(d, pretrain_epochs, device))
    model, _ = new_model()
    model.load_state_dict(STATE)
    d["source_accuracy"] = accuracy(model, d["src_x"], d["src_y"])[0]
    return d


if __name__ == "__main__":  # ``--pretrain EPOCHS DEVICE``: the subprocess :func:`pretrained` starts for a GPU
    if sys.argv[1:2] != ["--pretrain"] or len(sys.argv) != 4:
        raise SystemExit(f"usage: {sys.argv[0]} --pretrain EPOCHS DEVICE")
    pretrained(load_data(), int(sys.argv[2]), sys.argv[3])
