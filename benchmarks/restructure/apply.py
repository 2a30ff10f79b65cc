"""Issue 39 section 4: group fedelastic's flat modules into subpackages, in one deterministic step.

    python benchmarks/restructure/apply.py            # at the root of a clean checkout of main
    python benchmarks/restructure/apply.py --check    # say what would move; change nothing

What it does, in order (README.md beside this file explains every placement):

1. checks the tree: every module of :data:`MOVES` and :data:`SPLITS` exists, every flat module of
   ``fedelastic/`` is either moved or listed in :data:`ROOT`, the section banners and functions of
   the split modules are where :data:`SPLITS` says (it stops with a message naming what does not
   match; a tree already restructured is reported and left alone);
2. makes ``fedelastic/``'s relative imports absolute (marked), so files can move;
3. splits ``sim/fleet.py`` along its banners and ``continual.py`` into pure metrics and IO, and
   ``git mv``-es every other module; regroups ``tests/unit/`` (:data:`TESTS`);
4. rewrites every import and dotted or path mention of a moved module in ``fedelastic/``,
   ``strategies/``, ``tests/``, ``benchmarks/``, ``simulations/``, ``docs/``, ``device_profiles/``,
   ``README.md`` and ``pyproject.toml``; makes the marked imports relative again from their new place;
5. leaves a shim at every old path (``fedelastic/_shim.py``: a ``DeprecationWarning`` naming the new
   path), writes the old public names for ``tests/unit/test_shims.py``, installs the layout section of
   ``docs/explanation/how-a-run-works.md``, sorts the changed imports (``ruff --select I --fix``) and
   regenerates the generated docs (``python -m fedelastic.docgen``).

Only ``git``, ``ruff`` and this interpreter are used; the result does not depend on the order files
are listed in, so two runs on the same tree give the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = HERE / "files"

# ---- the map: old module -> new module (dotted, under fedelastic) --------------------------------

MOVES: dict[str, str] = {
    # devices/: what a device is (a profile, the kernel predictors it holds, units)
    "devices": "devices.profile",
    "units": "devices.units",
    "kernelsample": "devices.kernelsample",
    "clocks": "devices.clocks",
    # profiling/: measuring a device and writing its profile (above cost/: the fit prices with the cost model)
    "measure": "profiling.measure",
    "trace": "profiling.chrome_trace",
    "fit": "profiling.roofline_fit",
    "profiles": "profiling.writer",
    "profiler": "profiling.commands",
    # cost/: what a selection costs on a device
    "costmodel": "cost.costmodel",
    "kernels": "cost.kernels",
    "bands": "cost.bands",
    # selection/: choosing what to train
    "selection": "selection.strategy",
    "selector": "selection.budgeted",

    # train/: training a model for real
    "training": "train.trainer",
    "vectorized": "train.vectorized",
    "optim": "train.optim",
    "quant": "train.quant",
    "probes": "train.probes",
    "pretrain": "train.pretrain",
    "evaluation": "train.evaluation",
    "contribution": "train.contribution",
    # results/: what a run writes and how it is read back
    "results": "results.recorder",
    "tables": "results.tables",
    "runstatus": "results.status",
    "summary": "results.summary",
    "plots": "results.plots",
    "idle": "results.idle",
    "seedstats": "results.seedstats",
    # comparisons/: comparisons and the HTML report (which draws on their statistics); not `compare/`,
    # which would shadow the API's `fedelastic.compare` once imported
    "comparison": "comparisons.comparison",
    "report": "comparisons.report",
    # into existing packages
    "divergence": "sim.divergence",
    "flower": "fl.your_app",
}

#: flat modules that stay at the root: ground modules and entry points
ROOT = (
    "__init__", "api", "app", "cli", "orchestrate", "signals",  # entry points
    "config", "errors", "scenario", "plugins", "modelinfo", "environment",  # ground and the run's assembly
    "testing", "docgen",  # tools: the strategy contract for users' tests, the generated docs
)

PACKAGES: dict[str, str] = {  # new package -> its docstring
    "devices": "What a device is: its profile (schema, loading, the registry, fleet assignment), the sampled kernel "
    "predictors\na profile holds, and units.",
    "profiling": "Making a device's profile: measuring layers and kernels on this host, importing Chrome traces, "
    "fitting\nthe roofline, writing the TOML, and the ``fedelastic profile`` commands.",
    "cost": "The cost model: the emulated time, memory, energy and communication of a selection on a device.",
    "selection": "Choosing what a client trains: the strategy interface and registry, and the budgeted selectors "
    "(pure numpy;\nthe strategy contract is :mod:`fedelastic.testing`).",
    "train": "Training for real: the local trainer, vectorised cohorts, optimizers, device numerics, probes, "
    "pretraining,\nevaluation, and Sparse Update's contribution analysis (it trains).",
    "results": "What a run writes and how it is read back: the recorder, tables, status, summary, plots, "
    "idle analysis, continual metrics and statistics over seeds.",
    "comparisons": "Comparisons over strategies x fleets x seeds, and the HTML report of a run or a comparison.",
}

#: split modules: old module -> (new module -> docstring, how each top-level name is placed)
SPLITS: dict[str, dict] = {
    "sim.fleet": {
        "banners": {  # a `# ---- <title> ----` banner -> the module its section goes to
            "deadline budgets": "sim.deadline",
            "availability": "sim.availability",
            "battery": "sim.battery",
            "network": "sim.network",
            "a run's fleet": "sim.fleet",
        },
        "names": {  # these go elsewhere than their banner says: the trace files and the FedScale importer
            "TRACE_AVAILABILITY_COLUMNS": "sim.traces",
            "TRACE_NETWORK_COLUMNS": "sim.traces",
            "_read_table": "sim.traces",
            "load_availability_trace": "sim.traces",
            "fedscale_windows": "sim.traces",
            "import_fedscale_availability": "sim.traces",
            "load_network_trace": "sim.traces",
        },
        "docs": {
            "sim.deadline": "Deadline budgets, pure numpy: a client with ``steps`` local steps, a full-training step time "
            "``T``,\na probe overhead ``P`` and a communication time ``C`` finishes full training in "
            "``C + P + steps * T``.\nUnder a deadline ``D`` it gets ``rho = (D - C - P) / (steps * T)`` (at most 1), "
            "or, without elastic\nselection, ``floor((D - C) / T)`` steps.",
            "sim.availability": "Availability, pure numpy: each client is online during intervals of the simulated "
            "clock, generated\nsessions (exponential on/off, optionally diurnal) or a trace file. A client is asked "
            "whether it is\nonline at ``t`` and when it next goes offline, as FedScale's ``is_active(t)`` does.",
            "sim.battery": "Batteries, pure numpy: each client's charge on the simulated clock.",
            "sim.network": "Network, pure numpy: each client's uplink and downlink are its profile's nominal figures "
            "times a\nfactor drawn from a named distribution, or figures read from a trace file.",
            "sim.fleet": "A run's fleet, pure numpy: who is online and charged, each client's links and full-training "
            "times,\nbuilt from the deadline budgets (:mod:`~fedelastic.sim.deadline`), availability "
            "(:mod:`~fedelastic.sim.availability`),\nbatteries (:mod:`~fedelastic.sim.battery`), links "
            "(:mod:`~fedelastic.sim.network`) and trace files (:mod:`~fedelastic.sim.traces`).",
            "sim.traces": "Trace files of the fleet: availability windows and link rates per client, read and checked, "
            "and\nFedScale's client availability traces imported into the availability format.",
        },
    },
    "continual": {
        "io": {  # to results.continual; every other name is a pure metric (results.continual_metrics)
            "StreamSource", "_warned", "evaluate_tasks", "evaluate_stream", "load", "report",
            "_recover_share", "_clean", "plot_tasks",
        },
        "pure": "results.continual_metrics",
        "rest": "results.continual",
        "docs": {
            "results.continual": "A run's continual-learning figures evaluated and written: the accuracy matrix "
            "evaluated on the\nstream's tasks (torch), ``continual.json`` and ``tasks_vs_time.png`` "
            "(:func:`report`). The metrics\nthemselves are pure: :mod:`fedelastic.results.continual_metrics`.",
        },
        "keep_docstring": "results.continual_metrics",
        "docstring_edit": (  # the glue this sentence names is now the other module
            "The metric functions are pure numpy; :func:`evaluate_tasks` (torch) and :func:`report` (files)\nare the glue.",
            "These functions are pure numpy (the ``tasks`` table: pandas); evaluating the tasks (torch) and writing\n"
            "``continual.json`` and the figure (files) are :mod:`fedelastic.results.continual`.",
        ),
        "pure_imports": {"numpy", "math", "__future__", "typing", "collections", "dataclasses", "json"},
    },
}

#: tests/unit/<file> -> the folder of tests/unit/ it moves to (the package it tests)
TESTS: dict[str, str] = {
    "test_compare.py": "comparisons", "test_compare_controls.py": "comparisons", "test_compare_stats.py": "comparisons",
    "test_report.py": "comparisons",
    "test_continual.py": "results", "test_idle.py": "results", "test_results_append.py": "results",
    "test_costmodel.py": "cost", "test_kernels.py": "cost",
    "test_kernelsample.py": "devices", "test_profiler.py": "profiling", "test_trace.py": "profiling",
    "test_selector.py": "selection", "test_empty_selection.py": "train",
    "test_optim.py": "train", "test_pretrain.py": "train", "test_quant.py": "train", "test_vectorized.py": "train",
    "test_host_threads.py": "train", "test_imagenet_weights.py": "train",
    "test_divergence.py": "sim",
    "test_flower_reuse.py": "fl",
}

TEXT_DIRS = ("fedelastic", "strategies", "tests", "benchmarks", "simulations", "docs")
TEXT_FILES = ("README.md", "pyproject.toml")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".json", ".html"}
# this tool names the old paths on purpose; recorded results keep the provenance they were written with
SKIP = ("benchmarks/restructure/", "benchmarks/results/")
MARK = "  # restructure:relative"
FUTURE = "from __future__ import annotations\n"
LAYOUT_HEADING = "## Where things are"


class Mismatch(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"apply.py: the tree does not match the map, nothing was changed:\n  {message}")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def full(name: str) -> str:
    return f"fedelastic.{name}"


def path_of(name: str, package: bool = False) -> Path:
    parts = name.split(".")
    return Path("fedelastic", *parts, "__init__.py") if package else Path("fedelastic", *parts[:-1], parts[-1] + ".py")


# ---- 1. check the tree ----------------------------------------------------------------------------


def banner_of(line: str) -> str | None:
    m = re.match(r"# -{3,} (.+?) -{3,}\s*$", line)
    return m.group(1) if m else None


def top_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def is_header(node: ast.stmt) -> bool:
    """Docstring, imports and ``if TYPE_CHECKING:`` blocks of imports."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return True
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        and all(isinstance(n, ast.Import | ast.ImportFrom) for n in node.body)
    )


