"""fedelastic's import graph: no cycle between its modules, and the runtime patches of Flower and Ray
(``fedelastic.runtime``) imported only by the adapters (``fedelastic.fl``) and by the runtime itself,
and the entry points (command line, Python API, Flower App, run path) imported by nothing below them.

Every import counts as an edge (``docgen.import_graph``): at the top of a module, inside a
function, or under ``TYPE_CHECKING``. There is no list of allowed exceptions: a lazy import that
closes a cycle only waits for the call that runs it, and a type-only one ties the modules'
interfaces together all the same. The graph reader is checked on hand-made packages first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedelastic import docgen
from tests.support import ROOT

ADAPTERS = ("fedelastic.fl",)  # the only packages outside fedelastic.runtime that may import it


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_reader_sees_every_kind_of_import(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "a.py": "from . import b\nimport os\n",
            "b.py": "def f():\n    from .sub import c\n",
            "sub/__init__.py": "from .c import X\n",
            "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import Y\nX = 1\n",
            "d.py": "import pkg.sub.c\nfrom pkg import a as _a\nfrom .missing import z\n",
        },
    )
    assert docgen.import_graph(pkg) == {  # worked out by hand from the five files
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": {"pkg.sub.c"},
        "pkg.sub.c": {"pkg.a"},
        "pkg.d": {"pkg.sub.c", "pkg.a", "pkg"},
    }


def test_a_cycle_through_a_lazy_or_type_only_import_is_found(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "a.py": "from . import b\n",
            "b.py": "def f():\n    from . import c\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
            "d.py": "from . import a\n",
        },
    )
    assert docgen.import_cycles(docgen.import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert docgen.import_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert docgen.import_cycles({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p"}}) == [["p", "q"], ["x", "y"]]


def test_a_relative_import_above_the_package_is_refused(tmp_path):
    pkg = _package(tmp_path, {"a.py": "def f():\n    from ..b import c\n"})  # pkg/a.py: ".." leaves pkg
    with pytest.raises(ValueError, match=r"a\.py:2: a relative import climbs above the package pkg"):
        docgen.import_graph(pkg)
    assert docgen.import_graph(_package(tmp_path / "ok", {"s/a.py": "from ..b import c\n", "b.py": ""}))["pkg.s.a"] == {"pkg.b"}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return docgen.import_graph(ROOT / "fedelastic")


def test_fedelastic_has_no_import_cycle(graph):
    assert len(graph) > 80  # every module was read (90 in November 2026)
    assert docgen.import_cycles(graph) == []


def test_only_the_adapters_import_the_runtime(graph):
    def inside(module: str, packages: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    wrong = sorted(
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if inside(target, ("fedelastic.runtime",)) and not inside(source, ("fedelastic.runtime", *ADAPTERS))
    )
    assert wrong == []
    assert any(inside(t, ("fedelastic.runtime",)) for t in graph["fedelastic.fl.rayrun"])  # the check sees imports


ENTRY_POINTS = ("fedelastic.cli", "fedelastic.api", "fedelastic.app", "fedelastic.orchestrate")  # the top level


def test_nothing_below_the_entry_points_imports_them(graph):
    """The command line, the Python API, the Flower App and the run path are the top of the graph: a
    module under them that imported one would point upward (``__init__``'s lazy table is no import)."""
    wrong = sorted(
        (source, target)
        for source, targets in graph.items()
        for target in targets & set(ENTRY_POINTS)
        if source not in ENTRY_POINTS
    )
    assert wrong == []
    assert "fedelastic.orchestrate" in graph["fedelastic.api"]  # the check sees the entry points' own imports


def test_no_subpackage_hides_a_name_of_the_lazy_api():
    """Importing ``fedelastic.x`` sets the attribute ``x`` of ``fedelastic``, which then wins over the
    lazy ``__getattr__``: a subpackage named ``compare`` would turn ``fe.compare`` into a module."""
    import fedelastic

    subpackages = {p.name for p in (ROOT / "fedelastic").iterdir() if (p / "__init__.py").exists()}
    assert {"sim", "fl", "runtime"} <= subpackages  # the folders were read
    assert sorted(subpackages & set(fedelastic._API)) == []
