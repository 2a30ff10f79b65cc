"""Emulated time, memory, energy and communication of a training selection on a device.

Pure numpy: a :class:`CostModel` is built once per (model, device, batch size) and then prices a
selection in microseconds. A *selection* is a float array ``ratios`` over the model's tensors in
forward order: 0 = frozen, 1 = fully trained, in between = that fraction of its channels (output
channels, or input channels where ``input_sparse`` says so: Sparse Update). Probes (importance,
Fisher) and the selector's own work are priced too (:meth:`CostModel.probe_memory`,
:meth:`CostModel.probe_time_s`, :meth:`CostModel.selector_time_s`).

Conventions (documented in the README):

* Per tensor k: ``t_dw[k]`` computes its own gradient; ``t_dx[k]`` passes the error gradient
  from the output of its layer to its input. A layer's dx sits on its first tensor, and the
  backward of weightless ops (ReLU, pooling) between two layers is charged to the dx of the layer
  above them. ``t_opt[k]`` is the optimizer update of the tensor (memory-bound); the update's
  single fused launch per step is in ``t_bwd_fixed``.
* Backward time of a selection with deepest selected tensor ``k_min``::

      T_bp = sum_k r_k * t_dw[k] + sum_{k > k_min} t_dx[k]

  The deepest tensor's own dx is not charged: autograd computes no gradient below it. When
  ``k_min`` lies on a projection shortcut, the dx of the block's main branch (the layers
  :attr:`ModelInfo.parallel` names, between it and the residual add) is not charged either, at
  and below the branch's deepest selected tensor (all of it when none is selected): autograd
  reaches the shortcut through the add, not through them.
* Roofline per kernel, by kernel class (:data:`fedelastic.devices.profile.KERNEL_CLASSES`: dense GEMM/conv
  forward, dX and dW; depthwise conv and its two backprops; element-wise and norm ops;
  reductions; layout copies)::

      t = max(flops / P_c, bytes / B_c) / s + L_c,   s = outputs / (outputs + W_c)

  ``P_c = peak * efficiency_c``, ``B_c`` the class's fitted bandwidth, ``L_c = launch_overhead +
  overhead_c``: a class's kernels reach ``P_c`` only when large (``s`` saturates in the kernel's
  output elements; ``W_c = 0`` means always). A v1 profile has one class: ``efficiency``, the whole
  bandwidth, the launch overhead. Kernel-aware profiles (``[kernels]``) also price the functional
  ops ModelInfo records (residual adds and their backward gradient sums, attention matmuls and
  softmax) and a separate bias-add pass per biased conv/linear forward.
  A profile's measured per-layer table, when it has one for this model measured at this model's
  shape (:func:`measured_table`: per-sample input, classes, parameters and MACs, where the table
  records them), replaces the roofline of the layers it lists (scaled linearly in batch size). A measured ``fwd`` includes the forward of
  the weightless ops just below the layer, as ``fedelastic profile import-trace`` and
  ``fedelastic profile measure`` write it (its ``dx`` includes their backward, as above).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..devices.kernelsample import optimizer_seconds
from ..devices.profile import DeviceProfile
from ..modelinfo import ModelInfo
from .kernels import DW, DX, FWD, OPS, measured_table, predicted_table, step_kernels
from .kernels import kernel_parameters as kernel_parameters  # re-exported: part of this module's API
from .kernels import kernel_times as kernel_times
from .kernels import shape_mismatch as shape_mismatch

OPTIMIZER_STATE_PER_ELEMENT = {"sgd": 0, "momentum": 1, "adam": 2}
BN_MODES = ("frozen", "train")
PROBES = ("importance", "fisher")
PHASES = ("forward", "dX", "dW", "optimizer")  # rows of CostModel.roofline_phases_s
# elementary operations of one cost-model evaluation per tensor (a few vector passes over N tensors)
_OPS_PER_EVALUATION_PER_TENSOR = 8.0


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak training memory in bytes, by what holds it.

    Every field but ``flash_bytes`` is in the memory ``memory.train`` budgets (RAM; an MCU's SRAM),
    and :attr:`total_bytes` sums them. ``weights_bytes`` is the weights held there: all of them on
    a device without ``memory.flash``; on one with flash only the trained elements (their working
    copy, updated in place), while the frozen elements stay in flash (``flash_bytes``).
    """

    weights_bytes: float
    activations_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    workspace_bytes: float
    flash_bytes: float = 0.0  # frozen weights read in place from flash (0 on a device without flash)

    @property
    def total_bytes(self) -> float:
        """Bytes in RAM (SRAM on an MCU): what ``memory.train`` must hold."""
        return (
            self.weights_bytes
            + self.activations_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.workspace_bytes
        )


