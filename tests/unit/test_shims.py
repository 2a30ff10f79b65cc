"""The old import paths of issue 39's restructure stay for one release: each warns, naming the new
path, and gives the very objects of the new modules; nothing in the repository imports them.

``old_public_names.json`` was written by the restructure script (``benchmarks/restructure/apply.py``,
in git history at ``096592f``) from the old modules' source before they moved: every public name
each defined, and the modules it went to.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
import warnings

import pytest

from tests.support import ROOT

OLD = json.loads((ROOT / "tests" / "unit" / "old_public_names.json").read_text())


def _source(module: str):
    parts = module.split(".")
    package = ROOT.joinpath(*parts, "__init__.py")
    return package if package.exists() else ROOT.joinpath(*parts[:-1], parts[-1] + ".py")


def _forwards_whole_module(module: str) -> bool:
    return "forward(__name__" in _source(module).read_text()


@pytest.mark.parametrize("old", sorted(OLD))
def test_an_old_path_warns_and_gives_the_new_objects(old, monkeypatch):
    if _forwards_whole_module(old):  # it warns when imported: import it afresh
        monkeypatch.delitem(sys.modules, old, raising=False)
    new = [importlib.import_module(m) for m in OLD[old]["new"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        for name in OLD[old]["names"]:
            home = [m for m in new if name in vars(m)]
            assert home, f"{old}.{name} is in none of {OLD[old]['new']}"
            assert getattr(module, name) is getattr(home[0], name), f"{old}.{name}"
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(old in text and any(m in text for m in OLD[old]["new"]) for text in said), said
    if _forwards_whole_module(old):
        assert module is new[0]  # a patch through the old path patches the real module


def _imports(path):
    """(module, names) of every import in ``path``, relative ones made absolute."""
    package = list(path.relative_to(ROOT).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            yield ".".join([*base, node.module or ""]).strip("."), [a.name for a in node.names]


def test_nothing_in_the_repository_imports_an_old_path():
    files = [p for d in ("fedelastic", "strategies", "tests", "benchmarks", "simulations") for p in (ROOT / d).rglob("*.py")]
    wrong = []
    for path in sorted(files):
        if path.name == "_shim.py" or ".venv" in path.parts:
            continue
        for module, names in _imports(path):
            if module in OLD and _source(module).exists():
                text = _source(module).read_text()
                defined = {n for node in ast.parse(text).body for n in _defined(node)}
                folder = _source(module).parent if _source(module).name == "__init__.py" else None
                for name in names or [""]:
                    inside = name in defined or (folder is not None and (folder / f"{name}.py").exists())
                    if not inside and not (module == "fedelastic.sim.fleet" and not names):
                        wrong.append(f"{path.relative_to(ROOT)}: {module} {name}".strip())
    assert wrong == [], "import the new paths: " + "; ".join(wrong)


def _defined(node):
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name) and t.id != "__getattr__"]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []
