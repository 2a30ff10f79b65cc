"""Model definitions shipped with fedelastic, and loading of a user's own factory.

A model name is either a built-in name (see :data:`BUILTIN`) or ``"package.module:callable"``,
a factory called as ``factory(num_classes=..., in_channels=..., input_size=...)``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

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


def resolve_factory(name: str, *, context: str = "<scenario>", key: str = "model.name") -> Callable[..., nn.Module]:
    """Return the factory for a built-in name or a ``module:callable`` path."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise ConfigError(context, key, f"a built-in model {sorted(BUILTIN)} or 'package.module:callable'", name)
    module_name, _, attr = target.partition(":")
    if not _DOTTED.fullmatch(module_name) or not attr.isidentifier():
        raise ConfigError(context, key, "'package.module:callable' (absolute, dotted names)", name)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001 (an import runs user code: any error means 'not importable')
        raise ConfigError(context, key, f"an importable factory 'package.module:callable' ({type(exc).__name__}: {exc})", name) from None
    if not callable(factory):
        raise ConfigError(context, key, "a callable returning an nn.Module", name)
    return factory


def build_model(name: str, *, context: str = "<scenario>", **kwargs) -> nn.Module:
    """Build a model by name; the factory receives ``kwargs``."""
    factory = resolve_factory(name, context=context)
    try:
        model = factory(**kwargs)
    except TypeError as exc:  # an unknown or missing option
        raise ConfigError(context, "model.options", f"options the factory {name!r} accepts ({exc})") from None
    except Exception as exc:  # noqa: BLE001 (user code)
        raise ConfigError(context, "model.name", f"a factory that builds a model ({type(exc).__name__}: {exc})", name) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(context, "model.name", "a factory that returns a torch.nn.Module", type(model).__name__)
    return model