def placement(old: str, text: str) -> dict[str, str]:
    """Each top-level name of split module ``old`` -> its new module; raises Mismatch if the source
    no longer has the banners or names the map expects."""
    spec = SPLITS[old]
    tree = ast.parse(text)
    lines = text.splitlines()
    out: dict[str, str] = {}
    if "banners" in spec:
        seen = [b for b in (banner_of(line) for line in lines) if b]
        if seen != list(spec["banners"]):
            raise Mismatch(f"fedelastic/{old.replace('.', '/')}.py: banners {seen}, expected {list(spec['banners'])}")
        section = None
        for node in tree.body:
            for line in lines[: node.lineno - 1][::-1]:
                if banner_of(line):
                    section = spec["banners"][banner_of(line)]
                    break
            if is_header(node):
                continue
            if section is None:
                raise Mismatch(f"fedelastic/{old}.py:{node.lineno}: code before the first banner")
            for name in top_names(node) or [f"<line {node.lineno}>"]:
                out[name] = spec["names"].get(name, section)
        missing = set(spec["names"]) - set(out)
    else:
        for node in tree.body:
            if not is_header(node):
                for name in top_names(node) or [f"<line {node.lineno}>"]:
                    out[name] = spec["rest"] if name in spec["io"] else spec["pure"]
        missing = set(spec["io"]) - set(out)
    if missing:
        raise Mismatch(f"fedelastic/{old.replace('.', '/')}.py no longer defines {sorted(missing)}")
    return out


