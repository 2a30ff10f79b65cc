"""The old import paths of issue 39's restructure, kept for one release (0.2 removes them).

Each old module (``fedelastic.costmodel``, ...) is a two-line file that calls :func:`forward`
(it becomes the new module itself, so a patch through the old path patches the real one) or, where
a module was split or a package took the old module's name, :func:`forward_names` (attributes are
looked up in the new modules). Both warn once with a ``DeprecationWarning`` naming the new path.
``benchmarks/restructure/README.md`` has the whole map.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings
from collections.abc import Callable
from typing import Any


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} is deprecated and goes in fedelastic 0.2: import {new}", DeprecationWarning, stacklevel=stacklevel)


def forward(old: str, new: str) -> None:
    """Make module ``old`` (being imported) the module ``new``, with a warning."""
    _warn(old, new, 3)
    sys.modules[old] = importlib.import_module(new)


def forward_names(old: str, targets: tuple[str, ...], path: list[str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``: a name not defined there is looked up in ``targets`` in
    turn, with a warning naming where it was found. ``path`` (a package's ``__path__``) keeps its
    submodules out of the lookup, so ``from package import submodule`` imports them as usual."""
    submodules = {m.name for m in pkgutil.iter_modules(path)} if path else set()

    def __getattr__(name: str) -> Any:
        if name not in submodules and not name.startswith("__"):
            for target in targets:
                module = importlib.import_module(target)
                if hasattr(module, name):
                    _warn(f"{old}.{name}", f"{target}.{name}", 3)
                    return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
