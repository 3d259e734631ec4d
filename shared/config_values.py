"""How one TOML or command-line value becomes a typed config field: the type checks and
conversions `shared/config.py` applies to every section. Stdlib only."""
from __future__ import annotations

import math
import tomllib
import types
import typing
from typing import Any

from shared.engine_config import ConfigError


def parse_literal(text: str) -> Any:
    """A command-line value as a TOML literal, or the plain word as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def convert(hint, value: Any, name: str) -> Any:
    """`value` as the field type `hint`, or ConfigError naming the field `name`."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(args[0], v, name) for v in value)
        if len(args) != len(value):
            raise ConfigError(f"{name} must have {len(args)} items, got {value!r}")
        return tuple(convert(a, v, name) for a, v in zip(args, value))
    if origin in (typing.Union, types.UnionType):
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):  # NaN passes every range check; no setting means "for ever" by inf
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return str(value)
    return value