def check_tree(root: Path) -> str:
    """'fresh', or 'applied' (already restructured); raises Mismatch otherwise."""
    flat = sorted(p.stem for p in (root / "fedelastic").glob("*.py"))
    if (root / "fedelastic" / "cost" / "costmodel.py").exists():
        return "applied"
    missing = [m for m in [*MOVES, *SPLITS] if not (root / path_of(m)).exists()]
    if missing:
        raise Mismatch(f"modules not found: {missing}")
    unmapped = [m for m in flat if m not in MOVES and m not in ROOT and m not in SPLITS]
    if unmapped:
        raise Mismatch(f"flat modules the map does not place (add them to MOVES or ROOT): {unmapped}")
    taken = [p for p in (path_of(new) for new in MOVES.values()) if (root / p).exists()]
    taken += [t for t, f in TESTS.items() if not (root / "tests" / "unit" / t).exists()]
    if taken:
        raise Mismatch(f"destinations already present or tests missing: {taken}")
    for old in SPLITS:
        placement(old, (root / path_of(old)).read_text())
    api = next(
        (n.value for n in ast.parse((root / "fedelastic" / "__init__.py").read_text()).body
         if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_API" for t in n.targets)),
        None,
    )
    if not isinstance(api, ast.Dict):
        raise Mismatch("fedelastic/__init__.py: no `_API = {...}` table of the lazy API")
    clash = sorted({k.value for k in api.keys if isinstance(k, ast.Constant)} & set(PACKAGES))
    if clash:  # an imported subpackage becomes an attribute of fedelastic and hides the API's name
        raise Mismatch(f"new packages named like the API's {clash} (fedelastic/__init__.py _API)")
    for package in ("devices", "results", "selection"):  # a package takes the old module's name
        text = (root / "fedelastic" / f"{package}.py").read_text()
        names = {n for node in ast.parse(text).body for n in top_names(node)}
        submodules = {new.split(".")[1] for new in MOVES.values() if new.startswith(package + ".")}
        if names & submodules:
            raise Mismatch(f"fedelastic/{package}.py defines {sorted(names & submodules)}, the name of a new submodule")
    return "fresh"


# ---- 2. relative imports made absolute, and back ---------------------------------------------------


def package_of(path: Path) -> list[str]:
    return list(path.parent.parts)


def absolute(node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    here = package_of(path)
    return ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))


