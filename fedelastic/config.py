"""Strict loading of frozen dataclasses from TOML/JSON-like dicts, and back.

:func:`from_dict` rejects unknown keys, missing required keys and wrong types with a
:class:`~fedelastic.errors.ConfigError` naming the file and the dotted key. Dataclasses
validate their values in ``__post_init__`` by raising ``ValueError``; that message becomes the
"expected" part of the error. Fields carry help text in ``metadata["help"]``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with help text."""
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, src: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        real = [o for o in options if o is not type(None)]
        if len(real) == 1:  # Optional[X]: X's own error, with its own (deeper) key
            return _coerce(value, real[0], src, key)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, src, key)
            except ConfigError as exc:
                errors.append(exc.expected)
        raise ConfigError(src, key, " or ".join(errors), value)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(src, key, f"one of {list(allowed)}", value)
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, src, prefix=key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(src, key, "a list", value)
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, item, src, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(src, key, "a table", value)
        ktp, vtp = typing.get_args(tp)
        return {_coerce(k, ktp, src, key): _coerce(v, vtp, src, f"{key}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(src, key, "a number", value)
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(src, key, "a finite number", value) from None
        if not math.isfinite(number):
            raise ConfigError(src, key, "a finite number", value)
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(src, key, "an integer", value)
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(src, key, f"a {_type_name(tp)}", value)
        return value
    raise TypeError(f"unsupported config type {tp!r} at {key}")


def from_dict(cls: type[T], raw: Any, src: str = "<config>", prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``raw``, strictly."""
    if not isinstance(raw, dict):
        raise ConfigError(src, prefix or "<root>", "a table", raw)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]

    def dotted(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    for key in raw:
        if key not in fields:
            raise ConfigError(src, dotted(key), f"one of {sorted(fields)} (unknown key)", key)
    kwargs = {}
    for name, f in fields.items():
        if name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], src, dotted(name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(src, dotted(name), f"this key to be set ({f.metadata.get('help', '')})".strip())
    try:
        return cls(**kwargs)
    except ValueError as exc:
        key, expected = _failed_key(str(exc), fields)
        raise ConfigError(src, dotted(key) if key else prefix or "<root>", expected) from None


def _failed_key(message: str, fields: dict) -> tuple[str, str]:
    """(key, expected) of a config's ``ValueError``: :func:`check`'s ``"key: expected"``, else the
    first option the message names (a user's ``ValueError("k must be >= 1")``), else the table ("")."""
    key, _, expected = message.partition(": ")
    if expected and re.fullmatch(r"[A-Za-z_][\w.\[\]]*", key):
        return key, expected
    named = sorted((m.start(), name) for name in fields if (m := re.search(rf"\b{re.escape(name)}\b", message)))
    return (named[0][1] if named else ""), message


def to_dict(obj: Any) -> Any:
    """A TOML/JSON-ready dict of a dataclass (tuples become lists, None values are dropped)."""
    if dataclasses.is_dataclass(obj):
        return {
            f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None
        }
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def read_toml(path: str | Path, what: str) -> dict:
    """Parse a TOML file; a missing file or bad TOML is a :class:`ConfigError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path, "<file>", f"an existing {what} file") from None
    except IsADirectoryError:
        raise ConfigError(path, "<file>", f"a {what} file, not a directory") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path, "<file>", f"a UTF-8 text file (byte {exc.start} is not UTF-8)") from None
    except OSError as exc:
        raise ConfigError(path, "<file>", f"a readable {what} file ({exc.strerror or exc})") from None
    except ValueError as exc:  # e.g. a NUL byte in the path
        raise ConfigError(path, "<file>", f"a valid path ({exc})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "<toml>", f"valid TOML ({exc})") from None


def check(condition: bool, key: str, expected: str) -> None:
    """Raise the ``ValueError`` that :func:`from_dict` turns into a ConfigError for ``key``."""
    if not condition:
        raise ValueError(f"{key}: {expected}")
