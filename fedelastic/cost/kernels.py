"""The kernels of one training step and their roofline times (pure numpy).

:func:`step_kernels` lists every kernel a step of a model runs on a device at a batch size, by
slot: the forward, dX and dW of each tensor (``FWD``, ``DX``, ``DW``: indexed by tensor) and the
forward of the weightless ops just below each layer (``OPS``: indexed by layer; the last index is
after the last layer). :func:`kernel_times` prices them with the profile's per-class roofline
(:func:`kernel_parameters`). :class:`fedelastic.cost.costmodel.CostModel` sums them per tensor; the
conventions of what is charged where are in its module's docstring. :func:`measured_table` picks
the profile's measured per-layer table that replaces the roofline of the layers it lists.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import numpy as np

from ..devices.profile import KERNEL_CLASSES, DeviceProfile, MeasuredTable
from ..modelinfo import SHAPE_FIGURES, FunctionalOp, ModelInfo

FWD, DX, DW, OPS = range(4)  # kernel slots: t_fwd, t_dx, t_dw (per tensor), t_ops_fwd_layer (per layer)


def kernel_parameters(device: DeviceProfile) -> np.ndarray:
    """Per kernel class (rows in :data:`KERNEL_CLASSES` order): effective FLOP/s, effective B/s,
    seconds per kernel (launch + class overhead), half-throughput width in output elements.

    A class the profile does not fit takes its fallback class's parameters; a v1 profile (no
    ``[kernels]``) gives every class ``peak * efficiency``, the whole bandwidth and the launch.
    """
    peak, bw, launch = device.peak_flops.value, device.mem_bandwidth_bytes_per_s.value, device.launch_overhead_s.value
    out = np.zeros((len(KERNEL_CLASSES), 4))
    for i, (name, parent) in enumerate(KERNEL_CLASSES.items()):
        k = device.kernels.get(name)
        while k is None and parent is not None:
            k, parent = device.kernels.get(parent), KERNEL_CLASSES[parent]
        if k is None:
            out[i] = (peak * device.efficiency.value, bw, launch, 0.0)
        else:
            out[i] = (peak * k.efficiency.value, k.bandwidth.value, launch + k.overhead_s.value, k.width.value)
    return out


def kernel_times(params: np.ndarray, cls: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, outputs: np.ndarray):
    """Seconds of each kernel: ``max(flops / P, bytes / B) / s + L`` with ``s = out / (out + width)``."""
    p = params[cls]
    width = p[:, 3]
    s = np.where(width > 0, outputs / (outputs + width), 1.0)
    return np.maximum(flops / p[:, 0], nbytes / p[:, 1]) / np.maximum(s, 1e-12) + p[:, 2]


@dataclass(frozen=True)
class StepKernels:
    """Every kernel of one step, one entry each: its slot (:data:`FWD`, :data:`DX`, :data:`DW`,
    :data:`OPS`), index in the slot, kernel class (row of :data:`KERNEL_CLASSES`), FLOPs, bytes
    moved and output elements; and each tensor's dW MACs per step (``tensor_macs``)."""

    slot: np.ndarray
    index: np.ndarray
    cls: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    outputs: np.ndarray
    tensor_macs: np.ndarray


def step_kernels(info: ModelInfo, device: DeviceProfile, batch_size: int) -> StepKernels:
    """The kernels of one training step of ``info`` on ``device`` at ``batch_size`` (see the module docstring)."""
    b, e = float(batch_size), float(device.bytes_per_element)
    nl = len(info.layers)
    tensor_macs = np.zeros(info.num_tensors)
    # every kernel of one step, priced below by its class: slot (fwd/dx/dw per tensor, forward of
    # the weightless ops below each layer), index in the slot, class, flops, bytes, output elements
    rows: list[tuple[int, int, int, float, float, float]] = []
    cls_id = {c: i for i, c in enumerate(KERNEL_CLASSES)}

    def add(slot: int, idx: int, cls: str, flops: float, elements: float, outputs: float) -> None:
        rows.append((slot, idx, cls_id[cls], flops, elements * e, outputs))

    first_tensor = info.layer_first_tensor()
    transposes = bool(device.kernels) and device.layout_transposes
    for layer in info.layers:
        ins, outs, macs = b * layer.in_numel, b * layer.out_numel, b * layer.macs
        wsize = float(sum(info.tensor_numel[k] for k in layer.tensors))
        first = layer.tensors[0]
        if layer.kind in ("conv", "linear", "attention"):
            kind = "depthwise" if layer.groups > 1 else "gemm"
            add(FWD, first, f"{kind}_fwd", 2 * macs, ins + outs + wsize, outs)
            add(DX, first, f"{kind}_dx", 2 * macs, ins + outs + wsize, ins)
            if transposes and layer.kind == "conv":  # its output back to the framework's layout
                add(FWD, first, "layout", 0.0, 2 * outs, outs)
        else:  # norms and other elementwise owners
            add(FWD, first, "eltwise", 4 * outs, ins + outs, outs)
            add(DX, first, "eltwise", 8 * outs, ins + 2 * outs, ins)
        for k in layer.tensors:
            role, size = info.tensor_roles[k], float(info.tensor_numel[k])
            if role == "weight":
                cls = "depthwise_dw" if layer.groups > 1 else "gemm_dw"
                add(DW, k, cls, 2 * macs, ins + outs + size, size)
                if transposes and layer.kind == "conv":  # the output gradient into the conv's layout
                    add(DW, k, "layout", 0.0, 2 * outs, outs)
                tensor_macs[k] = macs
            elif role == "norm_weight":
                add(DW, k, "reduce", 2 * outs, 2 * outs, size)
            else:  # bias, norm bias, other: a reduction over the output gradient
                add(DW, k, "reduce", outs, outs + size, size)
                if role == "bias" and device.kernels:  # a separate bias-add pass (kernel-aware profiles)
                    add(FWD, first, "eltwise", outs, 2 * outs, outs)
    # weightless ops: forward always paid; backward charged to the dx of the layer above
    for op in info.ops:
        out_n, in_n = b * op.out_numel, b * op.in_numel
        add(OPS, min(op.above, nl), "eltwise", out_n, in_n + out_n, out_n)
        if op.above < nl:
            add(DX, int(first_tensor[op.above]), "eltwise", out_n, in_n + out_n, in_n)
            if transposes and op.kind == "mask":  # an activation's gradient, back to the framework's layout
                add(DX, int(first_tensor[op.above]), "layout", 0.0, 2 * in_n, in_n)
    # functional ops (residual adds, attention cores...): priced only by kernel-aware profiles,
    # so that a v1 profile's fitted roofline keeps the meaning it was fitted with
    for fn in info.functional if device.kernels else ():
        _functional_kernels(fn, b, add, nl, int(first_tensor[fn.above]) if fn.above < nl else -1)
    slot, index, classes, flops, nbytes, outputs = (
        np.array([r[i] for r in rows], dtype=np.int64 if i < 3 else float).reshape(-1) for i in range(6)
    )
    return StepKernels(slot, index, classes, flops, nbytes, outputs, tensor_macs)


