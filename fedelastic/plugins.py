"""The extension points, in one place, and the loading of a user's callable named in a scenario.

Everything that plugs in registers the same way, with a function of the top-level API
(``import fedelastic as fe``), under the name a scenario key then takes:

* a selection strategy: ``@fe.register_strategy`` on the class; ``train.strategy``; runs in every client;
* a model: ``fe.register_model(name, factory)``; ``model.name``; built by the driver and every client;
* a dataset: ``fe.register_dataset(name, factory)``; ``data.dataset``; loaded by the driver and every client;
* a server policy: ``@fe.register_policy`` on the class; ``server.policy``; runs in the driver (the server);
* an aggregator: ``@fe.register_aggregator`` on the class; ``server.aggregator``; runs in the driver.

(Device profiles are TOML files, not registered: a ``fleet`` key names a profile of ``device_profiles/``
or of a folder in ``device_dirs``, or a ``.toml`` file's path.)

Classes (strategies, policies, aggregators) are class decorators and register under their own
``name``; factories (models, datasets) register under a name, as a callable or a
``"package.module:callable"`` / ``"path/to/file.py:callable"`` string, and
``@fe.register_model("mine")`` is the decorator form. Registering the same definition again (a
re-run notebook cell) is harmless; a name that another definition has is a ConfigError, as is
anything that is not the expected kind of value. What a notebook or script registers is carried to
Ray's workers with the run (:func:`registered`, :func:`adopt`; Ray pickles a notebook's functions
and classes by value), so it works with the default Ray backend as well as in-process.

A scenario can also name a factory directly: ``"package.module:callable"`` (the module
must be importable: the current directory is not on Python's path unless you run with
``PYTHONPATH=.`` or install your package) or ``"path/to/file.py:callable"`` (a relative path is
taken from the scenario file's folder, then the current directory). A file is loaded once per
process, under a module name of its own. Every failure is a :class:`ConfigError` naming the
scenario and the key. Standard library only: importing this module imports nothing heavy.
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

Factory = str | Callable[..., Any]  # a callable, or "package.module:callable" / "file.py:callable"


def same_definition(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one definition run again: equal, or the same qualified name defined
    in the same file (a module reloaded or imported under a second name, a re-run script) or in
    ``__main__`` (a re-run notebook cell, whose file Jupyter names anew when the cell changes).

    Lambdas are one definition only when equal.
    """
    if a is b or a == b:
        return True
    qualname = getattr(a, "__qualname__", None)
    if not isinstance(qualname, str) or qualname != getattr(b, "__qualname__", None) or "<lambda>" in qualname:
        return False
    if getattr(a, "__module__", None) == getattr(b, "__module__", None) == "__main__":
        return True
    files = [_defined_in(x) for x in (a, b)]
    return files[0] is not None and files[0] == files[1]