def relative(target: str, path: Path) -> str:
    here = package_of(path)
    parts = target.split(".")
    common = 0
    while common < min(len(here), len(parts)) and here[common] == parts[common]:
        common += 1
    return "." * (len(here) - common + 1) + ".".join(parts[common:])


def statement(module: str, aliases: list[tuple[str, str | None]], indent: str) -> str:
    names = ", ".join(f"{n} as {a}" if a else n for n, a in aliases)
    line = f"{indent}from {module} import {names}"
    if len(line) <= 120:
        return line
    inner = "".join(f"{indent}    {n} as {a},\n" if a else f"{indent}    {n},\n" for n, a in aliases)
    return f"{indent}from {module} import (\n{inner}{indent})"


def with_comment(statement: str, comment: str) -> str:
    """``statement`` with ``comment`` on its first line (after the parenthesis of a long one)."""
    if not comment:
        return statement
    first, sep, rest = statement.partition("\n")
    return f"{first}  {comment}{sep}{rest}"


def replace_imports(text: str, path: Path, fn, suffix: str = "") -> str:
    """``text`` with each ``from ... import`` statement for which ``fn(node, path)`` returns new lines
    (a list of (module, aliases)) written anew; what follows a statement on its last line is kept,
    and ``suffix`` (or a MARK the statement had) ends each new statement."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            new = fn(node, path)
            if new is not None:
                edits.append((node, new))
    for node, new in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[operator]
        indent = lines[first][: node.col_offset]
        tail = lines[last][node.end_col_offset :].rstrip("\n")  # a comment
        end = suffix or (MARK if tail.endswith(MARK) else "")
        tail = tail.removesuffix(MARK)
        span = lines[first][node.col_offset :] if first != last else ""
        inner = re.findall(r"#[^\n]*", span + "".join(lines[first + 1 : last]))  # a comment inside, as after `from x import (`
        body = [with_comment(statement(m, a, indent), inner[0].strip() if inner else "") + end for m, a in new]
        lines[first : last + 1] = ["\n".join(body[:-1] + [body[-1].removesuffix(end) + tail + end]) + "\n"]
    return "".join(lines)


def to_absolute(text: str, path: Path) -> str:
    def fn(node: ast.ImportFrom, path: Path):
        if not node.level:
            return None
        return [(absolute(node, path), [(a.name, a.asname) for a in node.names])]

    return replace_imports(text, path, fn, MARK)


def to_relative(text: str, path: Path) -> str:
    marked = {i + 1 for i, line in enumerate(text.splitlines()) if line.endswith(MARK)}

    def fn(node: ast.ImportFrom, path: Path):
        if node.end_lineno not in marked:
            return None
        return [(relative(node.module or "", path), [(a.name, a.asname) for a in node.names])]

    out = replace_imports(text, path, fn)
    return "\n".join(line.removesuffix(MARK) for line in out.split("\n"))


# ---- 3. split, move --------------------------------------------------------------------------------


def used_names(nodes: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
            annotation = getattr(sub, "annotation", None) or getattr(sub, "returns", None)
            for part in ast.walk(annotation) if annotation is not None else ():
                if isinstance(part, ast.Constant) and isinstance(part.value, str):  # a quoted annotation
                    names.update(re.findall(r"[A-Za-z_]\w*", part.value))
    return names


def header_imports(tree: ast.Module, text: str, used: set[str]) -> list[str]:
    """The header's import statements that bind a name in ``used`` (filtered to those names)."""
    out: list[str] = []
    checking: list[str] = []

    def keep(node: ast.Import | ast.ImportFrom, indent: str) -> str | None:
        aliases = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used or a.name == "annotations"]
        if not aliases:
            return None
        if isinstance(node, ast.Import):
            return indent + "import " + ", ".join(f"{a.name} as {a.asname}" if a.asname else a.name for a in aliases)
        tail = MARK if ast.get_source_segment(text, node) and _marked(text, node) else ""
        return statement(node.module or "", [(a.name, a.asname) for a in aliases], indent) + tail

    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            line = keep(node, "")
            if line:
                out.append(line)
        elif isinstance(node, ast.If):
            inner = [line for n in node.body if (line := keep(n, "    "))]  # type: ignore[arg-type]
            if inner:
                checking.append("if TYPE_CHECKING:\n" + "\n".join(inner))
    if checking and "TYPE_CHECKING" not in used:
        return header_imports(tree, text, used | {"TYPE_CHECKING"})
    return out + checking