class CostModel:
    """Prices selections of ``info`` on ``device`` at ``batch_size``.

    Parameters
    ----------
    info : ModelInfo
        The model's layers and tensors.
    device : DeviceProfile
        The device; its measured table for ``info.model_name`` is used when present and measured
        on a model of ``info``'s shape (:func:`measured_table`).
    batch_size : int
        Samples per training step.
    optimizer : str
        ``sgd``, ``momentum`` or ``adam``: how much state each trained element keeps (weight decay,
        coupled or decoupled, is fused into the same update and streams nothing more).
    bn_mode : str
        ``frozen`` (BatchNorm always in inference mode, gamma and beta trainable: the seeds') or
        ``train`` (a BatchNorm with a trained tensor normalises with batch statistics, so its
        backward needs its saved input whichever of its tensors trains).
    """

    def __init__(
        self,
        info: ModelInfo,
        device: DeviceProfile,
        batch_size: int,
        optimizer: str = "momentum",
        bn_mode: str = "frozen",
    ):
        if bn_mode not in BN_MODES:
            raise ValueError(f"bn_mode: expected one of {BN_MODES}, got {bn_mode!r}")
        self.info, self.device, self.batch_size = info, device, batch_size
        self.optimizer, self.bn_mode = optimizer, bn_mode
        self.optimizer_state = OPTIMIZER_STATE_PER_ELEMENT[optimizer]
        self._evaluations: dict[int, int] = {}  # thread id -> memory and time evaluations it made (see evaluations)
        self._other_batch: dict[int, CostModel] = {}
        b, e = float(batch_size), float(device.bytes_per_element)
        bw = device.mem_bandwidth_bytes_per_s.value
        n, nl = info.num_tensors, len(info.layers)
        numel = info.tensor_numel.astype(float)
        # the optimizer update streams each trained element's weight, gradient and state; one fused
        # (foreach) launch per step covers all tensors, as torch's SGD and Adam do by default
        self.t_opt = numel * (3 + 2 * self.optimizer_state) * e / bw
        self._roofline_opt = self.t_opt  # the optimizer's roofline, kept when a sampled predictor replaces it
        kernels = step_kernels(info, device, batch_size)
        self.tensor_macs = kernels.tensor_macs  # dW MACs per step, for the dynamic energy term
        self.kernel_slot, self.kernel_index, self.kernel_class = kernels.slot, kernels.index, kernels.cls
        self.kernel_flops, self.kernel_bytes, self.kernel_outputs = kernels.flops, kernels.nbytes, kernels.outputs
        first_tensor = info.layer_first_tensor()
        self.kernel_params = kernel_parameters(device)
        times = kernel_times(
            self.kernel_params, self.kernel_class, self.kernel_flops, self.kernel_bytes, self.kernel_outputs
        )
        self.kernel_time = times
        self.t_fwd, self.t_dx, self.t_dw = (self._gather(slot, times, n) for slot in (FWD, DX, DW))
        # t_ops_fwd_layer[l]: forward of the weightless ops just below layer l (last: after the last layer)
        self.t_ops_fwd_layer = self._gather(OPS, times, nl + 1)
        layer_fwd = self.t_fwd[first_tensor] if nl else np.zeros(0)
        self.t_ops_fwd = float(self.t_ops_fwd_layer.sum())
        self.t_bwd_fixed = (
            device.launch_overhead_s.value
        )  # paid once by every step that trains anything (+ the loss, if measured)
        self.measured = measured_table(device, info)
        self.predicted = self.measured is None and bool(device.sampled)  # priced by the sampled kernels
        if self.predicted:
            self.measured = predicted_table(device, info, batch_size)
            self._apply_sampled_optimizer()
        if self.measured is not None:
            self._apply_measured(layer_fwd)
        self.forward_time_s = float(self.t_fwd.sum() + self.t_ops_fwd)
        # suffix sums: dx_above[j] = sum_{k > j} t_dx[k]
        self._dx_above = _suffix_above(self.t_dx)
        # per tensor, the tensor range [lo, hi) of a parallel branch (ModelInfo.parallel; lo == hi: none)
        branch = info.parallel_of_tensor()
        self.branch_lo = np.array([p[0] if p.size else 0 for p in branch], dtype=np.int64)
        self.branch_hi = np.array([p[-1] + 1 if p.size else 0 for p in branch], dtype=np.int64)
        layer_macs = b * np.array([layer.macs for layer in info.layers], float)
        self._fwd_macs = float(layer_macs.sum())
        self._layer_macs = layer_macs
        self._dx_macs_above = _suffix_above(layer_macs)
        self._prepare_memory()

    def _gather(self, slot: int, times: np.ndarray, size: int) -> np.ndarray:
        out = np.zeros(size)
        on = self.kernel_slot == slot
        np.add.at(out, self.kernel_index[on], times[on])
        return out

    def _apply_sampled_optimizer(self) -> None:
        """The optimizer update from the profile's sampled predictor (SGD with momentum; other
        optimizers scaled by the streams they read and write)."""
        sampled = optimizer_seconds(self.device.sampled, self.info.tensor_numel)
        if sampled is not None:
            per_tensor, once = sampled
            self.t_opt = per_tensor * (3 + 2 * self.optimizer_state) / 5.0
            self.t_bwd_fixed += once

    def _apply_measured(self, layer_fwd: np.ndarray) -> None:
        table, info = self.measured, self.info
        assert table is not None
        scale = self.batch_size / table.batch_size
        covered = 0
        for li, layer in enumerate(info.layers):
            row = table.layers.get(layer.name)
            if row is None:
                continue
            covered += 1
            # a measured fwd already holds the weightless ops below the layer (import-trace and
            # profile measure charge them there): do not count their roofline forward again
            self.t_ops_fwd -= self.t_ops_fwd_layer[li]
            self.t_ops_fwd_layer[li] = 0.0
            first = layer.tensors[0]
            self.t_fwd[first], self.t_dx[first] = row.fwd_s * scale, row.dx_s * scale
            roof = self.t_dw[list(layer.tensors)]
            share = roof / roof.sum() if roof.sum() > 0 else np.full(len(roof), 1 / len(roof))
            self.t_dw[list(layer.tensors)] = row.dw_s * scale * share
        if covered == len(info.layers):  # the table already holds the weightless ops
            self.t_ops_fwd = table.unattributed_fwd_s * scale
            self.t_ops_fwd_layer[:] = 0.0
            self.t_ops_fwd_layer[-1] = self.t_ops_fwd
            # backward no layer owns (the loss gradient): paid once by every step that trains anything
            self.t_bwd_fixed += table.unattributed_bwd_s * scale

    # ---- uncertainty ------------------------------------------------------------------------
    def roofline_share(self) -> float:
        """Share of the full step's time priced by the roofline (not by a measured table); worked out once."""
        share = self.__dict__.get("_roofline_share")
        if share is None:
            share = self._roofline_share = self._compute_roofline_share()
        return share

    def _compute_roofline_share(self) -> float:
        full = self.full_step_time_s()
        if self.measured is None or self.predicted or full <= 0:
            return 1.0
        covered = 0.0
        for li, layer in enumerate(self.info.layers):
            if layer.name in self.measured.layers:
                ks = list(layer.tensors)
                covered += self.t_fwd[ks[0]] + self.t_ops_fwd_layer[li] + self.t_dx[ks[0]] + self.t_dw[ks].sum()
        return float(min(max(1.0 - covered / full, 0.0), 1.0))

    def time_band_s(self, seconds: float) -> float:
        """One-sigma error band (seconds) of an emulated time of ``seconds``.

        The profile's ``[uncertainty] step`` (a relative error, from the kernel fit's leave-one-model-out
        residuals) times the share of the step the roofline prices; 0 when the profile gives none.
        """
        rel = self.device.uncertainty.value if self.device.uncertainty is not None else 0.0
        return float(seconds * rel * self.roofline_share())

    # ---- time -------------------------------------------------------------------------------
    def backward_time_s(self, ratios: np.ndarray) -> float:
        """Backward time (gradients and optimizer update) of one step."""
        self._evaluated()
        ratios = np.asarray(ratios, float)
        selected = np.flatnonzero(ratios > 0)
        if selected.size == 0:
            return 0.0
        launch = self.device.launch_overhead_s.value
        terms = self._backward_terms(ratios, selected, self.t_dw, self.t_dx, self._dx_above, self.t_opt, launch)
        dw, opt, dx, skip = terms
        return float(dw + opt + dx - skip + self.t_bwd_fixed)

    def _backward_terms(
        self,
        ratios: np.ndarray,
        selected: np.ndarray,
        dw: np.ndarray,
        dx: np.ndarray,
        dx_above: np.ndarray,
        opt: np.ndarray,
        launch: float,
    ) -> tuple[float, float, float, float]:
        """(dW, optimizer, dX above the deepest selected tensor, dX autograd skips) of a selection
        with at least one tensor, from per-tensor seconds ``dw``, ``dx`` (``dx_above``: its suffix
        sums), ``opt`` and the dW launch ``launch`` (the module docstring's backward rule)."""
        on = ratios > 0
        dw_s = np.where(on, launch + ratios * (dw - launch), 0.0).sum()
        return dw_s, (ratios * opt).sum(), dx_above[selected[0]], self._branch_skip(selected, dx)

    def _branch_skip(self, selected: np.ndarray, values: np.ndarray, per_layer: bool = False) -> float:
        """dX (``values``: per tensor, or per layer MACs with ``per_layer``) that ``_dx_above`` charges
        but autograd skips: with the deepest selected tensor on a projection shortcut, the parallel
        main branch's dX at and below its deepest selected tensor (all of the branch when none is selected)."""
        k = int(selected[0])
        lo, hi = int(self.branch_lo[k]), int(self.branch_hi[k])
        if hi <= lo:
            return 0.0
        inside = selected[(selected >= lo) & (selected < hi)]
        top = int(inside[0]) + 1 if inside.size else hi
        if per_layer:
            layers = self.info.tensor_layer
            return float(values[layers[lo] : layers[top - 1] + 1].sum())
        return float(values[lo:top].sum())

    def step_time_s(self, ratios: np.ndarray) -> float:
        """Forward plus backward time of one training step."""
        return self.forward_time_s + self.backward_time_s(ratios)

    def full_step_time_s(self) -> float:
        return self.step_time_s(np.ones(self.info.num_tensors))

    def backward_budget_s(self, rho: float) -> float:
        """Backward-time budget for a target step time of ``rho`` x full training."""
        return rho * self.full_step_time_s() - self.forward_time_s

    def at_batch(self, batch_size: int) -> CostModel:
        """The same model, device and options priced at another batch size (cached)."""
        if batch_size == self.batch_size:
            return self
        if batch_size not in self._other_batch:
            self._other_batch[batch_size] = CostModel(self.info, self.device, batch_size, self.optimizer, self.bn_mode)
        return self._other_batch[batch_size]

    def _scope(self, scope: np.ndarray | None) -> np.ndarray:
        n = self.info.num_tensors
        return np.ones(n) if scope is None else np.asarray(scope, bool).astype(float)

    def _probe_pass_time_s(self, probe: str, scope: np.ndarray | None) -> float:
        """One probe pass over a (micro-)batch of this model's batch size, optimizer step excluded."""
        s = self._scope(scope)
        if not s.any():
            return 0.0
        if probe == "importance":  # forward + backward of every tensor in scope (dW and dX), twice
            grads = self.backward_time_s(s) - float(s @ self.t_opt)
            return 2 * (self.forward_time_s + grads)
        # fisher: forward + the error gradient down to the deepest scope layer's output; no dW
        deepest = int(np.flatnonzero(s)[0])
        return self.forward_time_s + float(self._dx_above[deepest]) + self.t_bwd_fixed

    def probe_time_s(self, probe: str, micro_batch: int = 0, scope: np.ndarray | None = None) -> float:
        """Time of the ``importance`` or ``fisher`` probe over one batch, in micro-batches.

        The batch is split into ``ceil(batch / micro_batch)`` micro-batches (0: one pass over the
        whole batch), each priced at its own size (launch overheads and all). ``scope`` (bool
        per tensor, default all) limits the probe to those tensors: backprop stops below the
        deepest of them. The importance probe also pays one optimizer step over the scope
        (between its two backward passes).
        """
        if probe not in PROBES:
            raise ValueError(f"probe: expected one of {PROBES}, got {probe!r}")
        m = micro_batch or self.batch_size
        full, rest = divmod(self.batch_size, m)
        t = full * self.at_batch(m)._probe_pass_time_s(probe, scope)
        if rest:
            t += self.at_batch(rest)._probe_pass_time_s(probe, scope)
        if probe == "importance":
            t += float(self._scope(scope) @ self.t_opt)
        return t

    # ---- memory -----------------------------------------------------------------------------
    def memory(
        self, ratios: np.ndarray, input_sparse: np.ndarray | None = None, batch_size: int | None = None
    ) -> MemoryBreakdown:
        """Peak training memory (the README's "Cost model" section; the rules follow).

        Where the weights live: on a device without ``memory.flash`` all of them are in RAM; on
        one with flash (an MCU) the frozen elements stay in flash (``flash_bytes``, read in place)
        and only the trained elements are in SRAM, one copy updated in place (a tensor trained on
        a share of its channels: that share). A weight gradient saves its layer's input: all of it for a dense
        layer trained on some output channels, and the trained share for a grouped (depthwise)
        conv or for a weight trained on a share of its **input** channels (``input_sparse[k]``,
        Sparse Update), whose gradient reads only the kept channels. A norm scale saves its
        normalised input; biases save nothing. Under ``bn_mode = "train"`` a BatchNorm with any
        trained tensor saves its input (its batch-statistics backward needs it), and a per-sample
        norm (LayerNorm, GroupNorm) saves its input whenever the error gradient passes it (at or
        above the deepest trained layer). Weightless ops above the deepest trained tensor save a
        one-bit mask (ReLU-like) or their input. Trained elements add a gradient and the
        optimizer's state. The workspace is the largest forward in+out pair (inference) or
        backward gradient buffer. ``batch_size`` prices another batch size (activations and
        workspace scale linearly with it).
        """
        self._evaluated()
        ratios = np.asarray(ratios, float)
        e = float(self.device.bytes_per_element)
        scale = 1.0 if batch_size is None else batch_size / self.batch_size
        selected = np.flatnonzero(ratios > 0)
        trained = float(ratios @ self.info.tensor_numel)
        acts = 0.0
        if selected.size:
            scales = self._act_scales_with_ratio
            if input_sparse is not None:
                scales = scales | np.asarray(input_sparse, bool)
            share = np.where(scales, ratios, ratios > 0)
            deepest = self.info.tensor_layer[selected[0]]
            acts = float(share @ self._act_bytes) + self._op_bytes_above[deepest] + self._sample_norm_from[deepest]
            if self._norm_train_bytes.any():
                on = np.bincount(self.info.tensor_layer[selected], minlength=len(self.info.layers)) > 0
                acts += float(on @ self._norm_train_bytes)
        ram_weights, flash = self._weights_split(trained * e)
        return MemoryBreakdown(
            ram_weights, acts * scale, trained * e, trained * e * self.optimizer_state, self._workspace * scale, flash
        )

    def _weights_split(self, trained_bytes: float) -> tuple[float, float]:
        """(weight bytes in RAM, frozen weight bytes in flash) when ``trained_bytes`` of them train."""
        if self.device.memory_flash_bytes is None:
            return self._weight_bytes, 0.0
        return trained_bytes, max(self._weight_bytes - trained_bytes, 0.0)

    def _prepare_memory(self) -> None:
        """Per-tensor saved-activation bytes and per-layer op bytes, so memory() is vectorised."""
        info, e, b = self.info, float(self.device.bytes_per_element), float(self.batch_size)
        self._weight_bytes = float(info.tensor_numel.sum()) * e
        self._act_bytes = np.zeros(info.num_tensors)
        self._act_scales_with_ratio = np.ones(info.num_tensors, bool)
        # a train-mode BatchNorm with any trained tensor saves its input once (per layer)
        self._norm_train_bytes = np.zeros(len(info.layers))
        # per-sample norms save their input whenever the error gradient passes them
        sample_norm = np.zeros(len(info.layers) + 1)
        for li, layer in enumerate(info.layers):
            if layer.kind != "norm":
                continue
            if not layer.batch_stats:
                sample_norm[li] = layer.in_numel * b * e
            elif self.bn_mode == "train":
                self._norm_train_bytes[li] = layer.in_numel * b * e
        for k, (role, li) in enumerate(zip(info.tensor_roles, info.tensor_layer)):
            layer = info.layers[li]
            if role == "weight":  # dense: any output channel's gradient needs the whole input
                self._act_bytes[k] = layer.in_numel * b * e
                self._act_scales_with_ratio[k] = layer.groups > 1
            elif role == "other" or (role == "norm_weight" and layer.batch_stats and self.bn_mode == "frozen"):
                self._act_bytes[k] = layer.out_numel * b * e
        self._sample_norm_from = np.cumsum(sample_norm[::-1])[::-1]  # [l]: sum over norm layers >= l
        # _op_bytes_above[l]: what weightless ops above layer l save when l is the deepest trained layer
        per_layer = np.zeros(len(info.layers) + 1)
        for op in info.ops:
            per_layer[op.above] += op.out_numel * b / 8 if op.kind == "mask" else op.in_numel * b * e
        self._op_bytes_above = _suffix_above(per_layer)
        self._workspace = max((b * (layer.in_numel + layer.out_numel) * e for layer in info.layers), default=0.0)

    def peak_memory_bytes(
        self, ratios: np.ndarray, input_sparse: np.ndarray | None = None, batch_size: int | None = None
    ) -> float:
        return self.memory(ratios, input_sparse, batch_size).total_bytes

    def flash_fits(self, ratios: np.ndarray) -> bool:
        """Whether the frozen weights of ``ratios`` fit the device's flash (always, without flash)."""
        flash = self.device.memory_flash_bytes
        if flash is None:
            return True
        trained = float(np.asarray(ratios, float) @ self.info.tensor_numel) * self.device.bytes_per_element
        return self._weights_split(trained)[1] <= flash.value

    def fits(self, ratios: np.ndarray, input_sparse: np.ndarray | None = None) -> bool:
        """RAM-resident bytes within ``memory.train`` and frozen weights within ``memory.flash``."""
        m = self.memory(ratios, input_sparse)
        flash = self.device.memory_flash_bytes
        return m.total_bytes <= self.device.memory_train_bytes.value and (
            flash is None or m.flash_bytes <= flash.value
        )

    # ---- probes -----------------------------------------------------------------------------
    def probe_memory(
        self, probe: str, batch_size: int | None = None, scope: np.ndarray | None = None
    ) -> MemoryBreakdown:
        """Peak memory of the ``importance`` or ``fisher`` probe over a (micro-)batch.

        Importance: training every tensor in ``scope`` (default: all), as :meth:`memory` prices
        it, plus the copies the probe restores after its step: those weights and their optimizer
        state. Fisher: the weights, the output activation of every conv/linear layer from the
        deepest to the highest scope tensor (kept until its gradient arrives: ``a * g``), what the
        weightless ops and per-sample norms (and train-mode BatchNorms) there need for the error
        gradient, a float32 accumulator per output channel, and the workspace; no weight
        gradient is formed. On a device with flash the weights the probe does not train stay
        there (``flash_bytes``); the importance probe's restore copies are held in RAM.
        """
        if probe not in PROBES:
            raise ValueError(f"probe: expected one of {PROBES}, got {probe!r}")
        info, e = self.info, float(self.device.bytes_per_element)
        b = float(self.batch_size if batch_size is None else batch_size)
        scale = b / self.batch_size
        s = self._scope(scope)
        frozen_ram, frozen_flash = self._weights_split(0.0)
        if not s.any():
            return MemoryBreakdown(frozen_ram, 0.0, 0.0, 0.0, 0.0, frozen_flash)
        if probe == "importance":
            m = self.memory(s, batch_size=batch_size)
            copies = float(s @ info.tensor_numel) * e + m.optimizer_bytes  # restored after the probe
            return MemoryBreakdown(
                m.weights_bytes + copies - m.optimizer_bytes,
                m.activations_bytes,
                m.gradients_bytes,
                2 * m.optimizer_bytes,
                m.workspace_bytes,
                m.flash_bytes,
            )
        picked = np.flatnonzero(s)
        deepest, highest = int(info.tensor_layer[picked[0]]), int(info.tensor_layer[picked[-1]])
        scored = [layer for layer in info.layers[deepest : highest + 1] if layer.kind in ("conv", "linear")]
        outputs = sum(layer.out_numel for layer in scored) * b * e
        passed = (
            self._op_bytes_above[deepest] + self._sample_norm_from[deepest] + self._norm_train_bytes[deepest:].sum()
        )
        accumulators = 4.0 * sum(layer.out_channels for layer in scored)
        return MemoryBreakdown(
            frozen_ram, outputs + passed * scale, accumulators, 0.0, self._workspace * scale, frozen_flash
        )

    def probe_plan(self, probe: str, budget_bytes: float, scope: np.ndarray | None = None) -> tuple[int, float]:
        """``(micro_batch, peak_bytes)``: the largest micro-batch whose probe fits ``budget_bytes``.

        Probe memory is affine in the micro-batch, so the largest fitting size is solved for
        directly. ``micro_batch`` is 0 when not even one sample fits; ``peak_bytes`` is then the
        one-sample peak (the least the probe needs).
        """
        fixed = self.probe_memory(probe, 0, scope).total_bytes
        full = self.probe_memory(probe, None, scope).total_bytes
        if full <= budget_bytes:
            return self.batch_size, full
        per_sample = (full - fixed) / self.batch_size
        m = int(np.floor((budget_bytes - fixed) / per_sample)) if per_sample > 0 else 0
        m = min(max(m, 0), self.batch_size)
        while m > 0 and self.probe_memory(probe, m, scope).total_bytes > budget_bytes:
            m -= 1  # float rounding at the boundary
        if m == 0:
            return 0, self.probe_memory(probe, 1, scope).total_bytes
        return m, self.probe_memory(probe, m, scope).total_bytes

    def probe_segments(
        self, probe: str, budget_bytes: float, scope: np.ndarray | None = None
    ) -> list[tuple[np.ndarray, int]]:
        """Split the probe over ``scope`` into pieces that fit: ``[(tensor mask, micro_batch), ...]``.

        One piece when the whole scope fits at some micro-batch (the largest that fits). Else,
        from the output down, each piece is the longest run of scope tensors whose probe fits
        one sample, run on the largest micro-batch that fits it (each piece pays its own forward
        and backward). Tensors whose piece would not fit even one sample alone, and every scope
        tensor below them, are left out: they cannot be probed, so they are never selected. An
        empty list means not even the tensor nearest the output can be probed.
        """
        s = self._scope(scope).astype(bool)
        picked = np.flatnonzero(s)
        if picked.size == 0:
            return []
        micro, _ = self.probe_plan(probe, budget_bytes, s)
        if micro:
            return [(s, micro)]

        def piece(lo: int, hi: int) -> np.ndarray:
            mask = np.zeros(self.info.num_tensors, bool)
            mask[picked[lo : hi + 1]] = True
            return mask

        def fits_one(lo: int, hi: int) -> bool:
            return self.probe_memory(probe, 1, piece(lo, hi)).total_bytes <= budget_bytes

        pieces, hi = [], len(picked) - 1
        while hi >= 0 and fits_one(hi, hi):
            lo_ok, lo_bad = hi, -1  # memory grows as the piece reaches deeper: bisect its lowest end
            while lo_ok - lo_bad > 1:
                mid = (lo_ok + lo_bad) // 2
                if fits_one(mid, hi):
                    lo_ok = mid
                else:
                    lo_bad = mid
            mask = piece(lo_ok, hi)
            pieces.append((mask, self.probe_plan(probe, budget_bytes, mask)[0]))
            hi = lo_ok - 1
        return pieces

    # ---- selection work ---------------------------------------------------------------------
    @property
    def evaluations(self) -> int:
        """Memory and time evaluations the calling thread has made so far: a selector's work is
        priced from the ones its ``select`` made (:func:`~fedelastic.train.trainer.select_and_charge`).

        Counted per thread, so that pricing on another thread meanwhile (a reply's time band, an
        abandoned in-process client still training) does not change what a selection is charged.
        """
        return self._evaluations.get(threading.get_ident(), 0)

    def _evaluated(self) -> None:
        ident = threading.get_ident()
        self._evaluations[ident] = self._evaluations.get(ident, 0) + 1

    def selector_time_s(self, evaluations: int, ops: float) -> float:
        """Device time of a selection: its cost-model ``evaluations`` and other elementary ``ops``.

        Each evaluation is a few vector passes over the model's tensors
        (``8 * num_tensors`` operations). The counted operations are priced at the device's scalar
        rate (``compute.scalar_ops_per_s``: what the selector's DP or greedy runs at, measured by
        ``fedelastic profile measure``); a profile without one is priced at its tensor rate
        (``peak_flops * efficiency``), which charges this host's selector 270-20,000x too little
        (benchmarks/studies/bands.md).
        """
        total = evaluations * _OPS_PER_EVALUATION_PER_TENSOR * self.info.num_tensors + ops
        scalar = self.device.scalar_ops_per_s
        rate = scalar.value if scalar is not None else self.device.peak_flops.value * self.device.efficiency.value
        return float(total / rate)

    # ---- communication and energy -----------------------------------------------------------
    def bytes_up(self, ratios: np.ndarray) -> float:
        """Bytes of the trained elements sent to the server."""
        return float((np.asarray(ratios, float) * self.info.tensor_numel).sum() * self.device.bytes_per_element)

    def bytes_down(self) -> float:
        """Bytes of the whole model received from the server."""
        return float(self.info.num_params * self.device.bytes_per_element)

    def step_macs(self, ratios: np.ndarray) -> float:
        """MACs of one step: forward, dX above the deepest trained tensor, and trained dW."""
        self._evaluated()
        ratios = np.asarray(ratios, float)
        selected = np.flatnonzero(ratios > 0)
        if selected.size == 0:
            return self._fwd_macs
        skip = self._branch_skip(selected, self._layer_macs, per_layer=True)
        dx = self._dx_macs_above[self.info.tensor_layer[selected[0]]] - skip
        return self._fwd_macs + dx + float(ratios @ self.tensor_macs)

    def roofline_phases_s(self, ratios: np.ndarray | None = None) -> np.ndarray:
        """Roofline seconds of one step of ``ratios`` (default: every tensor) by phase and kind.

        Rows :data:`PHASES` (forward, dX, dW, optimizer); columns: in compute-bound kernels
        (``flops / P_c >= bytes / B_c``, their launch and class overheads excluded), and the rest
        (memory-bound kernels, every launch and class overhead, the optimizer update, which streams
        memory). Over exactly the kernels :meth:`step_time_s` charges a selection: the forward of
        everything, dX above the deepest selected tensor less the branch autograd skips, dW of the
        selected tensors weighted by their ratio, and their optimizer update. Always the roofline's
        kernels, also where a measured table prices the step: it classifies them, it does not time them.
        """
        n = self.info.num_tensors
        ratios = np.ones(n) if ratios is None else np.asarray(ratios, float)
        selected = np.flatnonzero(ratios > 0)
        launch = self.device.launch_overhead_s.value
        out = np.zeros((len(PHASES), 2))
        for col, (fwd, dw, dx, dx_above) in enumerate(self._phase_parts()):
            out[0, col] = fwd
            if selected.size:
                opt, fixed, dw_launch = (self._roofline_opt, launch, launch) if col else (np.zeros(n), 0.0, 0.0)
                dw_s, opt_s, dx_s, skip = self._backward_terms(ratios, selected, dw, dx, dx_above, opt, dw_launch)
                out[1:, col] = dx_s - skip, dw_s, opt_s + fixed
        out[:, 1] -= out[:, 0]  # the whole's column, less the compute-bound part: the rest
        return out

    def _phase_parts(self) -> tuple[tuple[float, np.ndarray, np.ndarray, np.ndarray], ...]:
        """(forward seconds, dW and dX per tensor, dX suffix sums) of the compute-bound kernels' busy
        time and of the whole roofline step; worked out once."""
        parts = self.__dict__.get("_phases")
        if parts is None:
            p, n = self.kernel_params[self.kernel_class], self.info.num_tensors
            busy = np.where(self.kernel_flops / p[:, 0] >= self.kernel_bytes / p[:, 1], self.kernel_time - p[:, 2], 0.0)
            forward = (self.kernel_slot == FWD) | (self.kernel_slot == OPS)
            parts = self._phases = tuple(
                (float(t[forward].sum()), self._gather(DW, t, n), dx, _suffix_above(dx))
                for t in (busy, self.kernel_time)
                for dx in [self._gather(DX, t, n)]
            )
        return parts

    def compute_share(self, ratios: np.ndarray | None = None) -> float:
        """Share of a step of ``ratios`` (default: every tensor) in compute-bound kernels
        (:meth:`roofline_phases_s`); the full step's is worked out once."""
        share = self.__dict__.get("_full_share") if ratios is None else None
        if share is None:
            phases = self.roofline_phases_s(ratios)
            total = float(phases.sum())
            share = float(phases[:, 0].sum()) / total if total > 0 else 0.0
            if ratios is None:
                self._full_share = share
        return share

    def has_phase_powers(self) -> bool:
        """Whether the profile gives ``power.compute`` and ``power.memory`` (energy by phase)."""
        return self.device.power_compute_w is not None and self.device.power_memory_w is not None

    def compute_time_s(self, ratios: np.ndarray | None, seconds: float) -> float:
        """Of ``seconds`` spent training ``ratios`` (None: the full step's mix), those at ``power.compute``:
        ``seconds`` x :meth:`compute_share`. 0 on a profile without phase powers (it trains at
        ``power.train`` throughout)."""
        return seconds * self.compute_share(ratios) if self.has_phase_powers() and seconds else 0.0

    def train_power_w(self, ratios: np.ndarray | None = None) -> float:
        """Whole-device draw while training ``ratios`` (default: every tensor): ``power.train``; with
        ``power.compute`` and ``power.memory`` (energy by phase), their mix weighted by the selection's
        roofline time in compute-bound kernels and in the rest (:meth:`compute_share`)."""
        d = self.device
        if d.power_compute_w is None or d.power_memory_w is None:
            return d.power_train_w.value
        share = self.compute_share(ratios)
        return share * d.power_compute_w.value + (1 - share) * d.power_memory_w.value

    def energy_j(
        self, train_time_s: float, up_s: float, down_s: float, macs: float = 0.0, moved_bytes: float = 0.0,
        compute_s: float | None = None,
    ) -> float:  # fmt: skip
        """Energy on this device (:func:`device_energy_j`). With phase powers, ``compute_s`` of the
        ``train_time_s`` run at ``power.compute`` and the rest at ``power.memory`` (what a client
        reports: :meth:`compute_time_s` summed over its steps; None: the full step's mix)."""
        power, d = self.train_power_w(), self.device
        if compute_s is not None and d.power_compute_w is not None and d.power_memory_w is not None and train_time_s:
            rest_s = train_time_s - compute_s
            power = (compute_s * d.power_compute_w.value + rest_s * d.power_memory_w.value) / train_time_s
        return device_energy_j(self.device, train_time_s, up_s, down_s, macs, moved_bytes, power)


