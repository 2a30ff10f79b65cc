"""Time a model's layers with torch: per-layer ``fwd``/``dx``/``dw`` tables, and facts about the host.

Measuring (:func:`measure_layers`)
----------------------------------
On a fixed batch, with ``torch.set_num_threads`` fixed by the caller (the count is recorded in
every source), the whole model runs three kinds of passes, each time-stamped per layer (a
module that owns parameters, as in :class:`~fedelastic.modelinfo.ModelInfo`) by forward hooks
on every layer and tensor hooks on every layer's output (the moment backward reaches it):

- *train*: full training steps, training mode, every parameter trainable;
- *eval-train*: the same with batch norms in eval mode;
- *frozen*: eval mode, no autograd: what a layer below the trained part costs.

The forward between the end of one layer and the end of the next is that next layer's (its
weightless ops included); the backward between two consecutive stamps is the layer's dX and dW
plus the weightless ops below it, which is the cost model's convention (the backward of
weightless ops between layer L and L+1 goes to L+1's dx). Each layer is also timed **in
isolation** on its captured input (forward with autograd on; dX = ``autograd.grad`` wrt the
input with the parameters frozen; dW = ``autograd.grad`` wrt the parameters with the input not
requiring grad; medians after warm-up), which splits its in-graph backward into dX and dW.

Training costs more than the sum of frozen forwards and backward kernels on a CPU: autograd
keeps activations (allocations, page faults) and a batch norm in training mode computes batch
statistics (~5x its eval-mode forward). The table charges each of these where the cost model
pays for it: autograd's extra forward to ``dx`` (paid by every layer above the deepest trained
tensor), training mode to a norm's ``dw`` (the trainer runs a norm in training mode only when
one of its tensors trains), so that the cost model's constant forward is the frozen one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..devices.clocks import CLOCKS, _median_time, get_clock  # noqa: F401  (re-exported: measure.get_clock, measure.CLOCKS)
from ..devices.profile import LayerTiming, MeasuredTable
from ..modelinfo import first_tensor

_NORMS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")


def _state_copy(model):
    """A detached copy of ``model``'s state dict that keeps its ``_metadata`` (module versions:
    torchvision's MNASNet, for one, refuses a state dict without them)."""
    state = model.state_dict()
    copy = type(state)((k, v.detach().clone()) for k, v in state.items())
    copy._metadata = getattr(state, "_metadata", None)  # type: ignore[attr-defined]
    return copy


def _owner_layers(model) -> list[tuple[str, Any]]:
    """Modules that own parameters directly, in ``named_modules()`` order (as ModelInfo)."""
    return [(n, m) for n, m in model.named_modules() if next(iter(m.parameters(recurse=False)), None) is not None]


def _is_norm(module) -> bool:
    """Batch norms: the trainer runs them in eval mode when none of their tensors trains."""
    return type(module).__name__ in _NORMS


@dataclass
class _Captured:
    args: tuple
    kwargs: dict


def _capture_inputs(model, sample, owners) -> dict[str, _Captured]:
    import torch

    captured: dict[str, _Captured] = {}

    def detach(t):
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    def hook(name):
        def fn(_mod, args, kwargs, _out):
            if name not in captured:
                captured[name] = _Captured(tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()})

        return fn

    handles = [mod.register_forward_hook(hook(name), with_kwargs=True) for name, mod in owners]
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for h in handles:
            h.remove()
    return captured


def _time_isolated(
    mod, cap: _Captured, repeats: int, warmup: int, clock: Callable[[], float]
) -> tuple[float, float, float]:
    """(fwd, dx, dw) seconds of one layer on its captured input, in the module's current mode."""
    import torch

    params = list(mod.parameters(recurse=False))
    x = cap.args[0] if cap.args and isinstance(cap.args[0], torch.Tensor) else None
    floating = x is not None and x.is_floating_point()

    def call(inp):
        args = (inp, *cap.args[1:]) if x is not None else cap.args
        return first_tensor(mod(*args, **cap.kwargs))

    for p in params:
        p.requires_grad_(True)
    fwd = _median_time(lambda: call(x), repeats, warmup, clock)
    y = call(x)
    dy = torch.randn_like(y)
    dw = _median_time(lambda: torch.autograd.grad(y, params, dy, retain_graph=True), repeats, warmup, clock)
    dx = 0.0
    if floating:
        for p in params:
            p.requires_grad_(False)
        xg = x.detach().requires_grad_(True)
        y = call(xg)
        if y.requires_grad:
            dx = _median_time(lambda: torch.autograd.grad(y, xg, dy, retain_graph=True), repeats, warmup, clock)
        for p in params:
            p.requires_grad_(True)
    return fwd, dx, dw


