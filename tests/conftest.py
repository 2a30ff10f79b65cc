"""Shared fixtures: small scenarios and a writable copy of a profile (plain helpers: tests/support.py)."""

from __future__ import annotations

import os
import tomllib

# Flower's telemetry is off in the suite (read once, when flwr is imported): the tests send nothing
# out, and its event thread runs `file -b python` (platform.architecture), a child process that the
# tests listing a run's leftover processes would otherwise catch alive (seen in CI, 2026-11-29)
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import pytest  # noqa: E402

from fedelastic.devices.profile import builtin_profile_dir
from fedelastic.scenario import parse_scenario
from tests.support import small_scenario_dict


@pytest.fixture(scope="session", autouse=True)
def _temporary_cache(tmp_path_factory):
    """The suite's pretrained weights and generated data go to a temporary folder, not the user's
    ~/.cache/fedelastic (about 100 MB otherwise); an explicit ``FEDELASTIC_CACHE`` is kept. Set
    before any test runs: subprocesses and Ray workers inherit it."""
    if "FEDELASTIC_CACHE" in os.environ:
        yield
        return
    os.environ["FEDELASTIC_CACHE"] = str(tmp_path_factory.mktemp("fedelastic-cache"))
    try:
        yield
    finally:
        os.environ.pop("FEDELASTIC_CACHE", None)


@pytest.fixture
def make_scenario(tmp_path):
    def make(**overrides):
        return parse_scenario(small_scenario_dict(tmp_path, **overrides), src=str(tmp_path / "tiny.toml"))

    return make


@pytest.fixture
def profile_raw() -> dict:
    return tomllib.loads((builtin_profile_dir() / "jetson_nano.toml").read_text())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``ray`` run one after another on one pytest-xdist worker (``--dist loadgroup``:
    each starts its own Ray cluster, and two at once would fight over one machine's cores and ports);
    tests marked ``patched`` check what fedelastic's runtime patches do: skipped when they are off."""
    from fedelastic.runtime.patches import switched_on

    for item in items:
        if "ray" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("ray"))
    if switched_on():
        return
    skip = pytest.mark.skip(reason="checks a runtime patch, and FEDELASTIC_PATCHES turns them off")
    for item in items:
        if "patched" in item.keywords:
            item.add_marker(skip)