def _functional_kernels(fn: FunctionalOp, b: float, add, nl: int, dx_tensor: int) -> None:
    """Kernels of a functional op: forward below layer ``fn.above``, backward in its dx."""
    out_n, in_n = b * fn.out_numel, b * fn.in_numel
    above = min(fn.above, nl)
    if fn.kind == "matmul":
        macs = b * fn.macs
        add(OPS, above, "gemm_fwd", 2 * macs, in_n + out_n, out_n)
        if dx_tensor >= 0:  # both operands' gradients: two products of the forward's size
            add(DX, dx_tensor, "gemm_dx", 4 * macs, 2 * (in_n + out_n), in_n)
        return
    cls = "reduce" if fn.kind == "softmax" else "layout" if fn.kind == "layout" else "eltwise"
    binary = fn.name.split("#")[0].strip("_").lstrip("ri") in ("add", "sub", "mul", "truediv", "div")
    moved = (2 * in_n + out_n) if binary else (in_n + out_n)
    add(OPS, above, cls, 4 * out_n if cls == "reduce" else out_n, moved, out_n)
    if dx_tensor >= 0:  # a residual add's backward is the gradient sum where its branches meet
        add(DX, dx_tensor, cls, out_n, 3 * out_n if binary else 2 * out_n, in_n)


_WARNED: set[tuple[str, str, str]] = set()  # (device, model, figure) already warned of
_WARNED_LOCK = threading.Lock()


def shape_mismatch(table: MeasuredTable, info: ModelInfo) -> str:
    """The first per-sample figure (:data:`SHAPE_FIGURES`) where ``info`` differs from the model
    ``table`` was measured on, as text ("" when they match or the table records no shape)."""
    shape = info.shape()
    for figure in SHAPE_FIGURES:
        if figure in table.shape and table.shape[figure] != shape.get(figure):
            return f"{_FIGURE_TEXT[figure]} {shape.get(figure)}, the table's model {table.shape[figure]}"
    return ""


_FIGURE_TEXT = {
    "input": "input elements per sample (first layer)",
    "classes": "classes",
    "params": "parameters",
    "macs": "forward MACs per sample",
}


def predicted_table(device: DeviceProfile, info: ModelInfo, batch_size: int) -> MeasuredTable:
    """A per-layer table of ``info`` at ``batch_size`` priced by ``device``'s sampled kernel
    predictors (:func:`fedelastic.devices.kernelsample.predicted_layers`); layers they cannot price are
    left out (the kernel/roofline model prices those)."""
    from ..devices.kernelsample import predicted_layers
    from ..devices.profile import LayerTiming

    layers, after = predicted_layers(device.sampled, info, batch_size)
    return MeasuredTable(
        batch_size=batch_size,
        source=f"{device.name}: predicted by its sampled kernels",
        layers={name: LayerTiming(*t) for name, t in layers.items()},
        unattributed_fwd_s=after,
        model=info.model_name,
    )


def measured_table(device: DeviceProfile, info: ModelInfo) -> MeasuredTable | None:
    """``device``'s measured table of ``info.model_name``, if it was measured on a model of this shape.

    A table that records its model's shape (per-sample input, classes, parameters, MACs) is used
    only when ``info`` matches it; on a mismatch a warning (once per device, model and figure)
    names the figure, and the kernel/roofline model prices the layers. The batch size is not
    matched: a table's times scale linearly with it. A table that records no shape is used as is.
    """
    table = device.measured.get(info.model_name)
    if table is None:
        return None
    differs = shape_mismatch(table, info)
    if not differs:
        return table
    key = (device.name, info.model_name, differs.split(" ", 1)[0])  # one warning per figure's kind
    with _WARNED_LOCK:
        first = key not in _WARNED
        _WARNED.add(key)
    if first:
        warnings.warn(
            f"device profile {device.name!r}: its measured table of {info.model_name!r} is not used: {differs} "
            "(measured at another shape); the kernel/roofline model prices its layers",
            UserWarning,
            stacklevel=3,
        )
    return None