def _marked(text: str, node: ast.stmt) -> bool:
    return text.splitlines()[node.end_lineno - 1].endswith(MARK)  # type: ignore[operator]


def split(old: str, root: Path, report: list[str]) -> dict[str, str]:
    """Write the modules ``old`` splits into; return each name -> its new module."""
    spec = SPLITS[old]
    source = root / path_of(old)
    text = source.read_text()
    where = placement(old, text)
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    chunks: dict[str, list[tuple[ast.stmt, str]]] = {}
    previous_end = 0
    for node in tree.body:
        start = previous_end
        previous_end = node.end_lineno  # type: ignore[assignment]
        if is_header(node):
            continue
        chunk = "".join(line for line in lines[start : node.end_lineno] if not banner_of(line))
        target = where[(top_names(node) or [f"<line {node.lineno}>"])[0]]
        chunks.setdefault(target, []).append((node, re.sub(r"\n{4,}", "\n\n\n", "\n" + chunk.rstrip("\n"))))
    defined = {t: {n for node, _ in c for n in top_names(node)} for t, c in chunks.items()}
    docstring = ast.get_docstring(tree, clean=False) or ""
    written = {}
    for target, items in sorted(chunks.items()):
        used = used_names([n for n, _ in items])
        doc = docstring if target == spec.get("keep_docstring") else spec["docs"][target]
        if target == spec.get("keep_docstring") and "docstring_edit" in spec:
            before, after = spec["docstring_edit"]
            if before in doc:
                doc = doc.replace(before, after).rstrip() + "\n"
            else:
                report.append(f"note: {path_of(old)}'s docstring no longer says {before[:40]!r}...: not edited")
        imports = header_imports(tree, text, used)
        checking = [line for line in imports if line.startswith("if TYPE_CHECKING")]
        head = [f'"""{doc}\n"""' if "\n" in doc else f'"""{doc}"""', "", *(i for i in imports if i not in checking)]
        siblings = []
        for other, names in sorted(defined.items()):
            needed = sorted((used & names) - defined[target])
            if other != target and needed:
                siblings.append(statement(full(other), [(n, None) for n in needed], "") + MARK)
        if target == spec.get("pure"):
            imported = {line.split()[1].split(".")[0] for line in head if line.startswith(("import ", "from "))}
            if siblings or not imported <= spec["pure_imports"]:
                raise Mismatch(f"the pure metrics of {old} would import {sorted(imported)} {siblings}")
        body = "".join(chunk for _, chunk in items).lstrip("\n")
        written[target] = "\n".join(head + siblings + checking) + "\n\n\n" + body + "\n"
    order = graph_order({t: {o for o in defined if o != t and used_names([n for n, _ in chunks[t]]) & defined[o]} for t in chunks})
    if order is None:
        raise Mismatch(f"the parts of {old} would import each other in a cycle")
    if old not in written:
        git("rm", "-qf", str(source))
    for target, body in written.items():
        path = root / path_of(target)
        path.write_text(body)
        report.append(f"split {path_of(old)} -> {path_of(target)} ({len(defined[target])} names)")
    return where


def graph_order(graph: dict[str, set[str]]) -> list[str] | None:
    order: list[str] = []
    pending = dict(graph)
    while pending:
        ready = sorted(n for n, deps in pending.items() if deps <= set(order))
        if not ready:
            return None
        order += ready
        for n in ready:
            del pending[n]
    return order


# ---- 4. rewrite mentions -----------------------------------------------------------------------------


