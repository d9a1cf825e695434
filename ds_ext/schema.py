"""Strict parsing of plain dicts (from JSON) into ``@dataclass(kw_only=True)`` configs.

An unknown key is an error naming the key and the allowed ones; a value of the wrong
type names the field, the expected type and what was given. Dataclasses may define
``check(self, where)`` for value rules; it runs after the fields are parsed.
"""

import dataclasses
import difflib
import types
import typing

from .errors import ConfigError


def _suggest(key, allowed):
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(tp):
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "object"
    return getattr(tp, "__name__", str(tp))


def _convert(value, tp, where):
    origin = typing.get_origin(tp)
    if tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, where)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {value!r}")
    if origin is typing.Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
        raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where=where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp} at {where}")


def from_dict(cls, data, *, where):
    """Build dataclass ``cls`` from ``data``; ``where`` names the section in errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object with keys {allowed_keys(cls)}, got {data!r}")
    allowed = allowed_keys(cls)
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}{_suggest(key, allowed)}; allowed keys: {allowed}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{f.name} is required ({_type_name(hints[f.name])})")
        elif dataclasses.is_dataclass(hints[f.name]) and f.default_factory is not dataclasses.MISSING:
            kwargs[f.name] = from_dict(hints[f.name], {}, where=f"{where}.{f.name}")
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        obj.check(where)
    return obj


def allowed_keys(cls):
    return [f.name for f in dataclasses.fields(cls) if f.init]