def _suffix_above(x: np.ndarray) -> np.ndarray:
    """``out[j] = sum_{k > j} x[k]``."""
    return np.concatenate([np.cumsum(x[::-1])[::-1][1:], [0.0]])


def device_energy_j(
    d: DeviceProfile,
    train_time_s: float,
    up_s: float,
    down_s: float,
    macs: float = 0.0,
    moved_bytes: float = 0.0,
    train_power_w: float | None = None,
) -> float:
    """Energy: power x time per state (training, sending, receiving), plus the optional per-MAC and
    per-byte terms. ``train_power_w``: the training draw (default ``power.train``; energy by phase:
    :meth:`CostModel.train_power_w`)."""
    train_w = d.power_train_w.value if train_power_w is None else train_power_w
    energy = train_w * train_time_s + d.power_transmit_w.value * up_s + d.power_receive_w.value * down_s
    if d.energy_per_mac_j is not None:
        energy += d.energy_per_mac_j.value * macs
    if d.energy_per_byte_j is not None:
        energy += d.energy_per_byte_j.value * moved_bytes
    return float(energy)


def link_times_s(
    bytes_down: float, bytes_up: float, down_bps: float, up_bps: float, latency_s: float
) -> tuple[float, float]:
    """(download, upload) seconds: one latency each plus the bits over the link. The one link formula
    (the engine's :meth:`fedelastic.sim.fleet.Fleet.comm_s`, :func:`fedelastic.fl.your_app.price_transfer`)."""
    return latency_s + 8 * bytes_down / down_bps, latency_s + 8 * bytes_up / up_bps
