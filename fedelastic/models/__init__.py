"""Model definitions shipped with fedelastic, and loading of a user's own factory.

A model name is a built-in name (see :data:`BUILTIN`), ``"package.module:callable"`` (the module
must be importable: the current directory is not on Python's path unless you run with
``PYTHONPATH=.`` or install your package), or ``"path/to/file.py:callable"`` (a relative path is
taken from the scenario file's folder, then the current directory). The factory is called as
``factory(num_classes=..., in_channels=..., input_size=...)``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ConfigError

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

# name -> "module:function", imported lazily so big definitions cost nothing until used
BUILTIN: dict[str, str] = {
    "small_cnn": "fedelastic.models.small:small_cnn",
    "mcu_net": "fedelastic.models.small:mcu_net",
    "resnet50": "fedelastic.models.resnet:resnet50",
    "resnet_small": "fedelastic.models.resnet:resnet_small",
    "mobilenetv2": "fedelastic.models.mobilenetv2:mobilenetv2",
    "vit_b16": "fedelastic.models.vit:vit_b16",
    "vit_tiny": "fedelastic.models.vit:vit_tiny",
}


_SHIPPED = dict(BUILTIN)


def user_entries() -> dict[str, str]:
    """Names the user's code added to :data:`BUILTIN` (``BUILTIN["mine"] = "pkg.mod:factory"``)."""
    return {k: v for k, v in BUILTIN.items() if _SHIPPED.get(k) != v}


def adopt(entries: dict[str, str]) -> None:
    """Add model names carried from the driver (see :func:`user_entries`), unless already known here."""
    for name, target in entries.items():
        BUILTIN.setdefault(name, target)


def resolve_factory(name: str, *, context: str = "<scenario>", key: str = "model.name") -> Callable[..., nn.Module]:
    """Return the factory for a built-in name or a ``module:callable`` path."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise ConfigError(
            context, key, f"a built-in model {sorted(BUILTIN)}, 'package.module:callable' or 'file.py:callable'", name
        )
    module_name, _, attr = target.rpartition(":")
    if module_name.endswith(".py"):
        return _file_factory(module_name, attr, name, context, key)
    if not _DOTTED.fullmatch(module_name) or not attr.isidentifier():
        raise ConfigError(context, key, "'package.module:callable' (absolute, dotted names)", name)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (an import runs user code: any error, or sys.exit, means 'not importable')
        raise ConfigError(context, key, f"an importable factory 'package.module:callable' ({type(exc).__name__}: {exc})", name) from None
    if not callable(factory):
        raise ConfigError(context, key, "a callable returning an nn.Module", name)
    return factory


def model_file(path: str, context: str = "<scenario>") -> Path:
    """The file of a ``file.py:callable`` model: absolute, or next to the scenario file, or from the current directory."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        beside = Path(context).parent / p
        p = beside if Path(context).is_file() and beside.is_file() else p
    return p.resolve()


def _file_factory(path: str, attr: str, name: str, context: str, key: str) -> Callable[..., nn.Module]:
    """Load ``attr`` from the Python file ``path`` (loaded once per process, under a name of its own)."""
    file = model_file(path, context)
    if not file.is_file():
        raise ConfigError(context, key, f"an existing Python file for 'file.py:callable' (no file {file})", name)
    module_name = "fedelastic_user_model_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
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
        raise ConfigError(context, key, f"a callable {attr!r} in {file} returning an nn.Module", name)
    return factory


def build_model(name: str, *, context: str = "<scenario>", **kwargs) -> nn.Module:
    """Build a model by name; the factory receives ``kwargs``."""
    factory = resolve_factory(name, context=context)
    try:
        model = factory(**kwargs)
    except TypeError as exc:  # an unknown or missing option
        raise ConfigError(context, "model.options", f"options the factory {name!r} accepts ({exc})") from None
    except Exception as exc:  # noqa: BLE001 (user code)
        options = {k: v for k, v in kwargs.items() if k not in _SET_BY_SCENARIO}
        if options:  # e.g. width = -3: the options are the likelier fault
            raise ConfigError(
                context, "model.options", f"options with which the factory {name!r} builds a model ({type(exc).__name__}: {exc})", options
            ) from None
        raise ConfigError(context, "model.name", f"a factory that builds a model ({type(exc).__name__}: {exc})", name) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(context, "model.name", "a factory that returns a torch.nn.Module", type(model).__name__)
    if next(model.parameters(), None) is None:
        raise ConfigError(context, "model.name", "a factory whose model has parameters to train", name)
    return model


_SET_BY_SCENARIO = ("num_classes", "in_channels", "input_size")  # what build_model's callers pass besides model.options


def build_with_input(
    name: str,
    *,
    num_classes: int | None = None,
    input_size: int | None = None,
    in_channels: int | None = None,
    **options: Any,
):
    """Build a registry model (or ``module:callable``) and a matching input shape.

    Only the keyword arguments the factory accepts are passed (``input_size`` is passed as
    ``image_size`` to factories that call it that). Defaults come from the factory.

    Returns
    -------
    (torch.nn.Module, tuple of int)
        The model and the shape of one sample, ``(channels, size, size)``.
    """
    factory = resolve_factory(name, context="<command line>", key="--model")
    params = inspect.signature(factory).parameters
    kwargs: dict[str, Any] = dict(options)
    if num_classes is not None and "num_classes" in params:
        kwargs["num_classes"] = num_classes
    size_key = "input_size" if "input_size" in params else "image_size" if "image_size" in params else None
    if input_size is not None and size_key:
        kwargs[size_key] = input_size
    if in_channels is not None and "in_channels" in params:
        kwargs["in_channels"] = in_channels
    model = factory(**kwargs)

    def default(key: str, fallback: int) -> int:
        p = params.get(key)
        return int(p.default) if p is not None and isinstance(p.default, int) else fallback

    size = input_size if input_size is not None else int(getattr(model, "input_size", 0) or 0)
    if not size:
        size = default(size_key, 32) if size_key else 32
    channels = in_channels if in_channels is not None else default("in_channels", 3)
    return model, (channels, size, size)


def describe_model(name: str, *, num_classes: int | None = None, input_size: int | None = None, **options: Any):
    """ModelInfo of a registry model (``model_name`` = ``name``, as RunEnvironment sets it)."""
    import torch

    from ..modelinfo import describe

    model, shape = build_with_input(name, num_classes=num_classes, input_size=input_size, **options)
    return describe(model, torch.zeros(1, *shape), model_name=name)
