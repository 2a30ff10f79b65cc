"""The runtime patches of Flower and Ray: one switch turns them all off, and an untested version runs Flower's own code."""

import logging
import warnings

import pytest

from fedelastic.runtime import backend, patches
from fedelastic.runtime.dispatch import fast_dispatch


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(patches.ENV, raising=False)
    monkeypatch.setattr(patches, "_warned", set())
    patches.configure(True)
    yield
    patches.configure(True)


def _patched_names() -> tuple:
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    with fast_dispatch(), backend.resilient_actors(retries=1, timeout_s=1.0, stop=backend._SETTINGS.stop):
        return vce_api.add_messages_to_queue, vce_api.Queue, RayBackend.process_message, RayBackend.build


def test_the_pins_are_the_installed_versions():
    from importlib import metadata

    assert {p: metadata.version(p) for p in patches.TESTED} == patches.TESTED


def test_patches_apply_on_the_tested_versions_and_are_undone_after():
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    before = (vce_api.add_messages_to_queue, vce_api.Queue, RayBackend.process_message, RayBackend.build)
    inside = _patched_names()
    assert all(a is not b for a, b in zip(inside, before, strict=True))
    assert (vce_api.add_messages_to_queue, vce_api.Queue, RayBackend.process_message, RayBackend.build) == before


@pytest.mark.parametrize("how", ["env", "key"])
def test_one_switch_leaves_flowers_own_code_in_place(monkeypatch, how):
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    if how == "env":
        monkeypatch.setenv(patches.ENV, "0")
    else:
        patches.configure(False)  # what start_ray does with simulation.patches = false
    before = (vce_api.add_messages_to_queue, vce_api.Queue, RayBackend.process_message, RayBackend.build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning
        assert _patched_names() == before
    assert not patches.active("flwr") and not patches.active("ray")


def test_an_untested_version_runs_flowers_code_and_says_so_once(monkeypatch):
    from flwr.server.superlink.fleet.vce import vce_api

    monkeypatch.setitem(patches.TESTED, "flwr", "0.0.1")
    before = vce_api.add_messages_to_queue
    with pytest.warns(patches.UntestedVersionWarning, match=r"flwr 1\.42\.0 is not the tested 0\.0\.1") as seen:
        assert _patched_names()[0] is before
        _patched_names()
    assert len([w for w in seen if issubclass(w.category, patches.UntestedVersionWarning)]) == 1
    assert patches.active("ray")  # Ray's version is still the tested one


def test_every_patch_names_its_target_and_why():
    assert {p.package for p in patches.PATCHES} == {"flwr", "ray"}
    assert all(p.target and p.where and len(p.works_around) > 20 for p in patches.PATCHES)


def test_the_run_simulation_banner_is_dropped_and_other_flower_warnings_pass(caplog):
    from flwr.supercore.logger import warn_deprecated_feature

    from fedelastic.fl.runner import _flwr_quiet

    logger = logging.getLogger("flwr")
    logger.addHandler(caplog.handler)
    try:
        with _flwr_quiet():
            warn_deprecated_feature("The `run_simulation` function is deprecated and will be removed")
            warn_deprecated_feature("Something else is deprecated")
    finally:
        logger.removeHandler(caplog.handler)
    text = caplog.text
    assert "Something else is deprecated" in text and "run_simulation" not in text