def _stamped_pass(model, sample, target, owners, optimizer, loss_fn, clock, train: bool) -> dict[str, Any]:
    """One forward (and, if ``train``, backward and optimizer step) with time stamps per layer.

    Forward hooks stamp every layer's start and end; when the pass trains, a tensor hook on every
    layer's output stamps the moment backward reaches it.
    """
    import torch

    stamps: dict[str, list[float]] = {}
    bwd: list[tuple[float, str]] = []

    def pre(name):
        def fn(_mod, _args):
            stamps.setdefault(name, [clock(), 0.0])

        return fn

    def post(name):
        def fn(_mod, _args, out):
            s = stamps[name]
            if s[1] == 0.0:
                s[1] = clock()
                o = first_tensor(out)
                if o is not None and o.requires_grad:
                    o.register_hook(lambda _g: bwd.append((clock(), name)))

        return fn

    handles = []
    for name, mod in owners:
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post(name)))
    try:
        if not train:
            with torch.no_grad():
                t0 = clock()
                model(sample)
                t1 = t2 = t3 = clock()
        else:
            optimizer.zero_grad(set_to_none=True)
            t0 = clock()
            loss = loss_fn(model(sample), target)
            t1 = clock()
            loss.backward()
            t2 = clock()
            optimizer.step()
            t3 = clock()
    finally:
        for h in handles:
            h.remove()
    return {"t": (t0, t1, t2, t3), "stamps": stamps, "bwd": bwd}


def _summarise(runs: list[dict[str, Any]], names: list[str]) -> dict[str, np.ndarray]:
    """Per-layer medians over stamped passes.

    ``fwd[l]``: from the end of the previous layer to the end of layer l (its forward plus the
    weightless ops just below it); ``bwd[l]``: from backward reaching layer l's output to
    backward reaching the next layer (its dx and dw plus the weightless ops below it);
    ``totals``: step, forward, backward, optimizer, unattributed forward (after the last layer,
    the loss), unattributed backward (before the first layer, the loss gradient).
    """
    order = {n: i for i, n in enumerate(names)}
    fwd = np.zeros((len(runs), len(names)))
    bwd = np.zeros((len(runs), len(names)))
    totals = np.zeros((len(runs), 6))
    for r, run in enumerate(runs):
        t0, t1, t2, t3 = run["t"]
        prev_end = t0
        for _, end, n in sorted((s[0], s[1], n) for n, s in run["stamps"].items() if n in order):
            fwd[r, order[n]] = max(end - prev_end, 0.0)
            prev_end = max(prev_end, end)
        events = sorted(e for e in run["bwd"] if e[1] in order)
        for k, (ts, n) in enumerate(events):
            nxt = events[k + 1][0] if k + 1 < len(events) else t2
            bwd[r, order[n]] += nxt - ts
        first_bwd = events[0][0] if events else t2
        totals[r] = (t3 - t0, t1 - t0, t2 - t1, t3 - t2, t1 - prev_end, first_bwd - t1)
    return {"fwd": np.median(fwd, axis=0), "bwd": np.median(bwd, axis=0), "totals": np.median(totals, axis=0)}


