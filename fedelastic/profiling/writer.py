"""Write device profiles: TOML layout, measured tables, fitted numbers, provenance."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..devices.profile import DeviceProfile, parse_profile
from ..modelinfo import ModelInfo
from .measure import host_description
from .roofline_fit import FitResult


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def measured_table_toml(table: Any) -> dict[str, Any]:
    """The ``[measured.<model>]`` table of a measured table (times in seconds, 4 significant digits).

    ``table`` is a ``fedelastic.devices.profile.MeasuredTable`` (or any object with ``batch_size``,
    ``source``, ``layers`` of ``fwd_s``/``dx_s``/``dw_s`` and ``unattributed_*_s``).
    """
    out: dict[str, Any] = {"batch_size": int(table.batch_size), "source": str(table.source)}
    for key in ("unattributed_fwd", "unattributed_bwd"):
        value = float(getattr(table, f"{key}_s", 0.0))
        if value > 0:
            out[key] = _sig(value)
    shape = getattr(table, "shape", None)
    if shape:
        out["shape"] = {k: int(v) for k, v in shape.items()}
    out["layers"] = {
        name: {"fwd": _sig(t.fwd_s), "dx": _sig(t.dx_s), "dw": _sig(t.dw_s)} for name, t in table.layers.items()
    }
    return out


def _quantity(value: float, unit: str, source: str, digits: int = 4) -> dict[str, Any]:
    return {"value": _sig(value, digits), "unit": unit, "source": source}


#: What ``profile measure`` cannot measure: explicit placeholders, marked unverified.
PLACEHOLDERS: dict[str, dict[str, tuple[float, str]]] = {
    "power": {"train": (10.0, "W"), "idle": (3.0, "W"), "transmit": (4.0, "W"), "receive": (3.5, "W")},
    "network": {"uplink": (20.0, "Mbit/s"), "downlink": (50.0, "Mbit/s"), "latency": (30.0, "ms")},
}


def apply_fit(raw: dict[str, Any], fit: FitResult, source: str, *, bandwidth: bool = True) -> dict[str, Any]:
    """Write a fit into a raw profile: ``efficiency`` (against its peak), ``launch_overhead``, ``mem_bandwidth``.

    The peak keeps its value and source; the datasheet bandwidth is kept in the new source text.
    """
    dtype = raw["train_dtype"]
    compute = raw["compute"]
    peak_q = compute[f"peak_{dtype}"]
    from ..devices.units import UNITS

    dim = "ops" if dtype == "int8" else "flops"
    peak = float(peak_q["value"]) * UNITS[dim][peak_q["unit"]]
    eff = fit.efficiency(peak)
    models = ", ".join(fit.models)
    compute["efficiency"] = _quantity(
        eff, "1", f"{source}: peak x efficiency = {fit.peak_eff / 1e9:.4g} GFLOP/s effective ({models})"
    )
    compute["launch_overhead"] = _quantity(fit.launch_overhead * 1e6, "us", f"{source} ({models})")
    if bandwidth:
        old = compute.get("mem_bandwidth", {})
        old_source = str(old.get("source", ""))
        if "; was " in old_source:  # refitting: keep what the first fit replaced (the datasheet figure)
            was = "; was " + old_source.split("; was ", 1)[1]
        elif old and not old_source.startswith("fitted"):
            was = f"; was {old.get('value')} {old.get('unit')}: {old_source}"
        else:
            was = ""
        compute["mem_bandwidth"] = _quantity(
            fit.mem_bandwidth / 1e9, "GB/s", f"{source}: effective bandwidth ({models}){was}"
        )
    return raw


def build_profile_dict(
    name: str,
    *,
    tables: dict[str, Any],
    fit: FitResult,
    peak_flops: tuple[float, str],
    memory: tuple[float, str],
    measured_by: str,
    display_name: str | None = None,
    device_class: str = "sbc",
    like: dict[str, Any] | None = None,
    notes: str = "",
    scalar_rate: tuple[float, str] | None = None,
    power: dict[str, tuple[float, str]] | None = None,
) -> dict[str, Any]:
    """A schema-v1 profile (as a TOML-ready dict) for a measured device.

    Parameters
    ----------
    name : str
        Device name (the file stem).
    tables : dict of str to measured table
        ``[measured.<model>]`` tables, by model registry name.
    fit : FitResult
        Fitted roofline; efficiency is taken against ``peak_flops``.
    peak_flops : (float, str)
        Measured FP32 peak in FLOP/s and how it was measured.
    memory : (float, str)
        Bytes available for training and where the number comes from.
    measured_by : str
        ``"fedelastic profile measure on <host>, <date>, torch <ver>, <n> threads"``: prefixes the
        source of every measured or fitted number.
    scalar_rate : (float, str), optional
        Measured selector operations per second and how (``compute.scalar_ops_per_s``).
    power : dict of str to (float, str), optional
        Powers measured on this machine (W, how), by ``[power]`` key (``train``, ``idle``): they
        replace the copied or placeholder values. ``[uncertainty] power`` is not set: the radio
        powers stay unmeasured, so the unverified-power band still applies.
    like : dict, optional
        A raw profile whose ``[power]`` and ``[network]`` (and ``availability``) are copied
        (e.g. the datasheet profile of the same board); otherwise unverified placeholders.
    """
    raw: dict[str, Any] = {
        "schema_version": 1,
        "name": name,
        "display_name": display_name or f"{name} (measured by fedelastic profile measure)",
        "device_class": device_class,
        "train_dtype": "fp32",
    }
    placeholder_note = (
        "power and network are copied from the profile given with --like"
        if like
        else "power and network are unverified placeholders (profile measure cannot measure them): "
        "replace them with power-meter and link measurements, or pass --like <profile>"
    )
    raw["notes"] = " ".join(
        x
        for x in (
            f"Measured: {measured_by}.",
            "Compute numbers and the measured tables come from that run; "
            "efficiency, mem_bandwidth and launch_overhead are fitted to its per-layer times.",
            placeholder_note + ".",
            notes,
        )
        if x
    )
    raw["memory"] = {
        "train": _quantity(memory[0] / 1e9, "GB", f"measured: {memory[1]} at measurement time; {measured_by}", 3)
    }
    raw["compute"] = {
        "peak_fp32": _quantity(peak_flops[0] / 1e9, "GFLOP/s", f"measured: {peak_flops[1]}; {measured_by}")
    }
    if scalar_rate is not None:
        raw["compute"]["scalar_ops_per_s"] = _quantity(
            scalar_rate[0] / 1e9, "GOP/s", f"measured: {scalar_rate[1]}; {measured_by}"
        )
    apply_fit(raw, fit, f"fitted: {measured_by}", bandwidth=False)
    raw["compute"]["mem_bandwidth"] = _quantity(
        fit.mem_bandwidth / 1e9, "GB/s", f"fitted: {measured_by}: effective bandwidth ({', '.join(fit.models)})"
    )
    for section, keys in PLACEHOLDERS.items():
        if like and section in like:
            raw[section] = {k: dict(v) for k, v in like[section].items()}
            continue
        raw[section] = {
            key: _quantity(
                value,
                unit,
                f"unverified placeholder: fedelastic profile measure does not measure {section}; "
                "replace with a measurement of this device",
            )
            for key, (value, unit) in keys.items()
        }
    for key, (watts, how) in (power or {}).items():
        raw["power"][key] = _quantity(watts, "W", f"measured: {how}; {measured_by}")
    if like and "availability" in like:
        raw["availability"] = {k: dict(v) for k, v in like["availability"].items()}
    raw["measured"] = {model: measured_table_toml(t) for model, t in tables.items()}
    return raw


def _toml_value(value: Any) -> str:
    import tomli_w

    return tomli_w.dumps({"x": value}).split(" = ", 1)[1].rstrip("\n")


def _toml_key(key: str) -> str:
    import tomli_w

    return tomli_w.dumps({key: 0}).rsplit(" = ", 1)[0]


def _inline(table: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()) + " }"


def dumps_profile(raw: dict[str, Any]) -> str:
    """TOML text of a raw profile, in the layout of the shipped profiles.

    Quantities and layer rows are inline tables, one per line. The text is checked to parse back
    to ``raw`` exactly; if it would not, plain ``tomli_w.dumps`` output is returned instead.
    """
    import tomllib

    import tomli_w

    lines = []
    for key, value in raw.items():
        if not isinstance(value, dict):
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for section, table in raw.items():
        if not isinstance(table, dict) or section in ("measured", "kernels", "sampled"):
            continue
        lines += ["", f"[{_toml_key(section)}]"]
        lines += [f"{_toml_key(k)} = {_inline(v) if isinstance(v, dict) else _toml_value(v)}" for k, v in table.items()]
    for cls, table in raw.get("kernels", {}).items():
        lines += ["", f"[kernels.{_toml_key(cls)}]"]
        lines += [f"{_toml_key(k)} = {_inline(v)}" for k, v in table.items()]
    sampled = raw.get("sampled", {})
    if sampled:
        lines += ["", "[sampled]", f"source = {_toml_value(sampled['source'])}"]
        if "calibration" in sampled:
            lines.append(f"calibration = {_inline(sampled['calibration'])}")
    for cls, table in sampled.items():
        if isinstance(table, dict) and cls != "calibration":
            lines += ["", f"[sampled.{_toml_key(cls)}]"]
            lines += [f"{_toml_key(k)} = {_inline(v)}" for k, v in table.items()]
    for model, table in raw.get("measured", {}).items():
        lines += ["", f"[measured.{_toml_key(model)}]"]
        lines += [
            f"{_toml_key(k)} = {_inline(v) if isinstance(v, dict) else _toml_value(v)}"
            for k, v in table.items()
            if k != "layers"
        ]
        lines.append(f"[measured.{_toml_key(model)}.layers]")
        lines += [f"{_toml_key(k)} = {_inline(v)}" for k, v in table.get("layers", {}).items()]
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != raw:
        return tomli_w.dumps(raw)
    return text


def write_profile(raw: dict[str, Any], path: str | Path) -> DeviceProfile:
    """Validate ``raw`` as the profile file ``path`` (name = file stem), write it, and load it back."""
    from ..devices.profile import load_profile

    path = Path(path)
    parse_profile(raw, str(path), stem=path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_profile(raw))
    return load_profile(path)


def set_measured_table(raw: dict[str, Any], model: str, table: Any) -> dict[str, Any]:
    """Put ``table`` in ``raw`` as ``[measured.<model>]``, replacing any table of that model."""
    raw.setdefault("measured", {})[model] = measured_table_toml(table)
    return raw


def measured_by(threads: int, clock: str = "wall", date: str | None = None) -> str:
    """The provenance prefix of every number ``profile measure`` writes."""
    import torch

    day = date or datetime.date.today().isoformat()
    extra = "" if clock == "wall" else f", {clock} clock"
    return f"fedelastic profile measure on {host_description()}, {day}, torch {torch.__version__}, {threads} threads{extra}"


def fit_kernels_into(
    raw: dict[str, Any], pairs: Sequence[tuple[ModelInfo, Any]], src: str, source: str, max_bandwidth: float | None
) -> None:
    """Fit the kernel classes (:func:`fedelastic.profiling.roofline_fit.fit_kernels`) and write ``[kernels]``,
    ``[uncertainty]`` and ``schema_version = 2`` into ``raw``."""
    from .roofline_fit import fit_kernels, kernels_toml

    device = parse_profile(raw, src)
    fit = fit_kernels(pairs, device, max_bandwidth=max_bandwidth or device.mem_bandwidth_bytes_per_s.value)
    raw["schema_version"] = 2
    raw.update(kernels_toml(fit, device, source))