def _defined_in(obj: Any) -> str | None:
    """The file ``obj`` (a function or a class) was defined in, or None."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code.co_filename
    return getattr(sys.modules.get(getattr(obj, "__module__", "")), "__file__", None)


class Registry(dict[str, Any]):
    """One extension point's table, name -> a class or a factory: the five registries (strategies,
    models, datasets, policies, aggregators) are each one of these, and a plain dict besides.

    ``kind`` names it in :func:`registered`; ``where`` names the registering function in errors.
    A ``carried`` registry's user entries go to Ray's workers with the run (:func:`registered`,
    :func:`adopt`: what clients use); ``load`` imports the built-ins before the table is read (the
    strategies of ``strategies/``); the entries present once they are loaded are the shipped ones.
    """

    def __init__(
        self, kind: str, entries: dict[str, Any] | None = None, *, where: str, carried: bool = False,
        load: Callable[[], None] | None = None,
    ):  # fmt: skip
        super().__init__(entries or {})
        self.kind, self.where, self.load = kind, where, load or (lambda: None)
        self.shipped = dict(self)
        if carried:
            _CARRIED[kind] = self
            self.adopt(_PENDING.pop(kind, {}))

    def claim(self, name: str, value: Any, *, key: str) -> None:
        """``self[name] = value``, unless another definition has ``name``: a ConfigError naming ``key``."""
        if name in self and not same_definition(self[name], value):
            taken = self[name]
            qualname = getattr(taken, "__qualname__", None)
            has = f"{taken.__module__}.{qualname}" if isinstance(qualname, str) else repr(taken)
            raise ConfigError(self.where, key, f"a name not registered yet ({has} has it)", name)
        self[name] = value

    def add_factory(self, name: str, factory: Factory | None = None):
        """Put ``factory`` under ``name`` (``register_model``, ``register_dataset``); without
        ``factory``, a decorator that does.

        ``factory`` is a callable or a ``module:callable`` / ``file.py:callable`` string. Registering the
        same factory again (:func:`same_definition`) is harmless; a name another factory has (a
        built-in's included) is a ConfigError, as is a name that is empty or holds ``:``.
        """
        if factory is None:

            def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
                self.add_factory(name, f)
                return f

            return decorate
        if not isinstance(name, str) or not name.strip() or ":" in name:
            raise ConfigError(self.where, "name", "a non-empty name without ':'", name)
        if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
            raise ConfigError(self.where, name, "a callable or 'package.module:callable' / 'file.py:callable'", factory)
        self.claim(name, factory, key="name")
        return factory

    def add_class(self, cls: Any, base: type, *, key: str, check: Callable[[Any], None] = lambda cls: None) -> str:
        """Register class ``cls`` under its own ``name`` (``register_policy``, say); returns the name.
        ``cls`` must subclass ``base`` and set a ``name`` of its own, the value of the scenario key
        ``key``; ``check(cls)`` then raises what else is wrong with it."""
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(self.where, "class", f"a subclass of {base.__module__}.{base.__qualname__}", cls)
        name = vars(cls).get("name")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(self.where, f"{cls.__name__}.name", f"a non-empty string of its own (the {key} value)", name)
        check(cls)
        self.claim(name, cls, key=f"{cls.__name__}.name")
        return name

    def loaded(self) -> None:
        """The built-ins are in (``load`` is done): what the table holds now is what fedelastic ships."""
        self.shipped = dict(self)

    def user_entries(self) -> dict[str, Any]:
        """The entries the user's code added (not shipped, or shipped under another value)."""
        return {k: v for k, v in self.items() if k not in self.shipped or self.shipped[k] != v}

    def adopt(self, entries: dict[str, Any]) -> None:
        """Add entries carried from the driver (:meth:`user_entries`), unless this process knows the name already."""
        if entries:
            self.load()
        for name, value in entries.items():
            self.setdefault(name, value)

    def resolve(self, name: str, *, context: str, key: str, returns: str, prefix: str) -> Callable[..., Any]:
        """The factory ``name`` refers to: an entry, or a ``module:callable`` / ``file.py:callable``."""
        target = self.get(name, name)
        if callable(target):
            return target
        if ":" not in target:
            what = {"models": "model", "datasets": "dataset"}.get(self.kind, self.kind)
            raise ConfigError(
                context, key, f"a registered {what} {sorted(self)}, 'package.module:callable' or 'file.py:callable'", name
            )
        return load_callable(target, name=name, context=context, key=key, returns=returns, prefix=prefix)


_CARRIED: dict[str, Registry] = {}  # the registries whose user entries go to Ray's workers, by kind
_PENDING: dict[str, dict[str, Any]] = {}  # entries adopted before their registry's module was imported


def registered() -> dict[str, dict[str, Any]]:
    """What the user's code (a notebook, a script) registered that clients use: strategies, models
    and datasets (policies and aggregators run in the driver). The client app carries it to Ray's
    workers, where :func:`adopt` registers it; Ray pickles a class or function by reference when
    its module is importable there, by value when it is not (``__main__``, a function's locals).
    """
    return {kind: registry.user_entries() for kind, registry in _CARRIED.items()}


def adopt(entries: dict[str, dict[str, Any]]) -> None:
    """Register what :func:`registered` gathered in the driver, unless this process knows the name
    already (a registry not imported yet takes its entries when it is)."""
    for kind, table in entries.items():
        if kind in _CARRIED:
            _CARRIED[kind].adopt(table)
        else:
            _PENDING.setdefault(kind, {}).update(table)


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
