"""Emulated time, memory, energy and communication of a training selection on a device.

Pure numpy: a :class:`CostModel` is built once per (model, device, batch size) and then prices a
selection in microseconds. A *selection* is a float array ``ratios`` over the model's tensors in
forward order: 0 = frozen, 1 = fully trained, in between = that fraction of output channels.

Conventions (documented in the README):

* Per tensor k: ``t_dw[k]`` computes its own gradient; ``t_dx[k]`` passes the error gradient
  from the output of its layer to its input. A layer's dx sits on its first tensor, and the
  backward of weightless ops (ReLU, pooling) between two layers is charged to the dx of the layer
  above them. ``t_opt[k]`` is the optimizer update of the tensor (memory-bound); the update's
  single fused launch per step is in ``t_bwd_fixed``.
* Backward time of a selection with deepest selected tensor ``k_min``::

      T_bp = sum_k r_k * t_dw[k] + sum_{k > k_min} t_dx[k]

  The deepest tensor's own dx is not charged: autograd computes no gradient below it.
* Roofline per kernel: ``max(flops / (peak * efficiency), bytes / bandwidth) + launch_overhead``.
  A profile's measured per-layer table, when it has one for this model, replaces the roofline of
  the layers it lists (scaled linearly in batch size). A measured ``fwd`` includes the forward of
  the weightless ops just below the layer, as ``fedelastic profile import-trace`` and
  ``fedelastic profile measure`` write it (its ``dx`` includes their backward, as above).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .devices import DeviceProfile
from .modelinfo import ModelInfo

OPTIMIZER_STATE_PER_ELEMENT = {"sgd": 0, "momentum": 1, "adam": 2}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak training memory in bytes, by what holds it."""

    weights_bytes: float
    activations_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    workspace_bytes: float

    @property
    def total_bytes(self) -> float:
        return (
            self.weights_bytes
            + self.activations_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.workspace_bytes
        )


@dataclass(frozen=True)
class Emulated:
    """Emulated figures of some training work on a device."""

    train_time_s: float
    comm_time_s: float
    energy_j: float
    peak_memory_bytes: float
    bytes_up: float
    bytes_down: float
    macs: float


