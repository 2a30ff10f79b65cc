"""Vectorised cohort training: many clients trained as one batched model (``torch.func.vmap``).

:func:`train_cohort_vmap` gives each client of a cohort what :func:`fedelastic.training.train_local`
would give it, started from the same weights, but runs the cohort's steps together: the clients'
parameters are stacked along a new first dimension and one ``vmap(grad(functional_call(...)))``
call computes every client's gradient of its own batch at once. The host side is the same as
``train_local``'s, client by client: the seeded batch order (``seed``, e.g. ``[seed, round, pid]``),
the selections, their pricing on the client's :class:`~fedelastic.costmodel.CostModel`, memory
failures and the reported figures.

* Step ``t`` runs the clients that have a ``t``-th batch (the others are not computed and keep
  their parameters); a short batch is padded with zero-weight samples to the step's widest batch,
  so its loss and gradient are the mean over its valid samples only.
* The optimizer is ``train_local``'s, written out on the stacked tensors: SGD with momentum and
  coupled weight decay (torch's formula), or SGDW (decoupled decay), constant or cosine rate.
* Selections of whole tensors (``full``, ``last_layer``, ``bn_bias``, and any strategy without a
  probe whose selections keep no partial tensor) are masks: an unselected tensor keeps its value
  and momentum. Strategies with a probe (``elastic_*``, ``tinytrain``), channel-sparse selections,
  BatchNorm in train mode (``train.bn_mode = "train"`` on a model with norm layers), active
  dropout and emulated int8/fp16 numerics are refused with an error naming the key.

The weights agree with the per-client loop to float32 rounding, not bit for bit: a batched
convolution is a grouped convolution with its own summation order, and the padded loss sums the
same terms in another order (tests/test_vectorized.py states the tolerance).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from .costmodel import CostModel
from .data import ArrayDataset
from .modelinfo import ModelInfo
from .selection import Selection, SelectionContext, SelectionStrategy
from .training import _NORM_TYPES, OPTIMIZERS, SCHEDULES, LocalResult, _set_norm_modes, batches


@dataclass
class _Plan:
    """One client's host-side plan: its batches, what each step trains, and its figures so far."""

    result: LocalResult
    steps: list[np.ndarray]  # index batch of each step that runs
    masks: list[np.ndarray]  # bool per tensor, per step that runs
    lrs: list[float]
    union: np.ndarray
    planned: int = 0  # batches in the plan, whether or not they train
    failed: str = ""
    losses: list[float] = field(default_factory=list)


def _refuse(key: str, expected: str, got: object) -> ValueError:
    return ValueError(f"vectorised training ({key}): expected {expected}, got {got!r}")