def measure_layers(
    model,
    sample,
    *,
    model_name: str = "model",
    target=None,
    repeats: int = 10,
    warmup: int = 2,
    source: str = "",
    clock: str = "wall",
    progress: Callable[[str], None] | None = None,
) -> MeasuredTable:
    """Measure per-layer ``fwd``/``dx``/``dw`` seconds of one training step of ``model``.

    Three kinds of stamped passes over the whole model (``repeats`` each, after ``warmup``):
    *frozen* (eval mode, no autograd: what a layer below the trained part costs), *eval-train*
    (eval mode, every parameter trainable) and *train* (training mode, every parameter
    trainable: full training as the trainer runs it). Then every layer is timed in isolation
    (forward, dX, dW) in training mode, and batch norms in eval mode too. The table holds:

    - ``fwd``: the frozen forward of the layer and of the weightless ops just below it;
    - ``dx``: the eval-train backward of the layer and the weightless ops below it, less its
      ``dw`` (split off by the isolated dX:dW ratio), plus what autograd adds to the forward
      when gradients flow (eval-train minus frozen forward). The cost model charges ``dx`` to
      every layer above the deepest trained tensor, exactly the layers that pay these;
    - ``dw``: the layer's parameter gradients; for a batch norm also the extra forward and
      backward of training mode (batch statistics), which the trainer pays only when one of
      the norm's tensors trains.

    Parameters
    ----------
    model : torch.nn.Module
        Stepped a few times with a negligible learning rate; its state is restored.
    sample : torch.Tensor
        One batch of inputs; its first dimension is the batch size of the table.
    model_name : str
        Name stored in the table (the key of ``[measured.<model>]``).
    target : torch.Tensor, optional
        Labels for the cross-entropy loss (default: random classes of the model's output).
    repeats, warmup : int
        Timed and untimed runs of every measurement; medians are kept.
    source : str
        Provenance text of the table.
    clock : str
        ``wall`` (default) or ``cpu``: CPU time of the calling thread, for a machine shared
        with other work (needs one torch thread; autograd runs CPU backward on the caller).
    progress : callable, optional
        Called with a short message as the measurement goes.

    Returns
    -------
    fedelastic.devices.profile.MeasuredTable
        Keys are the torch module names of the layers, in forward order. ``step_s`` is a full
        training step (forward, backward, SGD-with-momentum update), ``forward_s`` and
        ``backward_s`` its parts, ``other_s`` the optimizer update.
    """
    import torch

    say = progress or (lambda _msg: None)
    clock_fn = get_clock(clock)
    owners_all = _owner_layers(model)
    owners = [(n, m) for n, m in owners_all if not any(True for _ in m.children())]
    nested = [n for n, m in owners_all if any(True for _ in m.children())]
    if nested:
        say(f"left to the roofline (they own parameters and have children): {nested}")
    names = [n for n, _ in owners]
    norms = {n for n, m in owners if _is_norm(m)}
    state = _state_copy(model)
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    loss_fn = torch.nn.functional.cross_entropy
    try:
        for p in model.parameters():
            p.requires_grad_(True)
        if target is None:
            with torch.no_grad():
                classes = model.eval()(sample).shape[-1]
            target = torch.randint(0, classes, (sample.shape[0],), generator=torch.Generator().manual_seed(0))
            target = target.to(sample.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-12, momentum=0.9)

        def passes(train_mode: bool, grads: bool) -> dict[str, np.ndarray]:
            model.train(train_mode)
            runs = [
                _stamped_pass(model, sample, target, owners, optimizer, loss_fn, clock_fn, grads)
                for _ in range(warmup + repeats)
            ]
            return _summarise(runs[warmup:], names)

        # full training steps first: they grow the allocator's heap to its working size, so the
        # passes after them do not pay first-touch page faults
        say("training steps")
        full = passes(True, True)
        say("eval-mode training steps")
        evaltrain = passes(False, True)
        say("frozen forward passes")
        frozen = passes(False, False)

        say(f"{len(owners)} layers in isolation")
        captured = _capture_inputs(model.train(), sample, owners)
        iso_train, iso_eval = {}, {}
        for name, mod in owners:
            if name not in captured:
                continue
            mod.train()
            iso_train[name] = _time_isolated(mod, captured[name], repeats, warmup, clock_fn)
            if name in norms:
                mod.eval()
                iso_eval[name] = _time_isolated(mod, captured[name], repeats, warmup, clock_fn)
                mod.train()
    finally:
        model.load_state_dict(state)
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)

    # Corrections (autograd, training mode) are differences of medians: kept signed so that noise
    # cancels over layers instead of adding up; only the final entries are clipped at zero.
    layers = {}
    for i, n in enumerate(names):
        if n not in iso_train:
            continue
        _, dx_e, dw_e = iso_eval.get(n, iso_train[n])
        share = dw_e / (dx_e + dw_e) if dx_e + dw_e > 0 else 1.0
        seg = evaltrain["bwd"][i]
        autograd = evaltrain["fwd"][i] - frozen["fwd"][i]
        dw = seg * share
        dx = seg - dw + autograd
        if i == 0:  # nothing flows below the first layer: its backward is dW only, and pays the autograd share
            dw, dx = seg + autograd, iso_train[n][1]
        if n in norms:  # training mode (batch statistics) only when the norm trains
            dw += (full["fwd"][i] - evaltrain["fwd"][i]) + (full["bwd"][i] - seg)
        layers[n] = LayerTiming(float(frozen["fwd"][i]), float(max(dx, 0.0)), float(max(dw, 0.0)))
    tot = full["totals"]
    return MeasuredTable(
        model=model_name,
        batch_size=int(sample.shape[0]),
        source=source,
        layers=layers,
        step_s=float(tot[0]),
        forward_s=float(tot[1]),
        backward_s=float(tot[2]),
        other_s=float(tot[3]),
        unattributed_fwd_s=float(evaltrain["totals"][4]),
        unattributed_bwd_s=float(tot[5]),
        n_steps=repeats,
    )


