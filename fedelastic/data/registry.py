"""The dataset plug-in point: the names a scenario's ``data.dataset`` can take, like ``model.name``.

``data.dataset`` is an entry of :data:`DATASETS` (``digits``, ``synth_digits`` or one a user
registered with :func:`register_dataset`), ``"package.module:callable"``, or
``"path/to/file.py:callable"`` (:mod:`fedelastic.plugins`); anything else is a Hugging Face
dataset or a local copy (:mod:`.hf`). An entry is a factory, or a ``module:callable`` string
imported when first used.

A factory is called with no argument (``synth_digits`` also takes ``size=``, the scenario's
``data.size``) and returns an :class:`~fedelastic.data.ArrayDataset` or ``(x, y)``: images
``(N, C, H, W)`` (or ``(N, H, W)``, one channel) scaled to [0, 1], and integer labels ``(N,)``
from 0. The run splits it into train and test by ``data.test_fraction`` and partitions the
training part with the built-in partitioners (iid, dirichlet, shards).

A factory registered in a notebook or script is carried to Ray's workers with the run
(:func:`fedelastic.plugins.registered`), by value when its module is not importable there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..plugins import Registry
from .arrays import ArrayDataset

DATASETS = Registry("datasets", {
    "digits": "fedelastic.data:load_digits_dataset",
    "synth_digits": "fedelastic.data.synth:synth_digits",
}, where="<register_dataset>", carried=True)  # fmt: skip
SHIPPED = DATASETS.shipped  # the entries fedelastic ships
_PREFIX = "fedelastic_user_dataset_"  # the module name a dataset file is loaded under, before its path's hash


def register_dataset(name: str, factory: str | Callable[..., Any] | None = None):
    """Register ``factory`` (a callable, or a ``module:callable`` / ``file.py:callable`` string) under ``name``.

    Without ``factory``, a decorator: ``@register_dataset("mine")``. Registering the same factory
    again is harmless; a name another factory has (a built-in's included) is a ConfigError.
    """
    return DATASETS.add_factory(name, factory)


def user_datasets() -> dict[str, str | Callable[..., Any]]:
    """The entries a user added to :data:`DATASETS`."""
    return DATASETS.user_entries()


def is_plugin(name: str) -> bool:
    """Whether ``data.dataset`` names a factory (an entry or a ``module:callable``), not an external dataset."""
    return name in DATASETS or ":" in name


def resolve_dataset(name: str, *, context: str = "<scenario>", key: str = "data.dataset") -> Callable[..., Any]:
    """The factory ``name`` refers to (see the module doc)."""
    return DATASETS.resolve(name, context=context, key=key, returns="a dataset (x, y)", prefix=_PREFIX)


def build_dataset(name: str, *, context: str = "<scenario>", size: int = 0):
    """The dataset ``name``'s factory returns, checked (an :class:`~fedelastic.data.ArrayDataset`)."""
    factory = resolve_dataset(name, context=context)
    try:
        out = factory(size=size) if size else factory()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 (user code)
        what = f"a factory that builds a dataset ({type(exc).__name__}: {exc})"
        raise ConfigError(context, "data.size" if size and isinstance(exc, TypeError) else "data.dataset", what, name) from None
    return as_dataset(out, name, context)


def check_finite(x: np.ndarray, context: str, what: str, got: str) -> None:
    """A ConfigError on ``data.dataset`` if images ``x`` hold NaN or inf values (bad data, not a
    training fault: refused before the run starts), naming how many values and images."""
    if x.dtype.kind != "f":
        return
    bad = ~np.isfinite(x)
    values = int(np.count_nonzero(bad))
    if values:
        images = int(np.count_nonzero(bad.reshape(len(x), -1).any(axis=1)))
        raise ConfigError(
            context, "data.dataset", f"finite image values in {what} ({values} NaN/inf values in {images} of {len(x)} images)", got
        )


def as_dataset(out: Any, name: str, context: str = "<scenario>"):
    """``out`` (an ArrayDataset or ``(x, y)``) as an ArrayDataset, or a ConfigError naming what is wrong."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(context, "data.dataset", f"a factory returning {what}", name)

    if isinstance(out, ArrayDataset):
        x, y = out.x, out.y
    elif isinstance(out, tuple) and len(out) == 2:
        x, y = np.asarray(out[0]), np.asarray(out[1])
    else:
        raise refuse(f"an ArrayDataset or (x, y), not {type(out).__name__}")
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or not np.issubdtype(x.dtype, np.number):
        raise refuse(f"images of shape (N, C, H, W) or (N, H, W), not {x.dtype} {x.shape}")
    if y.ndim != 1 or len(y) != len(x) or not len(y):
        raise refuse(f"one label per image (labels {y.shape}, images {x.shape[:1]})")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise refuse(f"integer labels from 0 (got {y.dtype}, smallest {y.min()})")
    check_finite(x, context, "the factory's images", name)
    if isinstance(out, ArrayDataset) and x is out.x:
        return out  # as it came: no copy
    return ArrayDataset(np.ascontiguousarray(x, dtype=np.float32), y.astype(np.int64))