class Rewriter:
    def __init__(self, splits: dict[str, dict[str, str]]):
        self.moves = {full(o): full(n) for o, n in MOVES.items()}
        self.splits = {full(o): {k: full(v) for k, v in w.items()} for o, w in splits.items()}
        self.new_sub = {n.rsplit(".", 1)[0]: set() for n in self.moves.values()}
        for n in self.moves.values():
            self.new_sub[n.rsplit(".", 1)[0]].add(n.rsplit(".", 1)[1])
        for where in self.splits.values():
            for n in where.values():
                self.new_sub.setdefault(n.rsplit(".", 1)[0], set()).add(n.rsplit(".", 1)[1])
        self.shadowed = {o for o in self.moves if o in self.new_sub}  # devices, results, selection
        names = sorted([*self.moves, *self.splits], key=len, reverse=True)
        self.pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?![\w])((?:\.\w+)?)")
        self.from_line = re.compile(r"\bfrom (fedelastic(?:\.\w+)*) import (\w+(?:, \w+)*)\b(?! as\b)")

    def targets(self, module: str, aliases: list[tuple[str, str | None]]) -> list[tuple[str, list]] | None:
        """New (module, aliases) statements for ``from module import aliases``, or None if unchanged."""
        groups: dict[str, list] = {}
        if module in self.splits:
            for name, alias in aliases:
                if name not in self.splits[module]:
                    raise Mismatch(f"`from {module} import {name}`: {name} is not defined there")
                groups.setdefault(self.splits[module][name], []).append((name, alias))
            return list(groups.items())
        if module in self.shadowed:  # `from fedelastic.devices import profile` is already new
            for name, alias in aliases:
                new = module if name in self.new_sub[module] else self.moves[module]
                groups.setdefault(new, []).append((name, alias))
            return list(groups.items()) if set(groups) != {module} else None
        if module in self.moves:
            return [(self.moves[module], aliases)]
        changed = False
        for name, alias in aliases:
            sub = f"{module}.{name}"
            if sub in self.splits:
                raise Mismatch(f"`from {module} import {name}` imports a split module: name what it uses instead")
            if sub in self.moves:
                parent, leaf = self.moves[sub].rsplit(".", 1)
                groups.setdefault(parent, []).append((leaf, alias or (name if leaf != name else None)))
                changed = True
            else:
                groups.setdefault(module, []).append((name, alias))
        return list(groups.items()) if changed else None

    def python(self, text: str, path: Path) -> str:
        def fn(node: ast.ImportFrom, path: Path):
            if node.level:
                return None
            return self.targets(node.module or "", [(a.name, a.asname) for a in node.names])

        return self.markdown(replace_imports(text, path, fn))  # then the lines in strings and the mentions

    def markdown(self, text: str) -> str:
        def line(m: re.Match) -> str:
            aliases = [(n.strip(), None) for n in m.group(2).split(",") if n.strip()]
            new = self.targets(m.group(1), aliases)
            return m.group(0) if new is None else "; ".join(statement(mod, al, "").strip() for mod, al in new)

        return self.dotted(self.from_line.sub(line, text))

    def dotted(self, text: str) -> str:
        def sub(m: re.Match) -> str:
            old, attr = m.group(1), m.group(2)[1:]
            rest = text[m.end() : m.end() + 8]
            if old in self.splits:
                if attr and attr in self.splits[old]:
                    return f"{self.splits[old][attr]}.{attr}"
                if rest.startswith(" import") or attr:
                    return m.group(0)
                return self.splits[old].get("<module>", old)
            if old in self.shadowed and (attr in self.new_sub[old] or (not attr and rest.startswith(" import"))):
                return m.group(0)
            return self.moves[old] + m.group(2)

        return self.pattern.sub(sub, text)

    def paths(self, text: str) -> str:
        def sub(m: re.Match) -> str:
            old = "fedelastic." + m.group(1).replace("/", ".")
            new = self.moves.get(old) or self.splits.get(old, {}).get("<module>")
            return str(path_of(new[len("fedelastic.") :])) if new else m.group(0)

        text = re.sub(r"(?<![\w/])fedelastic/([\w/]+)\.py\b", sub, text)
        text = re.sub(
            r"(?<![\w.])tests\.unit\.(test_\w+)\b",
            lambda m: f"tests.unit.{TESTS[m.group(1) + '.py']}.{m.group(1)}" if m.group(1) + ".py" in TESTS else m.group(0),
            text,
        )
        return re.sub(
            r"(?<![\w/])tests/unit/(test_\w+)\.py\b",
            lambda m: f"tests/unit/{TESTS[m.group(1) + '.py']}/{m.group(1)}.py" if m.group(1) + ".py" in TESTS else m.group(0),
            text,
        )


def text_files(root: Path) -> list[Path]:
    tracked = git("ls-files", *TEXT_DIRS, *TEXT_FILES).splitlines()
    untracked = git("ls-files", "--others", "--exclude-standard", *TEXT_DIRS).splitlines()
    return sorted(
        root / p for p in {*tracked, *untracked}
        if Path(p).suffix in SUFFIXES and not p.startswith(SKIP) and (root / p).is_file()
    )


# ---- 5. shims, the layout page, pyproject ---------------------------------------------------------------


