"""Property-based fuzzing of the scenario and profile loaders (hypothesis).

Whatever a TOML file holds (values of the wrong type, NaN/inf, huge numbers, empty tables,
unknown or missing keys), a loader either returns a valid object or raises ConfigError.
"""

from __future__ import annotations

import copy
import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedelastic.devices.profile import DeviceProfile, parse_profile
from fedelastic.errors import ConfigError
from fedelastic.scenario import Scenario, parse_scenario
from tests.support import small_scenario_dict

# every value a TOML document can hold, with the nasty corners weighted in
scalars = st.one_of(
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300, -0.0, 5e-324]),
    st.text(max_size=12),
    st.sampled_from(["", "full", "digits", "../x", "[/oops]", "os:getcwd", "a.toml", "KiB", "GFLOP/s"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


def _paths(cls, prefix=()) -> list[tuple[str, ...]]:
    """Every dotted key of a config dataclass."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        out.append(path)
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            out.extend(_paths(inner[0], path))
    return out


SCENARIO_KEYS = [p for p in _paths(Scenario) if p != ("source",)] + [("train", "options", "rho"), ("fleet", "x")]


def _mutate(raw: dict, path: tuple[str, ...], value, delete: bool) -> dict:
    raw = copy.deepcopy(raw)
    table = raw
    for part in path[:-1]:
        if not isinstance(table.get(part), dict):
            table[part] = {}
        table = table[part]
    if delete:
        table.pop(path[-1], None)
    else:
        table[path[-1]] = value
    return raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(st.tuples(st.sampled_from(SCENARIO_KEYS), values, st.booleans()), min_size=1, max_size=3),
)
def test_scenario_loader_returns_a_scenario_or_raises_config_error(tmp_path, edits):
    raw = small_scenario_dict(tmp_path)
    for path, value, delete in edits:
        raw = _mutate(raw, path, value, delete)
    try:
        scenario = parse_scenario(raw, "fuzz.toml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz.toml: key ") and "\n" not in str(exc)
        return
    assert isinstance(scenario, Scenario)


def _profile_paths(raw: dict, prefix=()) -> list[tuple[str, ...]]:
    out = []
    for key, value in raw.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out.extend(_profile_paths(value, (*prefix, key)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_profile_loader_returns_a_profile_or_raises_config_error(profile_raw, data):
    raw = copy.deepcopy(profile_raw)
    raw["measured"] = {"small_cnn": {"batch_size": 4, "source": "x", "layers": {"conv": {"fwd": 1e-3, "dx": 0.0, "dw": 0.0}}}}
    keys = _profile_paths(raw) + [("availability", "probability"), ("measured", "small_cnn", "unattributed_fwd")]
    for _ in range(data.draw(st.integers(1, 3))):
        raw = _mutate(raw, data.draw(st.sampled_from(keys)), data.draw(values), data.draw(st.booleans()))
    try:
        profile = parse_profile(raw, "dev.toml")
    except ConfigError as exc:
        assert str(exc).startswith("dev.toml: key ")
        return
    assert isinstance(profile, DeviceProfile)
    for f in dataclasses.fields(profile):  # every number the loader accepts is finite
        q = getattr(profile, f.name)
        if hasattr(q, "value"):
            assert q.value == q.value and abs(q.value) < float("inf")


@pytest.mark.parametrize("big", [-(2**63) - 1, 2**1100])  # past int64, past float
def test_an_int_past_floats_range_is_a_config_error_not_a_type_error(profile_raw, big):
    """Found by the fuzz test above: np.isfinite raised TypeError on such ints (TOML allows 64-bit ones)."""
    raw = copy.deepcopy(profile_raw)
    raw["measured"] = {"small_cnn": {"batch_size": 4, "source": "x", "layers": {"conv": {"fwd": big, "dx": 0.0, "dw": 0.0}}}}
    with pytest.raises(ConfigError, match="dev.toml: key .measured.small_cnn"):
        parse_profile(raw, "dev.toml")
    raw = copy.deepcopy(profile_raw)
    raw["compute"]["peak_fp32"]["value"] = big
    with pytest.raises(ConfigError, match="dev.toml: key .compute.peak_fp32"):
        parse_profile(raw, "dev.toml")
