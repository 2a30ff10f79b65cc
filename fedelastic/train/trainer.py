"""The local trainer: applies a strategy's selections for real and prices every step it runs.

* Unselected parameters get ``requires_grad=False``, so autograd skips their dW, and backprop
  stops below the deepest selected tensor (nothing below it needs a gradient).
* Channel-sparse selections zero the gradient of unselected channels (output channels, or input
  channels picked by weight norm for Sparse Update) and restore those channels' values and
  optimizer state after each step, so they stay exactly unchanged.
* BatchNorm: ``bn_mode = "frozen"`` (default, the seeds': ``training=False`` in every scheme)
  keeps every BatchNorm in inference mode, its running statistics fixed and never sent, while
  gamma and beta stay trainable; ``"train"`` runs a BatchNorm with a trained tensor on batch
  statistics, and its running statistics travel with it.
* The probes a strategy asks for (ElasticTrainer importance, TinyTrain Fisher potential) run on
  the real model over the tensors of the strategy's :meth:`probe_scope`; their peak memory is
  priced (:meth:`CostModel.probe_memory`) and a probe runs on the largest micro-batch that fits
  the device (gradients accumulated, a sum loss over the batch: the same numbers as one pass
  when BatchNorm is frozen), split into pieces of the model when not even one sample fits
  (:meth:`CostModel.probe_segments`). A probe that does not fit at all never runs: the client
  reports ``fits=False``. Probe and selector work (:meth:`CostModel.selector_time_s`) are
  charged to the emulated time.
* A selection that does not fit the device's training memory (or whose frozen weights do not
  fit its flash, on a device with ``memory.flash``) is never trained: the result says
  ``fits=False``; the emulated time already spent in the round is kept, the weights roll back.
* A strategy that :meth:`~SelectionStrategy.carries_selection` (a re-selection interval) starts
  from the selection its last local training left, with the steps run since it: no probe and no
  selector work until the interval is due, whatever the round. A strategy whose probe scope is
  empty (nothing can train: ``ctx.note`` says why) runs no probe and is charged none.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..cost.costmodel import CostModel
from ..data import ArrayDataset
from ..modelinfo import ModelInfo
from ..selection.strategy import Selection, SelectionContext, SelectionStrategy
from .evaluation import evaluate_model as evaluate_model  # re-exported: part of this module's API
from .evaluation import evaluate_predictions as evaluate_predictions
from .optim import SGD, SGDW
from .probes import count_backward_nodes as count_backward_nodes
from .probes import fisher_probe, importance_probe, ordered_params
from .quant import with_numerics

_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
OPTIMIZERS = ("sgd", "sgdw")
SCHEDULES = ("constant", "cosine")


@dataclass
class CohortJob:
    """One virtual client's work in a round: its partition, round, strategy (state loaded) and step cap."""

    pid: int
    server_round: int
    strategy: SelectionStrategy
    max_steps: int | None = None  # a deadline's cap, below the scenario's own


def step_cap(scenario_cap: int, deadline_cap: int | None) -> int:
    """The steps a client may run: the scenario's ``train.max_steps`` (0: no cap), lowered by a deadline's cap."""
    return scenario_cap if deadline_cap is None else min(deadline_cap, scenario_cap or deadline_cap)


@dataclass
class LocalResult:
    """What one client's local training produced."""

    fits: bool
    num_examples: int
    steps: int = 0
    train_loss: float = float("nan")
    trained: dict[str, np.ndarray] = field(default_factory=dict)  # tensors and norm buffers that changed
    channel_masks: dict[str, np.ndarray] = field(default_factory=dict)  # partial tensors: 0/1, broadcastable
    ratios: np.ndarray | None = None  # union over the round's selections
    train_time_s: float = 0.0
    overhead_time_s: float = 0.0  # probes and selector work, included in train_time_s
    selector_time_s: float = 0.0  # the selector's work priced on the device, included in overhead_time_s
    probe_time_s: float = 0.0  # the probes' time, included in overhead_time_s
    probes: int = 0  # probes run (a selection carried from an earlier round, or one with nothing to train, runs none)
    macs: float = 0.0
    compute_time_s: float = 0.0  # of the steps' time, the part at power.compute (0 without phase powers)
    peak_memory_bytes: float = 0.0  # max of training and probes
    probe_peak_memory_bytes: float = 0.0  # largest probe run (or needed, when it did not fit)
    selections: int = 0
    host_wall_s: float = 0.0
    reason: str = ""  # why fits is False, or why a fitting client ran no step