def public_names(text: str) -> list[str]:
    names = set()
    for node in ast.parse(text).body:
        names.update(n for n in top_names(node) if not n.startswith("_"))
        if isinstance(node, ast.ImportFrom | ast.Import):
            names.update(a.asname for a in node.names if a.asname and a.asname == a.name.split(".")[-1])
    return sorted(names)


def quoted(names: tuple[str, ...]) -> str:
    return "(" + ", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else "") + ")"


def shim(old: str, new: str) -> str:
    return (
        f'"""Deprecated: moved to :mod:`{new}` (issue 39); this path goes in fedelastic 0.2."""\n\n'
        f'from fedelastic._shim import forward\n\nforward(__name__, "{new}")\n'
    )


def names_shim(old: str, targets: tuple[str, ...], doc: str, package: bool) -> str:
    path = "__path__" if package else "None"
    return (
        f'"""{doc}\n\nThe names of the old module ``{old}`` (now in {", ".join(f"``{t}``" for t in targets)}) still import\n'
        f'from here for one release, with a ``DeprecationWarning`` (issue 39)."""\n\n'
        f"from fedelastic._shim import forward_names\n\n"
        f"__getattr__ = forward_names(__name__, {quoted(targets)}, {path})\n"
    )


def pyproject(text: str) -> str:
    packages = sorted({f"fedelastic.{p}" for p in PACKAGES})
    m = re.search(r'packages = \[("fedelastic".*?)\]', text)
    if not m:
        raise Mismatch('pyproject.toml: no `packages = ["fedelastic", ...]` under [tool.setuptools]')
    listed = [p.strip().strip('"') for p in m.group(1).split(",")]
    keep = [p for p in listed if p not in packages]
    new = keep[:1] + packages + keep[1:]
    text = text[: m.start(1)] + ", ".join(f'"{p}"' for p in new) + text[m.end(1) :]
    # mypy checked continual.py: it checks both halves
    text = text.replace('"fedelastic/results/continual.py"', '"fedelastic/results/continual_metrics.py", "fedelastic/results/continual.py"')
    m = re.search(r"^files = \[(.*?)\]", text, re.S | re.M)
    if not m:
        raise Mismatch("pyproject.toml: no `files = [...]` under [tool.mypy]")
    folders = re.findall(r'"([\w/]+/)"', m.group(1))
    inside = [f for f in re.findall(r'"([\w/.]+\.py)"', m.group(1)) if f.startswith(tuple(folders))]
    block = m.group(1)
    for f in inside:  # a file moved into a listed folder (sim/divergence.py under sim/): mypy refuses it twice
        block = re.sub(rf'\s*"{re.escape(f)}",', "", block, count=1)
    return text[: m.start(1)] + block + text[m.end(1) :]


def install_layout(root: Path) -> None:
    page = root / "docs" / "explanation" / "how-a-run-works.md"
    text = page.read_text()
    start = text.find(LAYOUT_HEADING + "\n")
    if start < 0:
        raise Mismatch(f"{page}: no `{LAYOUT_HEADING}` heading to replace")
    nxt = re.search(r"^## ", text[start + len(LAYOUT_HEADING) :], re.M)
    end = start + len(LAYOUT_HEADING) + nxt.start() if nxt else len(text)
    section = text[start:end]
    bullets = section.find("\n- ")  # the prose after the table stays (wt/loop rewrites it)
    layout = (FILES / "where-things-are.md").read_text()
    page.write_text(text[:start] + layout + (section[bullets + 1 :] if bullets >= 0 else "\n") + text[end:])