def measure_peak_flops(size: int = 1024, repeats: int = 10, warmup: int = 2, clock: str = "wall") -> tuple[float, str]:
    """FP32 matrix-multiply throughput of this machine (FLOP/s) and how it was measured."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    t = _median_time(lambda: torch.mm(a, b), repeats, warmup, get_clock(clock))
    return 2.0 * size**3 / t, f"torch.mm {size}x{size} fp32, median of {repeats}"


def measure_scalar_rate(units: int = 160, repeats: int = 5, warmup: int = 1, clock: str = "wall") -> tuple[float, str]:
    """The selector's counted operations per second on this machine, and how it was measured.

    Times the exact DP (:func:`fedelastic.selection.budgeted.select_exact`, as ElasticTrainer's strategies
    call it) on a seeded random instance of ``units`` tensors (ResNet-50 has 161) at half the
    backward budget, and divides the operations it counts by its median time: the rate
    ``compute.scalar_ops_per_s`` prices every selector's counted work at.
    """
    from ..selection.budgeted import select_exact

    rng = np.random.default_rng(0)
    importance, t_dw, t_dx = rng.lognormal(0.0, 1.0, units), rng.uniform(1e-4, 1e-3, units), rng.uniform(1e-4, 1e-3, units)
    budget = 0.5 * float(t_dw.sum() + t_dx.sum())
    ops: list[float] = []
    select_exact(importance, t_dw, t_dx, budget, ops=ops)
    t = _median_time(lambda: select_exact(importance, t_dw, t_dx, budget), repeats, warmup, get_clock(clock))
    counted = float(sum(ops))
    return counted / t, (
        f"the exact selector DP on a seeded {units}-tensor instance, {counted:.3g} counted operations "
        f"in {1e3 * t:.3g} ms, median of {repeats}"
    )


def _rapl_zones(root: Path) -> list[Path]:
    """Top-level RAPL zones (one per package: ``intel-rapl:N``, not their ``:N:M`` subzones) with a readable counter."""
    zones = sorted((root / "sys/class/powercap").glob("intel-rapl:*"))
    return [z for z in zones if z.name.count(":") == 1 and os.access(z / "energy_uj", os.R_OK)]


def _ina_rails(root: Path) -> list[Path]:
    """A Jetson's INA3221 power readings (``in_power<N>_input``, mW): the module input rail ``VDD_IN``
    alone where one is named so (it already holds the others), else every rail."""
    rails = sorted((root / "sys/bus/i2c/drivers/ina3221x").glob("*/iio:device*/in_power*_input"))
    rails = [r for r in rails if os.access(r, os.R_OK)]

    def name(rail: Path) -> str:
        label = rail.with_name("rail_name_" + rail.name.removeprefix("in_power").removesuffix("_input"))
        return label.read_text().strip() if label.exists() else ""

    whole = [r for r in rails if name(r) == "VDD_IN"]
    return whole or rails


def measure_power(
    work: Callable[[], Any],
    seconds: float = 2.0,
    samples: int = 5,
    root: str | Path = "/",
    clock: Callable[[], float] = time.monotonic,
) -> tuple[float, float, str] | None:
    """Mean whole-device power (W) while ``work`` runs over and over for ``seconds``, the relative
    standard deviation of its ``samples`` slices, and how it was read; None where the machine exposes
    no power sensor (a VM, most ARM boards without a Jetson's rails).

    Read from RAPL on x86 (``/sys/class/powercap/intel-rapl:N/energy_uj``, the package counters
    summed, wrap-around handled) or a Jetson's INA3221 rails (``/sys/bus/i2c/drivers/ina3221x/...``,
    instantaneous mW, read at the end of each slice). RAPL counts the CPU package and DRAM, not the
    board: a lower bound of the wall draw. ``root`` is where ``/sys`` is (a test's fake tree).
    """
    root = Path(root)
    zones, rails = _rapl_zones(root), _ina_rails(root)
    if not zones and not rails:
        return None

    def counters() -> list[float]:
        return [float((z / "energy_uj").read_text()) for z in zones]

    # a counter wraps at its max_energy_range_uj: a slice's delta is taken modulo it, per zone
    ranges = [float((z / "max_energy_range_uj").read_text()) if (z / "max_energy_range_uj").exists() else math.inf for z in zones]
    powers = []
    for _ in range(samples):
        e0, t0 = counters(), clock()
        while True:
            work()
            t1 = clock()
            if t1 - t0 >= seconds / samples:
                break
        if zones:
            spent = sum((e1 - e) % r if math.isfinite(r) else e1 - e for e, e1, r in zip(e0, counters(), ranges))
            powers.append(spent / 1e6 / (t1 - t0))
        else:
            powers.append(sum(float(r.read_text()) for r in rails) / 1e3)
    mean = float(np.mean(powers))
    spread = float(np.std(powers) / mean) if mean > 0 else 0.0
    how = (
        f"RAPL package energy counters ({len(zones)} zone(s): CPU package and DRAM, not the whole board)"
        if zones
        else f"Jetson INA3221 rail(s) {', '.join(r.parent.name + '/' + r.name for r in rails)}"
    )
    return mean, spread, f"{how}, mean of {samples} slices over {seconds:g} s (relative sd {spread:.1%})"


def measure_copy_bandwidth(
    sizes_mib: tuple[int, ...] = (1, 8, 64), repeats: int = 10, warmup: int = 2, clock: str = "wall"
) -> tuple[float, str]:
    """The best memory copy bandwidth of this machine (B/s: bytes read plus written) and how it was measured.

    Timed like :func:`measure_peak_flops` (``Tensor.copy_`` of fp32 buffers, median of
    ``repeats``); the best over buffer sizes, caches included, so it bounds what any layer can
    stream: a fitted ``mem_bandwidth`` above it is not physical.
    """
    import torch

    best, at = 0.0, sizes_mib[0]
    for mib in sizes_mib:
        src = torch.randn(mib * 2**18)  # fp32: 2**18 elements per MiB
        dst = torch.empty_like(src)
        t = _median_time(lambda d=dst, s=src: d.copy_(s), repeats, warmup, get_clock(clock))
        bandwidth = 2.0 * src.numel() * 4 / t
        if bandwidth > best:
            best, at = bandwidth, mib
    return best, f"Tensor.copy_ fp32, best of {', '.join(map(str, sizes_mib))} MiB (at {at} MiB), median of {repeats}"


def host_memory_available() -> tuple[float, str]:
    """Bytes of memory available to a new process now, and where the number comes from.

    ``psutil.virtual_memory().available`` when psutil is installed, else ``MemAvailable`` of
    ``/proc/meminfo`` (Linux), else total physical memory from ``os.sysconf``.
    """
    try:
        import psutil

        return float(psutil.virtual_memory().available), "psutil.virtual_memory().available"
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0, "MemAvailable of /proc/meminfo"
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "total physical memory (os.sysconf)"


def host_description() -> str:
    """``<host> (<cpu>)``, for sources."""
    import platform
    import socket

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{socket.gethostname()} ({cpu or platform.processor() or platform.machine()})"
