"""Shared fixtures: small scenarios and a writable copy of a profile."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedelastic.devices import builtin_profile_dir
from fedelastic.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def small_scenario_dict(tmp_path: Path, **overrides) -> dict:
    raw = {
        "name": "tiny",
        "seed": 3,
        "output_dir": str(tmp_path / "runs"),
        "fleet": {"raspberry_pi_4": 2, "jetson_nano": 1, "stm32h743": 1},
        "data": {"partitioner": "dirichlet", "alpha": 0.5},
        "model": {"name": "small_cnn", "options": {"width": 8}},
        "train": {"strategy": "full", "batch_size": 16, "max_steps": 3},
        "server": {"rounds": 2},
        "simulation": {"backend": "inprocess"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


@pytest.fixture
def make_scenario(tmp_path):
    def make(**overrides):
        return parse_scenario(small_scenario_dict(tmp_path, **overrides), src=str(tmp_path / "tiny.toml"))

    return make


@pytest.fixture
def profile_raw() -> dict:
    return tomllib.loads((builtin_profile_dir() / "jetson_nano.toml").read_text())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``patched`` check what fedelastic's runtime patches do: skipped when they are off."""
    from fedelastic.runtime.patches import switched_on

    if switched_on():
        return
    skip = pytest.mark.skip(reason="checks a runtime patch, and FEDELASTIC_PATCHES turns them off")
    for item in items:
        if "patched" in item.keywords:
            item.add_marker(skip)