def _plan_client(
    info: ModelInfo,
    strategy: SelectionStrategy,
    cost: CostModel,
    n: int,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    max_steps: int,
    seed: int | list[int],
    lr_schedule: str,
) -> _Plan:
    """``train_local``'s loop without the tensors: batch order, selections, pricing, failure."""
    if strategy.probe is not None:
        raise _refuse(
            "train.strategy", "a strategy without a probe (full, last_layer, bn_bias, ...)", type(strategy).__name__
        )
    rng = np.random.default_rng(seed)  # seed_everything's stream; torch's RNG is not used here (no dropout)
    rng.integers(2**62)
    order = list(batches(n, batch_size, epochs, rng, max_steps))
    plan = _Plan(LocalResult(fits=True, num_examples=n), [], [], [], np.zeros(info.num_tensors), len(order))
    result = plan.result
    steps_per_epoch = -(-n // batch_size)
    memory = cost.device.memory_train_bytes.value
    selection: Selection | None = None
    step_time = step_macs = 0.0
    for step, idx in enumerate(order):
        if selection is None or strategy.should_reselect(step, steps_per_epoch):
            ctx = SelectionContext(info, cost, step, rng)
            evaluations = cost.evaluations
            selection = strategy.select(ctx)
            partial = selection.channels or (
                selection.input_sparse is not None
                and np.any(np.asarray(selection.input_sparse, bool) & (selection.ratios > 0) & (selection.ratios < 1))
            )
            if partial or np.any((selection.ratios > 0) & (selection.ratios < 1)):
                raise _refuse("train.strategy", "selections of whole tensors", type(strategy).__name__)
            selector_s = 0.0 if strategy.offline else cost.selector_time_s(cost.evaluations - evaluations, ctx.ops)
            result.selector_time_s += selector_s
            result.overhead_time_s += selector_s
            peak = cost.peak_memory_bytes(selection.ratios, selection.input_sparse)
            result.peak_memory_bytes = max(result.peak_memory_bytes, peak)
            if peak > ctx.memory_budget_bytes:
                plan.failed = f"the selection needs {peak:.0f} bytes; the device has {memory:.0f}"
                return plan
            result.selections += 1
            plan.union = np.maximum(plan.union, selection.ratios)
            step_time, step_macs = cost.step_time_s(selection.ratios), cost.step_macs(selection.ratios)
        if not selection.mask.any():
            continue
        plan.steps.append(idx)
        plan.masks.append(selection.mask.copy())
        plan.lrs.append(lr * 0.5 * (1 + np.cos(np.pi * step / len(order))) if lr_schedule == "cosine" else lr)
        result.train_time_s += step_time
        result.macs += step_macs
        result.steps += 1
    return plan


def _check_model(model: nn.Module, bn_mode: str) -> None:
    if bn_mode == "train" and any(isinstance(m, _NORM_TYPES) for m in model.modules()):
        raise _refuse(
            "train.bn_mode", '"frozen" on a model with BatchNorm (batch statistics are not vectorised)', bn_mode
        )
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            raise _refuse("model.name", "a model without active dropout", f"{name}: {type(m).__name__}(p={m.p})")


def train_cohort_vmap(
    model: nn.Module,
    info: ModelInfo,
    strategies: list[SelectionStrategy],
    costs: list[CostModel],
    datasets: list[ArrayDataset],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    max_steps: list[int] | int = 0,
    seeds: list[int | list[int]],
    bn_mode: str = "frozen",
    optimizer: str = "sgd",
    lr_schedule: str = "constant",
    numerics: list | None = None,
) -> list[LocalResult]:
    """Train every client ``i`` from ``model``'s weights on ``datasets[i]`` (see the module doc).

    The arguments are ``train_local``'s, one entry per client in ``strategies``, ``costs``,
    ``datasets``, ``seeds`` (and ``max_steps`` if a list). ``model`` is left unchanged; it sets
    the device and dtype of the computation. Returns one :class:`LocalResult` per client, as
    ``train_local`` would; ``host_wall_s`` is the cohort's wall time shared out by steps.
    """
    start = time.perf_counter()
    n_clients = len(datasets)
    if not (len(strategies) == len(costs) == len(seeds) == n_clients):
        raise ValueError("strategies, costs, datasets and seeds need one entry per client")
    caps = max_steps if isinstance(max_steps, list) else [max_steps] * n_clients
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {optimizer!r}")
    if lr_schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule: expected one of {SCHEDULES}, got {lr_schedule!r}")
    for nm in numerics or []:
        if nm is not None and nm.dtype != "fp32":
            raise _refuse("train.numerics", "fp32 training", nm.dtype)
    for cost in costs:
        if bn_mode != cost.bn_mode:
            raise ValueError(f"bn_mode {bn_mode!r} differs from the cost model's {cost.bn_mode!r}")
    _check_model(model, bn_mode)
    plans = [
        _plan_client(
            info,
            s,
            c,
            len(d),
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            max_steps=cap,
            seed=seed,
            lr_schedule=lr_schedule,
        )
        for s, c, d, cap, seed in zip(strategies, costs, datasets, caps, seeds)
    ]
    _set_norm_modes(model, bn_mode)
    names = list(info.tensor_names)
    given = dict(model.named_parameters())
    dev = given[names[0]].device
    base = {k: v.detach() for k, v in given.items()}
    stacked = {k: v.unsqueeze(0).repeat(n_clients, *([1] * v.dim())).contiguous() for k, v in base.items()}
    bufs = {k: torch.zeros_like(v) for k, v in stacked.items()} if momentum > 0 else {}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    xs = [torch.as_tensor(d.x, device=dev) for d in datasets]
    ys = [torch.as_tensor(d.y, device=dev) for d in datasets]

    def loss_fn(params, x, y, w):
        out = functional_call(model, (params, buffers), (x,))
        return (nn.functional.cross_entropy(out, y, reduction="none") * w).sum() / w.sum()

    step_fn = vmap(grad_and_value(loss_fn))
    horizon = max((len(p.steps) for p in plans), default=0)
    for t in range(horizon):
        active = [i for i, p in enumerate(plans) if t < len(p.steps)]  # a failed client runs its steps, then rolls back
        if not active:
            continue
        every = len(active) == n_clients
        act = torch.as_tensor(active, device=dev)
        width = max(len(plans[i].steps[t]) for i in active)  # the longest batch of this step; shorter ones padded
        x = torch.zeros((len(active), width, *xs[active[0]].shape[1:]), dtype=xs[active[0]].dtype, device=dev)
        y = torch.zeros((len(active), width), dtype=ys[active[0]].dtype, device=dev)
        w = torch.zeros((len(active), width), device=dev)
        for row, i in enumerate(active):
            idx = torch.as_tensor(plans[i].steps[t], device=dev)
            x[row, : len(idx)], y[row, : len(idx)], w[row, : len(idx)] = xs[i][idx], ys[i][idx], 1.0
        params = stacked if every else {k: v[act] for k, v in stacked.items()}
        grads, losses = step_fn(params, x, y, w)
        lr_t = torch.tensor([plans[i].lrs[t] for i in active], dtype=torch.float64)
        masks = torch.as_tensor(np.stack([plans[i].masks[t] for i in active]), device=dev)
        with torch.no_grad():
            for k, name in enumerate(names):
                on = masks[:, k]
                if not bool(on.any()):
                    continue
                p, g = params[name], grads[name]
                shape = (-1,) + (1,) * (p.dim() - 1)
                if optimizer == "sgdw" and weight_decay:
                    new_p = p * (1 - lr_t * weight_decay).to(p.dtype).to(dev).view(shape)
                else:
                    new_p = p
                    if weight_decay:
                        g = g + weight_decay * p
                if momentum > 0:
                    buf = bufs[name] if every else bufs[name][act]
                    new_buf = buf * momentum + g
                    g = new_buf
                new_p = new_p - (lr_t.to(p.dtype).to(dev)).view(shape) * g
                keep = on.view(shape)
                if every:
                    stacked[name].copy_(torch.where(keep, new_p, p))
                    if momentum > 0:
                        bufs[name].copy_(torch.where(keep, new_buf, buf))
                else:
                    stacked[name][act] = torch.where(keep, new_p, p)
                    if momentum > 0:
                        bufs[name][act] = torch.where(keep, new_buf, buf)
        for i, loss in zip(active, losses.tolist()):
            plans[i].losses.append(loss)
    wall = time.perf_counter() - start
    total_steps = max(1, sum(len(p.steps) for p in plans))
    results = []
    for i, plan in enumerate(plans):
        r = plan.result
        r.train_time_s += r.overhead_time_s
        r.train_loss = float(np.mean(plan.losses)) if plan.losses else float("nan")
        r.host_wall_s = wall * len(plan.steps) / total_steps
        if plan.failed:
            r.fits, r.reason = False, plan.failed
        else:
            r.ratios = plan.union
            r.trained = {
                names[k]: stacked[names[k]][i].detach().cpu().numpy().copy() for k in np.flatnonzero(plan.union > 0)
            }
            if not r.steps and plan.planned:
                r.reason = (
                    f"strategy {type(strategies[i]).__name__} selected no tensor to train on this device "
                    "(its budget leaves no room beyond the forward pass, e.g. rho at or below the forward share)"
                )
        results.append(r)
    return results


@dataclass
class Job:
    """One virtual client's work in a round (the fields of ``fl.client.CohortJob``, which fits too)."""

    pid: int
    server_round: int
    strategy: SelectionStrategy
    max_steps: int | None = None


def train_partitions_vmap(env, model: nn.Module, jobs: list) -> list[LocalResult]:
    """:func:`fedelastic.fl.client.train_partition` for a cohort of jobs (:class:`Job`, or anything
    with its attributes), in one vectorised call.

    Each job gets the scenario's training settings, its device's cost model and numerics, its
    partition's data of that round and the seed ``[seed, round, pid]``, as ``train_partition``
    gives them; all start from ``model``'s weights (the global model), which stay unchanged.
    """
    from .quant import device_numerics

    t = env.scenario.train
    caps = [t.max_steps if j.max_steps is None else min(j.max_steps, t.max_steps or j.max_steps) for j in jobs]
    return train_cohort_vmap(
        model,
        env.info,
        [j.strategy for j in jobs],
        [env.cost(env.devices[j.pid]) for j in jobs],
        [env.client_data(j.pid, j.server_round) for j in jobs],
        epochs=t.local_epochs,
        batch_size=t.batch_size,
        lr=t.lr,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        max_steps=caps,
        seeds=[[env.scenario.seed, j.server_round, j.pid] for j in jobs],
        bn_mode=env.bn_mode,
        optimizer=t.optimizer,
        lr_schedule=t.lr_schedule,
        numerics=[device_numerics(t, env.profile(env.devices[j.pid]).train_dtype) for j in jobs],
    )
