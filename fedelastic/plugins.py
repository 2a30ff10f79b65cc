"""Loading a user's callable named in a scenario: ``"package.module:callable"`` or ``"path/to/file.py:callable"``.

Models (``model.name``) and datasets (``data.dataset``) name their factories this way. A module
must be importable (the current directory is not on Python's path unless you run with
``PYTHONPATH=.`` or install your package); a relative file path is taken from the scenario
file's folder, then the current directory. A file is loaded once per process, under a module
name of its own. Every failure is a :class:`ConfigError` naming the scenario and the key.
Standard library only: importing this module imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def plugin_file(path: str, context: str = "<scenario>") -> Path:
    """The file of a ``file.py:callable``: absolute, or next to the scenario file, or from the current directory."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        beside = Path(context).parent / p
        p = beside if Path(context).is_file() and beside.is_file() else p
    return p.resolve()


def load_callable(target: str, *, name: str, context: str, key: str, returns: str, prefix: str) -> Callable[..., Any]:
    """The callable ``target`` (``module:attr`` or ``file.py:attr``) names, for the scenario value ``name``.

    ``returns`` words what the callable must return (for messages); ``prefix`` starts the module
    name a file is loaded under.
    """
    module_name, _, attr = target.rpartition(":")
    if module_name.endswith(".py"):
        return _file_callable(module_name, attr, name, context, key, returns, prefix)
    if not _DOTTED.fullmatch(module_name) or not attr.isidentifier():
        raise ConfigError(context, key, "'package.module:callable' (absolute, dotted names)", name)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (an import runs user code: any error, or sys.exit, means 'not importable')
        raise ConfigError(context, key, f"an importable factory 'package.module:callable' ({type(exc).__name__}: {exc})", name) from None
    if not callable(factory):
        raise ConfigError(context, key, f"a callable returning {returns}", name)
    return factory


def _file_callable(
    path: str, attr: str, name: str, context: str, key: str, returns: str, prefix: str
) -> Callable[..., Any]:
    """Load ``attr`` from the Python file ``path`` (loaded once per process, under a name of its own)."""
    file = plugin_file(path, context)
    if not file.is_file():
        raise ConfigError(context, key, f"an existing Python file for 'file.py:callable' (no file {file})", name)
    module_name = prefix + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    try:
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        factory = getattr(module, attr) if attr.isidentifier() else None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (the file runs user code: any error, or sys.exit, means 'not loadable')
        raise ConfigError(context, key, f"a loadable factory 'file.py:callable' ({type(exc).__name__}: {exc})", name) from None
    if not callable(factory):
        raise ConfigError(context, key, f"a callable {attr!r} in {file} returning {returns}", name)
    return factory
