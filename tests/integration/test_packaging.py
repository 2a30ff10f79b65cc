"""The strategies/ and device_profiles/ folders install as fedelastic.strategies and fedelastic.device_profiles.

These tests run Python without ``site`` (so the development install's editable finder is not
loaded), with this environment's site-packages on PYTHONPATH for numpy and friends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from tests.support import ROOT

PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys
    import fedelastic
    from fedelastic.devices.profile import builtin_profile_dir, get_profile
    from fedelastic.selection.strategy import REGISTRY, available
    names = available()
    print(json.dumps({
        "fedelastic": fedelastic.__file__,
        "strategies": sorted({REGISTRY[n].__module__.rsplit(".", 1)[0] for n in names}),
        "names": names,
        "profiles": str(builtin_profile_dir()),
        "nano": get_profile("jetson_nano").name,
        "top_level": [m for m in ("strategies", "device_profiles") if importlib.util.find_spec(m)],
    }))
    """
)

THIRD_PARTY = """
import numpy as np
from fedelastic.selection.strategy import Selection, SelectionStrategy, register


@register
class Mine(SelectionStrategy):
    name = "third_party_mine"

    def select(self, ctx):
        return Selection.from_mask(np.ones(ctx.info.num_tensors))
"""


def _probe(path: list[Path], cwd: Path) -> dict:
    site_packages = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), site_packages])}
    out = subprocess.run(
        [sys.executable, "-S", "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_source_tree_that_is_not_installed_finds_its_strategies_and_profiles(tmp_path):
    """What a Flower app bundle holds: the three folders side by side, nothing installed."""
    tree = tmp_path / "tree"
    for folder in ("fedelastic", "strategies", "device_profiles"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    got = _probe([tree], tmp_path)
    assert got["fedelastic"] == str(tree / "fedelastic" / "__init__.py")
    assert got["strategies"] == ["strategies"] and len(got["names"]) >= 9
    assert got["profiles"] == str(tree / "device_profiles") and got["nano"] == "jetson_nano"


@pytest.mark.slow
def test_installed_package_has_both_names_and_the_entry_point_group(tmp_path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the repository
    for folder in ("fedelastic", "strategies", "device_profiles"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, source / file)
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    build = subprocess.run(
        [*pip, "--target", str(target), str(source)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert build.returncode == 0, build.stderr
    # a third-party package that registers a strategy through the entry point group
    plugin = tmp_path / "plugin"
    (plugin / "third_party_mine-0.1.dist-info").mkdir(parents=True)
    (plugin / "third_party_mine.py").write_text(THIRD_PARTY)
    (plugin / "third_party_mine-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: third-party-mine\nVersion: 0.1\n"
    )
    (plugin / "third_party_mine-0.1.dist-info" / "entry_points.txt").write_text(
        "[fedelastic.strategies]\nmine = third_party_mine\n"
    )

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    got = _probe([target, plugin], outside)
    assert got["fedelastic"] == str(target / "fedelastic" / "__init__.py")
    assert "fedelastic.strategies" in got["strategies"] and "third_party_mine" in got["strategies"]
    assert {"full", "elastic_tensor", "tinytrain", "third_party_mine"} <= set(got["names"])
    assert got["profiles"] == str(target / "fedelastic" / "device_profiles") and got["nano"] == "jetson_nano"
    assert len(list(Path(got["profiles"]).glob("*.toml"))) == len(list((ROOT / "device_profiles").glob("*.toml")))
    assert got["top_level"] == []  # no top-level `strategies` / `device_profiles` any more
    assert not (target / "strategies").exists() and not (target / "device_profiles").exists()


def test_old_top_level_imports_in_a_source_tree_do_not_clash_with_the_installed_names():
    # from the repository root, `strategies` is the folder itself; fedelastic then imports the
    # same modules as fedelastic.strategies: each class registers once, under either name
    code = (
        "from strategies.tinytrain import layer_scores\n"
        "from fedelastic.selection.strategy import REGISTRY, available, make_strategy\n"
        "assert 'tinytrain' in available()\n"
        "make_strategy('tinytrain')\n"
        "print(REGISTRY['full'].__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("strategies.full", "fedelastic.strategies.full")
