"""Model definitions shipped with fedelastic, and the model plug-in point (:data:`MODELS`).

A model name is an entry of :data:`MODELS` (a built-in, or one registered with
:func:`register_model`), ``"package.module:callable"`` (the module must be importable: the
current directory is not on Python's path unless you run with ``PYTHONPATH=.`` or install your
package), or ``"path/to/file.py:callable"`` (a relative path is taken from the scenario file's
folder, then the current directory). The factory is called as
``factory(num_classes=..., in_channels=..., input_size=...)`` plus ``model.options``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..plugins import Registry, plugin_file

# name -> a factory, or "module:function" imported lazily so big definitions cost nothing until used
MODELS = Registry("models", {
    "small_cnn": "fedelastic.models.small:small_cnn",
    "mcu_net": "fedelastic.models.small:mcu_net",
    "resnet50": "fedelastic.models.resnet:resnet50",
    "resnet_small": "fedelastic.models.resnet:resnet_small",
    "mobilenetv2": "fedelastic.models.mobilenetv2:mobilenetv2",
    "vit_b16": "fedelastic.models.vit:vit_b16",
    "vit_tiny": "fedelastic.models.vit:vit_tiny",
}, where="<register_model>", carried=True)  # fmt: skip
BUILTIN = MODELS  # the same table under its earlier name (``BUILTIN["mine"] = "pkg.mod:factory"`` still works)


def register_model(name: str, factory: str | Callable[..., nn.Module] | None = None):
    """Register ``factory`` (a callable, or a ``module:callable`` / ``file.py:callable`` string) under ``name``.

    Without ``factory``, a decorator: ``@register_model("mine")``. Registering the same factory
    again is harmless; a name another factory has (a built-in's included) is a ConfigError.
    """
    return MODELS.add_factory(name, factory)


def user_entries() -> dict[str, str | Callable[..., nn.Module]]:
    """The entries the user's code added to :data:`MODELS`."""
    return MODELS.user_entries()


def resolve_factory(name: str, *, context: str = "<scenario>", key: str = "model.name") -> Callable[..., nn.Module]:
    """Return the factory for a registered name or a ``module:callable`` path."""
    return MODELS.resolve(name, context=context, key=key, returns="an nn.Module", prefix=_PREFIX)


_PREFIX = "fedelastic_user_model_"  # the module name a model file is loaded under, before its path's hash


def model_file(path: str, context: str = "<scenario>") -> Path:
    """The file of a ``file.py:callable`` model: absolute, or next to the scenario file, or from the current directory."""
    return plugin_file(path, context)


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