class CostModel:
    """Prices selections of ``info`` on ``device`` at ``batch_size``.

    Parameters
    ----------
    info : ModelInfo
        The model's layers and tensors.
    device : DeviceProfile
        The device; its measured table for ``info.model_name`` is used when present.
    batch_size : int
        Samples per training step.
    optimizer : str
        ``sgd``, ``momentum`` or ``adam``: how much state each trained element keeps.
    """

    def __init__(self, info: ModelInfo, device: DeviceProfile, batch_size: int, optimizer: str = "momentum"):
        self.info, self.device, self.batch_size = info, device, batch_size
        self.optimizer_state = OPTIMIZER_STATE_PER_ELEMENT[optimizer]
        b, e = float(batch_size), float(device.bytes_per_element)
        peak = device.peak_flops.value * device.efficiency.value
        bw = device.mem_bandwidth_bytes_per_s.value
        launch = device.launch_overhead_s.value

        def kernel(flops, nbytes):
            return np.maximum(np.asarray(flops, float) / peak, np.asarray(nbytes, float) * e / bw) + launch

        n = info.num_tensors
        numel = info.tensor_numel.astype(float)
        self.t_fwd, self.t_dx, self.t_dw = np.zeros(n), np.zeros(n), np.zeros(n)
        # the optimizer update streams each trained element's weight, gradient and state; one fused
        # (foreach) launch per step covers all tensors, as torch's SGD and Adam do by default
        self.t_opt = numel * (3 + 2 * self.optimizer_state) * e / bw
        self.tensor_macs = np.zeros(n)  # dW MACs per step, for the dynamic energy term
        layer_fwd = np.zeros(len(info.layers))
        for li, layer in enumerate(info.layers):
            ins, outs, macs = b * layer.in_numel, b * layer.out_numel, b * layer.macs
            wsize = float(sum(info.tensor_numel[k] for k in layer.tensors))
            if layer.kind in ("conv", "linear", "attention"):
                fwd = kernel(2 * macs, ins + outs + wsize)
                dx = kernel(2 * macs, ins + outs + wsize)
            else:  # norms and other elementwise owners
                fwd = kernel(4 * outs, ins + outs)
                dx = kernel(8 * outs, ins + 2 * outs)
            layer_fwd[li] = fwd
            first = layer.tensors[0]
            self.t_fwd[first] = fwd
            self.t_dx[first] = dx
            for k in layer.tensors:
                role, size = info.tensor_roles[k], float(info.tensor_numel[k])
                if role == "weight":
                    self.t_dw[k] = kernel(2 * macs, ins + outs + size)
                    self.tensor_macs[k] = macs
                elif role == "norm_weight":
                    self.t_dw[k] = kernel(2 * outs, 2 * outs)
                else:  # bias, norm bias, other: a reduction over the output gradient
                    self.t_dw[k] = kernel(outs, outs + size)
        # weightless ops: forward always paid; backward charged to the dx of the layer above.
        # t_ops_fwd_layer[l]: forward of the weightless ops just below layer l (last: after the last layer)
        self.t_ops_fwd_layer = np.zeros(len(info.layers) + 1)
        first_tensor = info.layer_first_tensor()
        for op in info.ops:
            t = float(kernel(b * op.out_numel, b * (op.in_numel + op.out_numel)))
            self.t_ops_fwd_layer[min(op.above, len(info.layers))] += t
            if op.above < len(info.layers):
                self.t_dx[first_tensor[op.above]] += t
        self.t_ops_fwd = float(self.t_ops_fwd_layer.sum())
        self.t_bwd_fixed = launch  # paid once by every step that trains anything (+ the loss, if measured)
        self.measured = device.measured.get(info.model_name)
        if self.measured is not None:
            self._apply_measured(layer_fwd)
        self.forward_time_s = float(self.t_fwd.sum() + self.t_ops_fwd)
        # suffix sums: dx_above[j] = sum_{k > j} t_dx[k]
        self._dx_above = np.concatenate([np.cumsum(self.t_dx[::-1])[::-1][1:], [0.0]])
        layer_macs = b * np.array([layer.macs for layer in info.layers], float)
        self._fwd_macs = float(layer_macs.sum())
        self._dx_macs_above = np.concatenate([np.cumsum(layer_macs[::-1])[::-1][1:], [0.0]])
        self._prepare_memory()

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

    # ---- time -------------------------------------------------------------------------------
    def backward_time_s(self, ratios: np.ndarray) -> float:
        """Backward time (gradients and optimizer update) of one step."""
        ratios = np.asarray(ratios, float)
        selected = np.flatnonzero(ratios > 0)
        if selected.size == 0:
            return 0.0
        launch = self.device.launch_overhead_s.value
        on = ratios > 0
        dw = np.where(on, launch + ratios * (self.t_dw - launch), 0.0).sum()
        opt = (ratios * self.t_opt).sum()
        return float(dw + opt + self._dx_above[selected[0]] + self.t_bwd_fixed)

    def step_time_s(self, ratios: np.ndarray) -> float:
        """Forward plus backward time of one training step."""
        return self.forward_time_s + self.backward_time_s(ratios)

    def full_step_time_s(self) -> float:
        return self.step_time_s(np.ones(self.info.num_tensors))

    def backward_budget_s(self, rho: float) -> float:
        """Backward-time budget for a target step time of ``rho`` x full training."""
        return rho * self.full_step_time_s() - self.forward_time_s

    def probe_time_s(self, full_backward_passes: int, forward_passes: int = 1) -> float:
        """Time of a probe made of full forward and backward passes (importance, Fisher)."""
        full = self.backward_time_s(np.ones(self.info.num_tensors))
        return forward_passes * self.forward_time_s + full_backward_passes * full

    # ---- memory -----------------------------------------------------------------------------
    def memory(self, ratios: np.ndarray) -> MemoryBreakdown:
        """Peak training memory, per ALGORITHMS.md section 4.

        Weights are all resident. A weight gradient saves its layer's input: all of it for a dense
        layer, whatever output channels train, and the trained channels' share for a grouped
        (depthwise) conv, whose output channels each read only their own inputs. A norm scale
        saves its normalised input; biases save nothing. Weightless
        ops above the deepest trained tensor save a one-bit mask (ReLU-like) or their input.
        Trained elements add a gradient and the optimizer's state. The workspace is the largest
        forward in+out pair (inference) or backward gradient buffer.
        """
        ratios = np.asarray(ratios, float)
        e = float(self.device.bytes_per_element)
        selected = np.flatnonzero(ratios > 0)
        trained = float(ratios @ self.info.tensor_numel)
        acts = 0.0
        if selected.size:
            share = np.where(self._act_scales_with_ratio, ratios, ratios > 0)
            acts = float(share @ self._act_bytes) + self._op_bytes_above[self.info.tensor_layer[selected[0]]]
        return MemoryBreakdown(
            self._weight_bytes, acts, trained * e, trained * e * self.optimizer_state, self._workspace
        )

    def _prepare_memory(self) -> None:
        """Per-tensor saved-activation bytes and per-layer op bytes, so memory() is vectorised."""
        info, e, b = self.info, float(self.device.bytes_per_element), float(self.batch_size)
        self._weight_bytes = float(info.tensor_numel.sum()) * e
        self._act_bytes = np.zeros(info.num_tensors)
        self._act_scales_with_ratio = np.ones(info.num_tensors, bool)
        for k, (role, li) in enumerate(zip(info.tensor_roles, info.tensor_layer)):
            layer = info.layers[li]
            if role == "weight":  # dense: any output channel's gradient needs the whole input
                self._act_bytes[k] = layer.in_numel * b * e
                self._act_scales_with_ratio[k] = layer.groups > 1
            elif role in ("norm_weight", "other"):
                self._act_bytes[k] = layer.out_numel * b * e
        # _op_bytes_above[l]: what weightless ops above layer l save when l is the deepest trained layer
        per_layer = np.zeros(len(info.layers) + 1)
        for op in info.ops:
            per_layer[op.above] += op.out_numel * b / 8 if op.kind == "mask" else op.in_numel * b * e
        self._op_bytes_above = np.concatenate([np.cumsum(per_layer[::-1])[::-1][1:], [0.0]])
        self._workspace = max((b * (layer.in_numel + layer.out_numel) * e for layer in info.layers), default=0.0)

    def peak_memory_bytes(self, ratios: np.ndarray) -> float:
        return self.memory(ratios).total_bytes

    def fits(self, ratios: np.ndarray) -> bool:
        return self.peak_memory_bytes(ratios) <= self.device.memory_train_bytes.value

    # ---- communication and energy -----------------------------------------------------------
    def bytes_up(self, ratios: np.ndarray) -> float:
        """Bytes of the trained elements sent to the server."""
        return float((np.asarray(ratios, float) * self.info.tensor_numel).sum() * self.device.bytes_per_element)

    def bytes_down(self) -> float:
        """Bytes of the whole model received from the server."""
        return float(self.info.num_params * self.device.bytes_per_element)

    def step_macs(self, ratios: np.ndarray) -> float:
        """MACs of one step: forward, dX above the deepest trained tensor, and trained dW."""
        ratios = np.asarray(ratios, float)
        selected = np.flatnonzero(ratios > 0)
        if selected.size == 0:
            return self._fwd_macs
        dx = self._dx_macs_above[self.info.tensor_layer[selected[0]]]
        return self._fwd_macs + dx + float(ratios @ self.tensor_macs)

    def energy_j(
        self, train_time_s: float, up_s: float, down_s: float, macs: float = 0.0, moved_bytes: float = 0.0
    ) -> float:
        """Energy: power x time per state, plus the optional per-MAC and per-byte terms."""
        d = self.device
        energy = (
            d.power_train_w.value * train_time_s + d.power_transmit_w.value * up_s + d.power_receive_w.value * down_s
        )
        if d.energy_per_mac_j is not None:
            energy += d.energy_per_mac_j.value * macs
        if d.energy_per_byte_j is not None:
            energy += d.energy_per_byte_j.value * moved_bytes
        return float(energy)

    def round_figures(self, train_time_s: float, macs: float, ratios: np.ndarray, peak_memory_bytes: float) -> Emulated:
        """Emulated figures of one round: local training already priced, plus communication."""
        d = self.device
        up, down = self.bytes_up(ratios), self.bytes_down()
        up_s = d.latency_s.value + 8 * up / d.uplink_bit_per_s.value
        down_s = d.latency_s.value + 8 * down / d.downlink_bit_per_s.value
        energy = self.energy_j(train_time_s, up_s, down_s, macs, up + down)
        return Emulated(train_time_s, up_s + down_s, energy, peak_memory_bytes, up, down, macs)