def make_optimizer(params, optimizer: str, lr: float, momentum: float, weight_decay: float) -> SGD:
    """``sgd`` (torch's SGD, weight decay coupled as L2 in the gradient) or ``sgdw`` (decoupled).

    fedelastic's own (:mod:`fedelastic.train.optim`): torch's single-tensor SGD step bit for bit, without
    ``torch.optim``, whose constructor and step import ``torch._dynamo``.
    """
    if optimizer == "sgdw":
        return SGDW(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if optimizer == "sgd":
        return SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {optimizer!r}")


def cost_optimizer(momentum: float) -> str:
    """The cost model's optimizer-state class of what :func:`make_optimizer` builds."""
    return "momentum" if momentum > 0 else "sgd"


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` for a trainer on the CPU, without its per-call cost.

    ``torch.manual_seed`` also queues the seed for every accelerator not yet initialised, and
    records a stack trace with each queued call (about 1 ms, and the queue grows with every
    call): a cost per client per round. The CPU generator gets the same seed; an initialised
    CUDA device is seeded too.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def seed_everything(seed: int | list[int]) -> np.random.Generator:
    """``np.random.default_rng(seed)``, its first draw seeding torch (:func:`seed_torch`).

    A list of ints each in [0, 2**32) is one uint32 word each in numpy's ``SeedSequence`` (its
    documented coercion): handed over as a uint32 array it makes the same generator, without the
    per-element conversion (~20 us of a client's ~70 us seeding).
    """
    if isinstance(seed, list) and all(type(v) is int and 0 <= v < 1 << 32 for v in seed):
        seed = np.array(seed, dtype=np.uint32)  # type: ignore[assignment]
    rng = np.random.default_rng(seed)
    seed_torch(int(rng.integers(2**62)))
    return rng


@contextmanager
def torch_threads(n: int):
    """Run the block on ``n`` torch threads, then restore the count.

    Host-side loops (pretraining, the server's evaluation) run on ``simulation.torch_threads``
    like the clients: torch's default, one thread per core, ran about 15x slower than one thread
    on a loaded 2-core machine.
    """
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class Prepared:
    """What :func:`train_local` derives from a model alone, worked out once for many calls on it.

    A cohort trains many clients one after another on one model: this spares each of them
    walking the module tree (parameters, state dict, modules) and building an optimizer. It
    stays valid while the model's parameters, buffers and modules stay the same objects (loading
    weights copies them in place). The optimizer is reused with its state cleared and its
    learning rate reset: what a fresh one starts from.
    """

    def __init__(self, model: nn.Module, info: ModelInfo):
        self.model, self.info = model, info
        self.params = ordered_params(model, info)
        self.state = model.state_dict(keep_vars=True)  # name -> the live parameter or buffer
        self.modules = dict(model.named_modules())
        self.norms = [m for m in self.modules.values() if isinstance(m, _NORM_TYPES)]
        # every module's train() is nn.Module's own: setting the flags is all model.train() does
        self.plain_modes = all(type(m).train is nn.Module.train for m in self.modules.values())
        self._optimizers: dict[tuple, SGD] = {}
        self._prices: dict[tuple, tuple[float, float, float]] = {}
        self.all_channels = [np.arange(int(c), dtype=np.int64) for c in info.tensor_channels]  # read only
        for kept in self.all_channels:
            kept.setflags(write=False)
        self._views: dict[str, tuple[np.ndarray, int]] = {}  # name -> (numpy view of a CPU tensor, its data_ptr)

    def copy_out(self, name: str) -> np.ndarray:
        """A numpy copy of the state's tensor ``name`` (``t.detach().cpu().numpy().copy()``).

        A CPU tensor's numpy view is kept (loading weights and the optimizer's steps write in place),
        so a client's copy is one numpy copy rather than four torch calls per tensor; the view is
        made again if the tensor's storage moved.
        """
        tensor = self.state[name]
        kept = self._views.get(name)
        if kept is None or tensor.data_ptr() != kept[1]:
            if tensor.device.type != "cpu":
                return tensor.detach().cpu().numpy().copy()
            kept = self._views[name] = (tensor.detach().numpy(), tensor.data_ptr())
        return kept[0].copy()

    def optimizer(self, optimizer: str, lr: float, momentum: float, weight_decay: float) -> SGD:
        """:func:`make_optimizer` over the model's parameters, as freshly made."""
        key = (optimizer, lr, momentum, weight_decay)
        opt = self._optimizers.get(key)
        if opt is None:
            opt = self._optimizers[key] = make_optimizer(self.params, optimizer, lr, momentum, weight_decay)
        else:
            opt.state.clear()
            for group in opt.param_groups:
                group["lr"] = lr
        return opt

    def prices(self, cost: CostModel, selection: Selection) -> tuple[float, float, float, float]:
        """(peak memory bytes, step time s, step MACs, step seconds at ``power.compute``) of
        ``selection`` on ``cost``.

        Pure functions of the cost model and the selection: a cohort's clients mostly select
        alike (fixed schemes select the same tensors for every client), so each distinct
        selection is priced once.
        """
        ratios, sparse = selection.ratios, selection.input_sparse
        key = (cost, ratios.dtype.str, ratios.tobytes(), None if sparse is None else np.asarray(sparse, bool).tobytes())
        got = self._prices.get(key)
        if got is None:
            if len(self._prices) >= 4096:
                self._prices.clear()
            step_s = cost.step_time_s(ratios)
            got = (cost.peak_memory_bytes(ratios, sparse), step_s, cost.step_macs(ratios), cost.compute_time_s(ratios, step_s))
            self._prices[key] = got
        return got

    def set_norm_modes(self, bn_mode: str) -> None:
        """:func:`_set_norm_modes`, without walking the module tree."""
        if not self.plain_modes:
            _set_norm_modes(self.model, bn_mode)
            return
        for mod in self.modules.values():
            if not mod.training:  # most are already: a cohort's clients leave them so
                mod.training = True
        if bn_mode != "train":
            for mod in self.norms:
                mod.training = False


def _input_channels_by_norm(weight: torch.Tensor, groups: int, ratio: float) -> tuple[int, torch.Tensor]:
    """(axis, bool mask): the kept input channels of a weight by norm, largest first (Sparse Update).

    A dense weight keeps ``ratio`` of its input channels (dim 1) with the largest L2 norms; a
    depthwise conv (one input channel per group) keeps its own channels (dim 0) the same way.
    """
    w = weight.detach()
    axis = 0 if groups > 1 and w.dim() > 1 and w.shape[1] == 1 else 1
    norms = w.transpose(0, axis).reshape(w.shape[axis], -1).norm(dim=1)
    keep = max(1, int(np.floor(ratio * w.shape[axis] + 1e-9)))
    mask = torch.zeros(w.shape[axis], dtype=torch.bool)
    mask[torch.argsort(-norms, stable=True)[:keep].cpu()] = True  # masks live on the CPU, whatever the weight's device
    return axis, mask


class _Masks:
    """A selection's channel masks on the weights ``params`` (per tensor: the axis and the kept
    channels): its listed output channels, and Sparse Update's input channels by weight norm."""

    def __init__(self, info: ModelInfo, params, selection: Selection):
        self.selection = selection
        self.masks: dict[int, tuple[int, torch.Tensor]] = {}  # tensor -> (axis, kept channels)
        for k, idx in selection.channels.items():
            mask = torch.zeros(params[k].shape[0], dtype=torch.bool)
            mask[torch.as_tensor(idx)] = True
            self.masks[k] = (0, mask)
        if selection.input_sparse is not None:
            for k in np.flatnonzero(np.asarray(selection.input_sparse, bool) & (selection.ratios > 0)):
                if params[k].dim() > 1:
                    groups = info.layers[info.tensor_layer[k]].groups
                    axis, mask = _input_channels_by_norm(params[k], groups, float(selection.ratios[k]))
                    if not mask.all():
                        self.masks[int(k)] = (axis, mask)

    def kept_share(self, k: int) -> float:
        """The share of tensor ``k`` that trains."""
        if k in self.masks:
            return float(self.masks[k][1].float().mean())
        return float(self.selection.ratios[k])


class _Applied(_Masks):
    """A selection applied to a model: requires_grad, norm modes and channel masks."""

    def __init__(
        self,
        model: nn.Module,
        info: ModelInfo,
        params: list[nn.Parameter],
        selection: Selection,
        bn_mode: str,
        modules: dict[str, nn.Module] | None = None,
    ):
        self.params = params
        for p, r in zip(params, selection.ratios):
            p.requires_grad_(bool(r > 0))
        modules = dict(model.named_modules()) if modules is None else modules
        for layer in info.layers:
            mod = modules[layer.name]
            if isinstance(mod, _NORM_TYPES):
                mod.train(bn_mode == "train" and any(selection.ratios[k] > 0 for k in layer.tensors))
        super().__init__(info, params, selection)

    def step(self, optimizer: SGD | torch.optim.Optimizer) -> None:
        """Optimizer step that leaves unselected channels exactly as they were."""
        saved = {}
        for k, (axis, mask) in self.masks.items():
            p = self.params[k]
            frozen = (slice(None),) * axis + (~mask,)
            if p.grad is not None:
                p.grad[frozen] = 0
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            saved[k] = (frozen, p.detach()[frozen].clone(), None if buf is None else buf[frozen].clone())
        optimizer.step()
        with torch.no_grad():
            for k, (frozen, values, buf) in saved.items():
                p = self.params[k]
                p[frozen] = values
                state_buf = optimizer.state.get(p, {}).get("momentum_buffer")
                if state_buf is not None:
                    state_buf[frozen] = 0 if buf is None else buf


def _mean(losses: list[float]) -> float:
    """``float(np.mean(losses))`` (nan if empty); one loss is its own mean, without numpy's call overhead."""
    if len(losses) == 1:
        return float(losses[0])
    return float(np.mean(losses)) if losses else float("nan")


def batches(n: int, batch_size: int, epochs: int, rng: np.random.Generator, max_steps: int = 0):
    """Shuffled index batches over ``epochs`` passes, capped at ``max_steps`` (0: no cap)."""
    step = 0
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            if max_steps and step >= max_steps:
                return
            yield order[start : start + batch_size]
            step += 1


def _add_to_union(
    selection: Selection,
    applied: _Masks,
    union: np.ndarray,
    whole: np.ndarray,
    channel_union: dict[int, tuple[int, np.ndarray]],
) -> None:
    """Adds a selection's trained tensors to a round's union, in place.

    ``union[k]``: the largest share of tensor ``k`` any selection trained; ``whole[k]``: some
    selection trained all of ``k``'s channels; ``channel_union[k]``: for a tensor only ever trained in
    part, (axis, the kept channels of all selections along it; along both axes: all of them).

    A tensor without a channel mask trains whole, its share being its ratio: its union with any
    channels is all its channels, so it is marked in ``whole`` without a per-tensor loop (a full
    selection has no masked tensor). tests/unit/fl/test_client_fast_paths.py checks this against the per-tensor
    union of channel index arrays.
    """
    ratios = selection.ratios
    unmasked = ratios > 0
    masked = [k for k in applied.masks if unmasked[k]]
    unmasked[masked] = False
    np.maximum(union, np.where(unmasked, ratios, 0.0), out=union)
    whole |= unmasked
    for k in masked:
        union[k] = max(union[k], applied.kept_share(k))
        if whole[k]:
            continue
        axis, mask = applied.masks[k]
        kept = np.flatnonzero(mask.numpy())
        if k not in channel_union:  # kept is sorted and unique: it is its own union with nothing
            channel_union[k] = (axis, kept)
            continue
        old_axis, old = channel_union[k]
        if old_axis != axis:  # trained along both axes in one round: send it whole
            whole[k] = True
            del channel_union[k]
            continue
        channel_union[k] = (axis, np.union1d(old, kept).astype(np.int64))


def channel_mask(shape: tuple[int, ...], axis: int, kept: np.ndarray) -> np.ndarray | None:
    """A tensor's 0/1 mask of the ``kept`` channels along ``axis`` (a :class:`LocalResult`'s
    ``channel_masks`` entry: 1-D for output channels, else broadcastable), or None if it keeps all."""
    size = shape[axis]
    if len(kept) >= size:
        return None
    mask = np.zeros(size, dtype=np.float32)
    mask[kept] = 1
    return mask if axis == 0 else mask.reshape([size if d == axis else 1 for d in range(len(shape))])


def _set_norm_modes(model: nn.Module, bn_mode: str) -> None:
    """Before any selection: BatchNorms in inference mode unless ``bn_mode == "train"``."""
    model.train()
    if bn_mode != "train":
        for mod in model.modules():
            if isinstance(mod, _NORM_TYPES):
                mod.eval()


def select_and_charge(strategy, ctx, cost, result, prepared: Prepared | None = None) -> tuple:
    """``strategy.select(ctx)``, its selector work charged to ``result`` and its peak memory recorded.

    Returns (selection, the selection's peak memory in bytes); ``prepared`` prices it (cached).
    """
    evaluations = cost.evaluations
    selection = strategy.select(ctx)
    selector_s = 0.0 if strategy.offline else cost.selector_time_s(cost.evaluations - evaluations, ctx.ops)
    result.selector_time_s += selector_s
    result.overhead_time_s += selector_s
    if prepared is None:
        peak = cost.peak_memory_bytes(selection.ratios, selection.input_sparse)
    else:
        peak = prepared.prices(cost, selection)[0]
    result.peak_memory_bytes = max(result.peak_memory_bytes, peak)
    return selection, peak


def flash_shortfall(cost, selection: Selection) -> str:
    """Why the selection's frozen weights do not fit the device's flash, or "" when they do (or
    the device has no ``memory.flash``)."""
    if cost.flash_fits(selection.ratios):
        return ""
    need = cost.memory(selection.ratios, selection.input_sparse).flash_bytes
    return (
        f"the frozen weights need {need:.0f} bytes of flash; "
        f"the device has {cost.device.memory_flash_bytes.value:.0f}"
    )


def carried_selection(strategy: SelectionStrategy, info: ModelInfo) -> tuple[Selection | None, int]:
    """(the selection an earlier local training left, the steps run since it was made), or (None, 0).

    Only a strategy that :meth:`~SelectionStrategy.carries_selection` keeps one; a selection of
    another model's tensors is dropped.
    """
    kept = strategy.carried if strategy.carries_selection() else None
    if kept is None or len(kept.ratios) != info.num_tensors:
        return None, 0
    return kept, int(strategy.since)


def carry_selection(strategy: SelectionStrategy, selection: Selection | None, since: int) -> None:
    """Keep the last ``selection`` and the steps ``since`` it in ``strategy`` for its next local training.

    None keeps nothing: a selection with nothing to train is made afresh (no probe runs for it)
    so that its reason, with the figures, is given again.
    """
    if strategy.carries_selection():
        strategy.carried, strategy.since = selection, since if selection is not None else 0


def no_step_reason(strategy: SelectionStrategy, note: str) -> str:
    """Why a client that fits ran no step: the strategy's ``note`` (nothing can train on this device)
    or, failing that, its :attr:`~SelectionStrategy.empty_note` (its scores picked nothing), figures
    included, when it gave one."""
    what = f"strategy {type(strategy).__name__} selected no tensor to train on this device"
    note = note or strategy.empty_note
    return f"{what}: {note}" if note else what


@dataclass(frozen=True)
class LocalTraining:
    """How a client trains in a round: ``epochs`` over its data (at most ``max_steps`` steps; 0: no
    cap) in batches of ``batch_size``, by ``optimizer`` at ``lr``.

    ``optimizer``: ``sgd`` (coupled L2 weight decay) or ``sgdw`` (decoupled, the artifact's);
    ``lr_schedule``: ``constant`` or ``cosine`` (from ``lr`` to 0 over the local training's steps,
    the decoupled decay following it). ``bn_mode``: ``frozen`` or ``train`` (module doc); it must
    be the cost model's.
    """

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    max_steps: int = 0
    bn_mode: str = "frozen"
    optimizer: str = "sgd"
    lr_schedule: str = "constant"
    proximal_mu: float = 0.0  # FedProx's proximal term mu/2 ||w - w_start||^2 added to the loss (0: none)

    @classmethod
    def of(cls, train, bn_mode: str, max_steps: int | None = None, proximal_mu: float = 0.0) -> LocalTraining:
        """A scenario's ``[train]`` table (:class:`~fedelastic.scenario.TrainConfig`) as local training,
        its step cap lowered to ``max_steps`` (a deadline's; see :func:`step_cap`)."""
        return cls(
            epochs=train.local_epochs, batch_size=train.batch_size, lr=train.lr, momentum=train.momentum,
            weight_decay=train.weight_decay, max_steps=step_cap(train.max_steps, max_steps), bn_mode=bn_mode,
            optimizer=train.optimizer, lr_schedule=train.lr_schedule, proximal_mu=proximal_mu,
        )  # fmt: skip


@with_numerics  # adds ``numerics=``: int8/fp16 training emulated (fedelastic/train/quant.py)
def train_local(
    model: nn.Module,
    info: ModelInfo,
    strategy: SelectionStrategy,
    cost: CostModel,
    data: ArrayDataset,
    local: LocalTraining,
    *,
    seed: int | list[int] = 0,
    prepared: Prepared | None = None,
) -> LocalResult:
    """Train ``model`` in place on ``data`` with ``strategy``'s selections, pricing each step on ``cost``.

    ``local``: the optimizer, schedule and step budget (:class:`LocalTraining`); ``seed``: the
    batches' and the strategy's randomness; ``prepared``: the model's :class:`Prepared`, shared by
    many calls on the same model.
    """
    epochs, batch_size, lr, max_steps = local.epochs, local.batch_size, local.lr, local.max_steps
    bn_mode, lr_schedule = local.bn_mode, local.lr_schedule
    if bn_mode != cost.bn_mode:
        raise ValueError(f"bn_mode {bn_mode!r} differs from the cost model's {cost.bn_mode!r}")
    if lr_schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule: expected one of {SCHEDULES}, got {lr_schedule!r}")
    start = time.perf_counter()
    rng = seed_everything(seed)
    if prepared is None or prepared.model is not model:
        prepared = Prepared(model, info)
    params = prepared.params
    opt = prepared.optimizer(local.optimizer, lr, local.momentum, local.weight_decay)
    mu = local.proximal_mu
    anchor = [p.detach().clone() for p in params] if mu > 0 else None  # FedProx: the global weights
    dev = params[0].device  # the model's device: a model moved to a GPU trains there
    on_device = dev.type != "cpu"
    # the weights a selection that does not fit rolls back to, taken before the first step that such a
    # selection could follow (see fail); None while no step ran
    before: dict[str, torch.Tensor] | None = None
    prepared.set_norm_modes(bn_mode)
    result = LocalResult(fits=True, num_examples=len(data))
    union = np.zeros(info.num_tensors)
    whole = np.zeros(info.num_tensors, dtype=bool)  # tensors trained whole (every channel) by some selection
    channel_union: dict[int, tuple[int, np.ndarray]] = {}  # other partial tensors -> (axis, kept channels)
    losses = []
    applied = None
    step_time = step_macs = step_compute = 0.0
    memory = cost.device.memory_train_bytes.value
    steps_per_epoch = -(-len(data) // batch_size)
    plan = list(batches(len(data), batch_size, epochs, rng, max_steps))

    def fail(reason: str) -> LocalResult:
        # with no step run the model holds its starting weights: a probe restores all it changes
        if before is not None:
            model.load_state_dict(before)
        result.fits, result.reason = False, reason
        result.train_time_s += result.overhead_time_s
        result.trained, result.channel_masks, result.ratios = {}, {}, None
        result.train_loss = _mean(losses)
        result.host_wall_s = time.perf_counter() - start
        return result

    kept, since = carried_selection(strategy, info)  # a selection made in an earlier round, and the steps since
    note = ""
    for step, idx in enumerate(plan):
        # the batch gathered by numpy (a few rows: cheaper than torch's index op), the same values
        x, y = torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])
        if on_device:
            x, y = x.to(dev), y.to(dev)
        if lr_schedule == "cosine":
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + np.cos(np.pi * step / len(plan)))
        due = strategy.should_reselect(since, steps_per_epoch)
        if applied is None and kept is not None and not due:  # no probe, no selector work: it was paid for
            selection, peak = kept, prepared.prices(cost, kept)[0]
            result.peak_memory_bytes = max(result.peak_memory_bytes, peak)
        elif applied is None or due:
            ctx = SelectionContext(info, cost, step, rng)
            if strategy.probe is not None:
                scope = strategy.probe_scope(ctx)
                if scope is not None and not np.any(scope):  # nothing can be selected: no probe runs
                    ctx.importance, ctx.fisher = np.zeros(info.num_tensors), {}
                else:
                    pieces = cost.probe_segments(strategy.probe, memory, scope)
                    if not pieces:
                        need = cost.probe_memory(strategy.probe, 1, np.arange(info.num_tensors) == info.num_tensors - 1)
                        result.probe_peak_memory_bytes = max(result.probe_peak_memory_bytes, need.total_bytes)
                        result.peak_memory_bytes = max(result.peak_memory_bytes, need.total_bytes)
                        return fail(
                            f"the {strategy.probe} probe needs {need.total_bytes:.0f} bytes for one sample of the "
                            f"last tensor; the device has {memory:.0f}"
                        )
                    ctx.importance, ctx.fisher = np.zeros(info.num_tensors), {}
                    for piece, micro in pieces:
                        probe_peak = cost.probe_memory(strategy.probe, micro, piece).total_bytes
                        result.probe_peak_memory_bytes = max(result.probe_peak_memory_bytes, probe_peak)
                        result.peak_memory_bytes = max(result.peak_memory_bytes, probe_peak)
                        if strategy.probe == "importance":
                            ctx.importance += importance_probe(model, info, opt, x, y, micro, piece)
                        else:
                            ctx.fisher.update(fisher_probe(model, info, x, y, micro, piece))
                        probe_s = cost.probe_time_s(strategy.probe, micro, piece)
                        result.overhead_time_s += probe_s
                        result.probe_time_s += probe_s
                    result.probes += 1
            selection, peak = select_and_charge(strategy, ctx, cost, result, prepared)
            note = ctx.note
            if peak > ctx.memory_budget_bytes:
                why = f" ({note})" if note else ""
                return fail(f"the selection needs {peak:.0f} bytes; the device has {memory:.0f}{why}")
            short = flash_shortfall(cost, selection)
            if short:
                return fail(short)
            result.selections += 1
            since = 0
        else:
            selection = None
        if selection is not None:
            kept = selection
            applied = _Applied(model, info, params, selection, bn_mode, prepared.modules)
            _add_to_union(selection, applied, union, whole, channel_union)
            _, step_time, step_macs, step_compute = prepared.prices(cost, selection)
            trains = bool(selection.mask.any())
        since += 1
        if not trains:
            continue  # nothing to train: no step runs
        if before is None and step + 1 < len(plan):  # a later step may reselect, and that selection not fit
            before = {k: v.detach().clone() for k, v in prepared.state.items()}
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for p, p0 in zip(params, anchor or ()):  # the proximal term's gradient mu (w - w_start)
            if p.grad is not None:
                p.grad.add_(p.detach() - p0, alpha=mu)
        applied.step(opt)
        losses.append(loss.item())
        result.train_time_s += step_time
        result.macs += step_macs
        result.compute_time_s += step_compute
        result.steps += 1
    result.train_time_s += result.overhead_time_s
    result.train_loss = _mean(losses)
    carry_selection(strategy, None if note else kept, since)
    if not result.steps and plan:  # it fits, yet no step ran: say why (the server counts it apart)
        result.reason = no_step_reason(strategy, note)
    result.ratios = union
    for p in params:
        p.requires_grad_(True)
    state, modules = prepared.state, prepared.modules
    for k in np.flatnonzero(union > 0).tolist():
        name = info.tensor_names[k]
        result.trained[name] = prepared.copy_out(name)
        mask = None if whole[k] else channel_mask(state[name].shape, *channel_union[k])
        if mask is not None:
            result.channel_masks[name] = mask
    if bn_mode == "train":  # norm running statistics travel with a trained norm layer
        for layer in info.layers:
            if isinstance(modules[layer.name], _NORM_TYPES) and any(union[k] > 0 for k in layer.tensors):
                for buf in ("running_mean", "running_var"):
                    result.trained[f"{layer.name}.{buf}"] = prepared.copy_out(f"{layer.name}.{buf}")
    result.host_wall_s = time.perf_counter() - start
    return result