# ---- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check the tree against the map; change nothing")
    args = ap.parse_args(argv)
    root = Path(git("rev-parse", "--show-toplevel").strip())
    os.chdir(root)
    began = time.perf_counter()
    state = check_tree(root)
    dirty = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if SKIP[0] not in line]
    if dirty and state == "fresh" and not args.check:
        raise Mismatch(f"uncommitted changes (commit or stash them first, so the move can be told apart): {dirty[:3]}")
    if state == "applied":
        print("already restructured (fedelastic/cost/costmodel.py exists): nothing to do")
        return 0
    if args.check:
        print(f"the tree matches the map: {len(MOVES)} moves, {len(SPLITS)} splits, {len(TESTS)} tests regrouped")
        return 0
    report: list[str] = []
    old_texts = {old: (root / path_of(old)).read_text() for old in [*MOVES, *SPLITS]}
    # 2. relative imports -> absolute, marked
    for path in sorted((root / "fedelastic").rglob("*.py")):
        rel = path.relative_to(root)
        text = path.read_text()
        new = to_absolute(text, rel)
        if new != text:
            path.write_text(new)
    # 3. packages, splits, moves
    for package in PACKAGES:
        (root / "fedelastic" / package).mkdir(exist_ok=True)
    splits = {old: split(old, root, report) for old in SPLITS}
    for old, new in MOVES.items():
        git("mv", str(path_of(old)), str(path_of(new)))
        report.append(f"moved {path_of(old)} -> {path_of(new)}")
    for test, folder in sorted(TESTS.items()):
        (root / "tests" / "unit" / folder).mkdir(exist_ok=True)
        init = root / "tests" / "unit" / folder / "__init__.py"
        if not init.exists():
            init.write_text("")
        git("mv", f"tests/unit/{test}", f"tests/unit/{folder}/{test}")
    report.append(f"regrouped {len(TESTS)} test files into tests/unit/<package>/")
    left = sorted(p.name for p in (root / "tests" / "unit").glob("test_*.py") if p.name not in TESTS)
    report.append(f"left in tests/unit/ (they test the root's modules, or TESTS does not name them): {', '.join(left)}")
    # a moved module one folder deeper: a path from its __file__ climbs one folder more
    for new in [*MOVES.values(), "results.continual", "results.continual_metrics"]:
        path = root / path_of(new)
        text = path.read_text()
        fixed = re.sub(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parent\b", r"\1.parent.parent", text)
        if fixed != text:  # every move goes from the root into a subpackage
            path.write_text(fixed)
            report.append(f"{path_of(new)}: a path from __file__ climbs one folder more")
    # 4. rewrite mentions
    rewriter = Rewriter({old: {**where, "<module>": SPLITS[old].get("rest", old)} for old, where in splits.items()})
    changed = 0
    for path in text_files(root):
        rel = path.relative_to(root)
        text = path.read_text()
        new = rewriter.python(text, rel) if path.suffix == ".py" else rewriter.markdown(text)
        new = rewriter.paths(new)
        if rel.parts[0] == "fedelastic" and path.suffix == ".py":
            new = to_relative(new, rel)
        if rel == Path("pyproject.toml"):
            new = pyproject(new)
        if new != text:
            path.write_text(new)
            changed += 1
    report.append(f"rewrote the imports and mentions in {changed} files")
    # 5. shims and package files
    (root / "fedelastic" / "_shim.py").write_text((FILES / "_shim.py").read_text())
    names: dict[str, dict[str, list[str]]] = {}
    for old, new in MOVES.items():
        names[full(old)] = {"new": [full(new)], "names": public_names(old_texts[old])}
        if old in PACKAGES:
            continue
        (root / path_of(old)).write_text(shim(full(old), full(new)))
    for package, doc in PACKAGES.items():
        init = root / "fedelastic" / package / "__init__.py"
        if package in MOVES:  # the package took the old module's name
            init.write_text(names_shim(full(package), (full(MOVES[package]),), doc, True))
        else:
            init.write_text(f'"""{doc}"""\n')
    for old in SPLITS:
        targets = tuple(sorted({full(t) for t in splits[old].values()} - {full(old)}))
        names[full(old)] = {"new": sorted({full(t) for t in splits[old].values()}), "names": public_names(old_texts[old])}
        if full(old) in {full(t) for t in splits[old].values()}:  # part stays: its module forwards the rest
            path = root / path_of(old)
            path.write_text(
                path.read_text() + "\n\n# names that moved out of this module (issue 39) import from here for one release\n"
                f"__getattr__ = forward_names(__name__, {quoted(targets)})\n"
            )
            text = path.read_text().replace(FUTURE, FUTURE + "from .._shim import forward_names\n", 1)
            path.write_text(text)
        else:
            doc = f"Deprecated: split into {', '.join(f':mod:`{t}`' for t in targets)}."
            (root / path_of(old)).write_text(names_shim(full(old), targets, doc, False))
    (root / "tests" / "unit" / "old_public_names.json").write_text(json.dumps(names, indent=1, sort_keys=True) + "\n")
    (root / "tests" / "unit" / "test_shims.py").write_text((FILES / "test_shims.py").read_text())
    install_layout(root)
    report.append("installed the shims, tests/unit/test_shims.py and the layout section of how-a-run-works.md")
    # sort the imports, regenerate the docs
    py = sorted(str(p.relative_to(root)) for p in text_files(root) if p.suffix == ".py")
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "-q", "--select", "I", "--fix", *py], capture_output=True, text=True)
    if ruff.returncode not in (0, 1):
        raise SystemExit(f"ruff failed: {ruff.stderr}")
    subprocess.run([sys.executable, "-m", "fedelastic.docgen"], check=True, capture_output=True)
    git("add", "-A", "fedelastic", "tests", "docs", "benchmarks", "strategies", "simulations", "README.md", "pyproject.toml")
    report.append(f"done in {time.perf_counter() - began:.1f} s; `git status` shows the change, staged")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
