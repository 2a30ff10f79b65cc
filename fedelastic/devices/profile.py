"""Device profiles: schema v2 (v1 still loads), loader, registry and fleet assignment.

A profile is a TOML file. Every number is an inline table
``{ value = ..., unit = "...", source = "..." }``; the loader checks the unit against the
quantity's dimension, converts to SI and keeps the source. Unknown keys are errors.
Every key is listed in docs/reference/profile-keys.md (generated from :data:`KEY_HELP` by fedelastic.docgen).

Schema v2 adds two optional sections: ``[kernels.<class>]``, the fitted roofline of each kernel
class (:data:`KERNEL_CLASSES`; see :mod:`fedelastic.cost.costmodel`), and ``[uncertainty]``, the
relative error band of a roofline-priced step time. A v1 profile has neither: every kernel class
then uses ``compute.efficiency``, the whole ``mem_bandwidth`` and no extra overhead.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..config import read_toml
from ..errors import ConfigError
from .units import UNITS, to_si

SCHEMA_VERSION = 2
SCHEMA_VERSIONS = (1, 2)

#: Kernel classes the cost model prices separately, and the class whose parameters each one falls
#: back to when a profile does not fit it (None: the profile's single-efficiency roofline).
KERNEL_CLASSES: dict[str, str | None] = {
    "gemm_fwd": None,  # dense conv / linear / attention matmuls, forward
    "gemm_dx": None,  # their input gradients
    "gemm_dw": None,  # their weight gradients
    "eltwise": None,  # element-wise and norm ops, activations, residual adds
    "reduce": None,  # reductions: softmax, pooling, bias and norm-parameter gradients
    "layout": "eltwise",  # copies: padding, concatenation, layout transforms
    "depthwise_fwd": "eltwise",  # grouped / depthwise conv: a stencil, not a GEMM
    "depthwise_dx": "eltwise",
    "depthwise_dw": "reduce",  # its filter gradient: a reduction onto k*k outputs per channel
}
DEVICE_CLASSES = ("mcu", "sbc", "gpu-edge", "phone")
DTYPES = {"fp32": 4, "fp16": 2, "int8": 1}


@dataclass(frozen=True)
class Quantity:
    """A number in SI units with the source it came from."""

    value: float
    source: str


@dataclass(frozen=True)
class LayerTiming:
    """Measured seconds per training step of one layer, at the table's batch size.

    ``fwd_s``: its forward (and the weightless ops just below it); ``dx_s``: passing the error
    gradient from its output to its input (through the weightless ops below it); ``dw_s``: the
    gradients of its own parameters.
    """

    fwd_s: float
    dx_s: float
    dw_s: float


@dataclass(frozen=True)
class MeasuredTable:
    """A measured per-layer table of one model on one device (a profile's ``[measured.<model>]``).

    ``layers`` are keyed by the project model's torch module names, in forward order. The step
    totals (``step_s``, ``forward_s``, ``backward_s``, ``other_s``: medians of the measured steps;
    ``other_s`` is what falls outside forward and backward, optimizer and gaps included) and
    ``n_steps`` are known where the table was measured or imported, and 0 when it was loaded from
    a profile, which keeps only what the cost model uses.
    """

    batch_size: int
    source: str
    layers: dict[str, LayerTiming]
    unattributed_fwd_s: float = 0.0  # forward no layer owns (the loss)
    unattributed_bwd_s: float = 0.0  # backward no layer owns (the loss gradient)
    model: str = ""
    step_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    other_s: float = 0.0
    n_steps: int = 0
    layout_transposes: bool = False  # imported from a trace with layout transposes (TensorFlow's layout optimizer)
    #: the measured model's per-sample figures (:meth:`fedelastic.modelinfo.ModelInfo.shape`); empty: not recorded
    shape: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KernelClass:
    """Fitted roofline of one kernel class: ``max(flops / (peak * efficiency), bytes / bandwidth) / s
    + launch_overhead + overhead`` with ``s = outputs / (outputs + width)``.

    ``width`` is the output elements at which a kernel reaches half its throughput (0: always full).
    """

    efficiency: Quantity  # fraction of the dtype's peak
    bandwidth: Quantity  # effective B/s of the class's kernels
    overhead_s: Quantity  # per kernel, on top of compute.launch_overhead
    width: Quantity  # elements


@dataclass(frozen=True)
class DeviceProfile:
    """A validated device profile; numbers are in SI units (bytes, FLOP/s, B/s, bit/s, s, W, J)."""

    name: str
    display_name: str
    device_class: str
    train_dtype: str
    memory_train_bytes: Quantity  # RAM for training (an MCU's SRAM budget)
    peak_flops: Quantity  # of train_dtype, in FLOP/s (or OP/s for int8)
    mem_bandwidth_bytes_per_s: Quantity
    efficiency: Quantity
    launch_overhead_s: Quantity
    power_train_w: Quantity
    power_idle_w: Quantity
    power_transmit_w: Quantity
    power_receive_w: Quantity
    uplink_bit_per_s: Quantity
    downlink_bit_per_s: Quantity
    latency_s: Quantity
    energy_per_mac_j: Quantity | None = None
    #: energy by phase: draw while compute-bound and while memory-bound kernels run (both or neither)
    power_compute_w: Quantity | None = None
    power_memory_w: Quantity | None = None
    energy_per_byte_j: Quantity | None = None
    #: flash (non-volatile, read in place) that holds the frozen weights; None: every weight sits in
    #: ``memory_train_bytes`` (boards and phones that load the model into RAM)
    memory_flash_bytes: Quantity | None = None
    availability: Quantity | None = None
    measured: dict[str, MeasuredTable] = field(default_factory=dict)
    notes: str = ""
    path: str = ""
    kernels: dict[str, KernelClass] = field(default_factory=dict)
    uncertainty: Quantity | None = None  # relative 1-sigma error of a roofline-priced step time
    power_uncertainty: Quantity | None = None  # relative 1-sigma error of the powers (None: unverified)
    #: counted scalar operations of a selector per second (None: priced at peak x efficiency)
    scalar_ops_per_s: Quantity | None = None
    #: the framework copies convolution activations between memory layouts (TensorFlow's layout
    #: optimizer on a GPU: NHWC <-> NCHW around every conv); priced by kernel-aware profiles only
    layout_transposes: bool = False
    #: sampled kernel predictors (``[sampled]``: class -> phase -> predictor; see fedelastic.devices.kernelsample)
    sampled: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one tensor element in the dtype the device trains in."""
        return DTYPES[self.train_dtype]


# (section, key) -> (dimension, required)
_QUANTITIES: dict[str, dict[str, tuple[str, bool]]] = {
    "memory": {"train": ("bytes", True), "flash": ("bytes", False)},
    "compute": {
        "peak_fp32": ("flops", False),
        "peak_fp16": ("flops", False),
        "peak_int8": ("ops", False),
        "mem_bandwidth": ("bandwidth", True),
        "efficiency": ("ratio", True),
        "launch_overhead": ("time", True),
        "scalar_ops_per_s": ("ops", False),
    },
    "power": {
        "train": ("power", True),
        "idle": ("power", True),
        "transmit": ("power", True),
        "receive": ("power", True),
        "compute": ("power", False),
        "memory": ("power", False),
        "energy_per_mac": ("energy", False),
        "energy_per_byte": ("energy", False),
    },
    "network": {
        "uplink": ("bitrate", True),
        "downlink": ("bitrate", True),
        "latency": ("time", True),
    },
    "availability": {"probability": ("ratio", True)},
    "uncertainty": {"step": ("ratio", True), "power": ("ratio", False)},
}
_OPTIONAL_SECTIONS = ("availability", "uncertainty")
_KERNEL_KEYS = {"efficiency": "ratio", "bandwidth": "bandwidth", "overhead": "time", "width": "count"}
_TOP_KEYS = {
    "schema_version",
    "name",
    "display_name",
    "device_class",
    "train_dtype",
    "notes",
    "measured",
    "kernels",
    "layout_transposes",
    "sampled",
}


#: What each profile key means (rendered into docs/reference/profile-keys.md by fedelastic.docgen).
KEY_HELP: dict[str, str] = {
    "schema_version": "2 (or 1: a v1 file has no [kernels] or layout_transposes)",
    "name": "equals the file stem",
    "display_name": "human name, including the power mode where it matters",
    "device_class": "one of " + ", ".join(DEVICE_CLASSES),
    "train_dtype": "fp32, fp16 or int8: the dtype the device trains in (bytes per element and training numerics)",
    "notes": "free text: mode chosen, assumptions, known gaps",
    "measured": "measured per-layer tables, one per model (written by `fedelastic profile` tools, never by hand)",
    "kernels": "fitted roofline of each kernel class (v2; see the cost model)",
    "layout_transposes": "price the framework's layout copies around convs (v2; default false)",
    "sampled": "per kernel class and phase, a predictor fitted to kernels timed on the device (written by "
    "`fedelastic profile measure`, never by hand); prices every model it has no measured table of",
    "memory.train": "memory available to training (for MCUs, the SRAM budget: trained weights, gradients, "
    "optimizer state, saved activations, workspace; every weight too when there is no memory.flash)",
    "memory.flash": "flash that holds the frozen weights, read in place (MCUs); absent: all weights count "
    "against memory.train",
    "compute.peak_fp32": "peak FP32 throughput (required when train_dtype = fp32)",
    "compute.peak_fp16": "peak FP16 throughput (required when train_dtype = fp16)",
    "compute.peak_int8": "peak int8 throughput (required when train_dtype = int8)",
    "compute.mem_bandwidth": "memory bandwidth, > 0",
    "compute.efficiency": "share of the peak that large kernels reach, in (0, 1]",
    "compute.launch_overhead": "fixed cost added to every kernel",
    "compute.scalar_ops_per_s": "rate of the selector's counted scalar operations (DP cells, greedy steps; "
    "`fedelastic profile measure` times them); absent: the selector is priced at peak x efficiency, "
    "hundreds of times too cheap",
    "power.train": "whole-device draw while training",
    "power.idle": "whole-device draw while idle (waiting for the round to end)",
    "power.transmit": "whole-device draw while sending",
    "power.receive": "whole-device draw while receiving",
    "power.compute": "whole-device draw while compute-bound kernels run (energy by phase: with power.memory, "
    "replaces power.train for training, weighted by each selection's compute-bound share of its step)",
    "power.memory": "whole-device draw while memory-bound kernels, launch overheads and the optimizer update run "
    "(energy by phase; give it with power.compute)",
    "power.energy_per_mac": "dynamic energy per MAC, added on top of the state powers",
    "power.energy_per_byte": "dynamic energy per byte moved, added on top of the state powers",
    "network.uplink": "sustained uplink throughput, > 0",
    "network.downlink": "sustained downlink throughput, > 0",
    "network.latency": "paid once per transfer",
    "availability.probability": "chance that the device is reachable in a round (the section is optional)",
    "uncertainty.step": "relative one-sigma error of a step time the profile prices without a measured table "
    "(the section is optional; absent: no band): sized by leave-one-model-out errors, or a stated rule "
    "where there is one model or none ([uncertainty](../explanation/cost-model.md#uncertainty))",
    "uncertainty.power": "relative one-sigma error of the power figures (measured: their spread); absent: "
    "0.3, the rule for unverified power",
    "kernels.<class>.efficiency": "share of the dtype's peak the class's kernels reach",
    "kernels.<class>.bandwidth": "effective memory bandwidth of the class's kernels",
    "kernels.<class>.overhead": "per-kernel time on top of compute.launch_overhead",
    "kernels.<class>.width": "output elements at which a kernel reaches half its throughput (0: always full)",
}


def _check_unknown(src: str, where: str, got: dict, allowed: set[str]) -> None:
    for key in got:
        if key not in allowed:
            full = f"{where}.{key}" if where else key
            raise ConfigError(src, full, f"one of {sorted(allowed)} (unknown key)", key)


def _quantity(src: str, key: str, raw: Any, dimension: str) -> Quantity:
    if not isinstance(raw, dict):
        raise ConfigError(src, key, "an inline table { value = <number>, unit = <str>, source = <str> }", raw)
    _check_unknown(src, key, raw, {"value", "unit", "source"})
    for part in ("value", "unit", "source"):
        if part not in raw:
            raise ConfigError(src, f"{key}.{part}", f"a '{part}' entry (every number cites its source)")
    value, unit, source = raw["value"], raw["unit"], raw["source"]
    if not _finite_number(value) or value < 0:
        raise ConfigError(src, f"{key}.value", "a finite non-negative number", value)
    if not isinstance(unit, str) or unit not in UNITS[dimension]:
        raise ConfigError(src, f"{key}.unit", f"a {dimension} unit, one of {list(UNITS[dimension])}", unit)
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(src, f"{key}.source", "a non-empty string naming where the number comes from", source)
    si = to_si(value, unit, dimension)
    if not np.isfinite(si):
        raise ConfigError(src, f"{key}.value", f"a number that stays finite in SI units ({unit} -> {si})", value)
    return Quantity(si, source)


def _finite_number(v: Any) -> bool:
    """An int or float (not a bool) that is finite as a float: an int past float's range (TOML allows
    64-bit ones) is not (np.isfinite raises TypeError on it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _seconds(v: Any) -> bool:
    return _finite_number(v) and v >= 0


def _measured(src: str, raw: Any) -> dict[str, MeasuredTable]:
    if not isinstance(raw, dict):
        raise ConfigError(src, "measured", "a table of per-model tables", raw)
    tables = {}
    for model, table in raw.items():
        where = f"measured.{model}"
        if not isinstance(table, dict):
            raise ConfigError(src, where, "a table with batch_size, source and layers", table)
        _check_unknown(
            src, where, table, {"batch_size", "source", "layers", "unattributed_fwd", "unattributed_bwd", "shape"}
        )
        for key in ("batch_size", "source", "layers"):
            if key not in table:
                raise ConfigError(src, f"{where}.{key}", "this key to be present")
        if isinstance(table["batch_size"], bool) or not isinstance(table["batch_size"], int) or table["batch_size"] < 1:
            raise ConfigError(src, f"{where}.batch_size", "a positive integer", table["batch_size"])
        if not isinstance(table["source"], str) or not table["source"].strip():
            raise ConfigError(src, f"{where}.source", "a non-empty string", table["source"])
        if not isinstance(table["layers"], dict):
            raise ConfigError(src, f"{where}.layers", "a table of layer name -> { fwd, dx, dw }", table["layers"])
        layers = {}
        for layer, row in table["layers"].items():
            lkey = f"{where}.layers.{layer}"
            if not isinstance(row, dict) or set(row) != {"fwd", "dx", "dw"}:
                raise ConfigError(src, lkey, "{ fwd = <s>, dx = <s>, dw = <s> } (seconds per step)", row)
            vals = [row[k] for k in ("fwd", "dx", "dw")]
            if not all(_seconds(v) for v in vals):
                raise ConfigError(src, lkey, "finite non-negative numbers of seconds", row)
            layers[layer] = LayerTiming(*map(float, vals))
        extras = {k: table.get(k, 0.0) for k in ("unattributed_fwd", "unattributed_bwd")}
        for k, v in extras.items():
            if not _seconds(v):
                raise ConfigError(src, f"{where}.{k}", "finite non-negative seconds", v)
        tables[model] = MeasuredTable(
            table["batch_size"],
            table["source"],
            layers,
            float(extras["unattributed_fwd"]),
            float(extras["unattributed_bwd"]),
            model=str(model),
            shape=_shape(src, f"{where}.shape", table.get("shape", {})),
        )
    return tables


def _shape(src: str, where: str, raw: Any) -> dict[str, int]:
    """A measured table's ``shape``: per-sample figures of the measured model, each a positive integer."""
    from ..modelinfo import SHAPE_FIGURES

    expected = f"a table of {list(SHAPE_FIGURES)}, each a positive integer"
    if not isinstance(raw, dict):
        raise ConfigError(src, where, expected, raw)
    for key, value in raw.items():
        if key not in SHAPE_FIGURES or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(src, f"{where}.{key}", expected, value)
    return {k: int(raw[k]) for k in SHAPE_FIGURES if k in raw}


def _kernels(src: str, raw: Any) -> dict[str, KernelClass]:
    if not isinstance(raw, dict):
        raise ConfigError(src, "kernels", "a table of [kernels.<class>] tables", raw)
    out = {}
    for name, table in raw.items():
        where = f"kernels.{name}"
        if name not in KERNEL_CLASSES:
            raise ConfigError(src, where, f"a kernel class, one of {list(KERNEL_CLASSES)}", name)
        if not isinstance(table, dict):
            raise ConfigError(src, where, f"a table with {sorted(_KERNEL_KEYS)}", table)
        _check_unknown(src, where, table, set(_KERNEL_KEYS))
        q = {}
        for key, dimension in _KERNEL_KEYS.items():
            if key not in table:
                raise ConfigError(src, f"{where}.{key}", f"a {dimension} quantity (required)")
            q[key] = _quantity(src, f"{where}.{key}", table[key], dimension)
        if not 0 < q["efficiency"].value <= 1:
            raise ConfigError(src, f"{where}.efficiency.value", "a fraction in (0, 1]", q["efficiency"].value)
        if q["bandwidth"].value <= 0:
            raise ConfigError(src, f"{where}.bandwidth.value", "a positive number", q["bandwidth"].value)
        out[name] = KernelClass(q["efficiency"], q["bandwidth"], q["overhead"], q["width"])
    return out


def parse_profile(raw: dict, src: str, stem: str | None = None) -> DeviceProfile:
    """Validate a parsed TOML document into a :class:`DeviceProfile`."""
    _check_unknown(src, "", raw, _TOP_KEYS | set(_QUANTITIES))
    if raw.get("schema_version") not in SCHEMA_VERSIONS:
        raise ConfigError(src, "schema_version", f"one of {list(SCHEMA_VERSIONS)}", raw.get("schema_version"))
    if raw["schema_version"] == 1:
        for key in ("kernels", "layout_transposes"):
            if key in raw:
                raise ConfigError(src, key, "schema_version = 2 (this section is new in v2)", raw["schema_version"])
    for key in ("name", "display_name", "device_class", "train_dtype"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ConfigError(src, key, "a non-empty string", raw.get(key))
    if stem is not None and raw["name"] != stem:
        raise ConfigError(src, "name", f"the file name without .toml ({stem!r})", raw["name"])
    if not isinstance(raw.get("layout_transposes", False), bool):
        raise ConfigError(src, "layout_transposes", "true or false", raw["layout_transposes"])
    if raw["device_class"] not in DEVICE_CLASSES:
        raise ConfigError(src, "device_class", f"one of {list(DEVICE_CLASSES)}", raw["device_class"])
    if raw["train_dtype"] not in DTYPES:
        raise ConfigError(src, "train_dtype", f"one of {list(DTYPES)}", raw["train_dtype"])

    q: dict[str, Quantity | None] = {}
    for section, spec in _QUANTITIES.items():
        table = raw.get(section)
        if table is None:
            if section in _OPTIONAL_SECTIONS:
                continue
            raise ConfigError(src, section, f"a [{section}] table")
        if not isinstance(table, dict):
            raise ConfigError(src, section, f"a [{section}] table", table)
        _check_unknown(src, section, table, set(spec))
        for key, (dimension, required) in spec.items():
            full = f"{section}.{key}"
            if key in table:
                q[full] = _quantity(src, full, table[key], dimension)
            elif required:
                raise ConfigError(src, full, f"a {dimension} quantity (required)")
            else:
                q[full] = None

    peak_key = f"compute.peak_{raw['train_dtype']}"
    if q.get(peak_key) is None:
        raise ConfigError(src, peak_key, f"a peak throughput, since train_dtype = {raw['train_dtype']!r}")
    eff = q["compute.efficiency"]
    assert eff is not None
    if not 0 < eff.value <= 1:
        raise ConfigError(src, "compute.efficiency.value", "a fraction in (0, 1]", eff.value)
    avail = q.get("availability.probability")
    if avail is not None and avail.value > 1:
        raise ConfigError(src, "availability.probability.value", "a probability in [0, 1]", avail.value)
    if "notes" in raw and not isinstance(raw["notes"], str):
        raise ConfigError(src, "notes", "a string", raw["notes"])
    for key, other in (("power.compute", "power.memory"), ("power.memory", "power.compute")):
        if q[key] is not None and q[other] is None:
            raise ConfigError(src, other, f"a power quantity too, since {key} is given (energy by phase needs both)")
    positive = ["memory.train", "compute.mem_bandwidth", "network.uplink", "network.downlink", peak_key]
    optional = [k for k in ("memory.flash", "compute.scalar_ops_per_s") if q.get(k) is not None]
    for key in positive + optional:
        if q[key].value <= 0:  # type: ignore[union-attr]
            raise ConfigError(src, f"{key}.value", "a positive number", q[key].value)  # type: ignore[union-attr]
    return DeviceProfile(
        name=raw["name"],
        display_name=raw["display_name"],
        device_class=raw["device_class"],
        train_dtype=raw["train_dtype"],
        memory_train_bytes=q["memory.train"],  # type: ignore[arg-type]
        memory_flash_bytes=q.get("memory.flash"),
        peak_flops=q[peak_key],  # type: ignore[arg-type]
        mem_bandwidth_bytes_per_s=q["compute.mem_bandwidth"],  # type: ignore[arg-type]
        efficiency=eff,
        launch_overhead_s=q["compute.launch_overhead"],  # type: ignore[arg-type]
        power_train_w=q["power.train"],  # type: ignore[arg-type]
        power_idle_w=q["power.idle"],  # type: ignore[arg-type]
        power_transmit_w=q["power.transmit"],  # type: ignore[arg-type]
        power_receive_w=q["power.receive"],  # type: ignore[arg-type]
        uplink_bit_per_s=q["network.uplink"],  # type: ignore[arg-type]
        downlink_bit_per_s=q["network.downlink"],  # type: ignore[arg-type]
        latency_s=q["network.latency"],  # type: ignore[arg-type]
        energy_per_mac_j=q["power.energy_per_mac"],
        power_compute_w=q["power.compute"],
        power_memory_w=q["power.memory"],
        energy_per_byte_j=q["power.energy_per_byte"],
        availability=q.get("availability.probability"),
        measured=_measured(src, raw["measured"]) if "measured" in raw else {},
        notes=str(raw.get("notes", "")),
        path=src,
        kernels=_kernels(src, raw["kernels"]) if "kernels" in raw else {},
        uncertainty=q.get("uncertainty.step"),
        power_uncertainty=q.get("uncertainty.power"),
        scalar_ops_per_s=q.get("compute.scalar_ops_per_s"),
        layout_transposes=raw.get("layout_transposes", False),
        sampled=_sampled(src, raw["sampled"]) if "sampled" in raw else {},
    )


def _sampled(src: str, raw: Any) -> dict[str, Any]:
    from .kernelsample import parse_sampled

    return parse_sampled(src, raw)


def load_profile(path: str | Path) -> DeviceProfile:
    """Load and validate one profile file; raises :class:`ConfigError` naming the file and key."""
    path = Path(path)
    raw = read_toml(path, "device profile")
    return parse_profile(raw, str(path), stem=path.stem)


def builtin_profile_dir() -> Path:
    """The folder of the profiles shipped with fedelastic (installed as ``fedelastic.device_profiles``)."""
    try:
        return Path(str(resources.files("fedelastic.device_profiles")))
    except ModuleNotFoundError:  # not installed: a source tree or a Flower app bundle
        return Path(__file__).resolve().parent.parent.parent / "device_profiles"


_SHADOWED_REPORTED: set[tuple[str, str]] = set()


def profile_paths(extra_dirs: tuple[str | Path, ...] = ()) -> dict[str, Path]:
    """Map device name to file, over the built-in folder then ``extra_dirs`` (later ones override).

    A profile that replaces one of the same name (a built-in, say) is reported once per process.
    """
    paths: dict[str, Path] = {}
    for folder in (builtin_profile_dir(), *map(Path, extra_dirs)):
        for file in sorted(folder.glob("*.toml")):
            old = paths.get(file.stem)
            if old is not None and old.resolve() != file.resolve() and (file.stem, str(file)) not in _SHADOWED_REPORTED:
                _SHADOWED_REPORTED.add((file.stem, str(file)))
                warnings.warn(f"device profile {file.stem!r}: {file} replaces {old}", UserWarning, stacklevel=2)
            paths[file.stem] = file
    return paths


def get_profile(name: str, extra_dirs: tuple[str | Path, ...] = (), *, context: str = "<fleet>") -> DeviceProfile:
    """Load a profile by name or by file path."""
    if name.endswith(".toml"):
        if not Path(name).is_file():  # named by the fleet: the scenario's key, not the missing file, is at fault
            raise ConfigError(context, f"fleet.{name}", "an existing device profile file (.toml)", name)
        return load_profile(name)
    paths = profile_paths(extra_dirs)
    if name not in paths:
        raise ConfigError(context, f"fleet.{name}", f"a known device, one of {sorted(paths)}", name)
    return load_profile(paths[name])


def assign_fleet(counts: dict[str, int], seed: int) -> list[str]:
    """Device name of each partition, shuffled deterministically from ``seed``."""
    names = [name for name, count in sorted(counts.items()) for _ in range(count)]
    order = np.random.default_rng([seed, 0xDE71CE]).permutation(len(names))
    return [names[i] for i in order]
