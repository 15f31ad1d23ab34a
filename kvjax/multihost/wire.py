"""Typed, versioned messages: the only values that cross a process boundary, as strict JSON.

A message type is a dataclass declared with ``@wire_message(name, version)``; its annotated
fields are its schema, from a closed vocabulary: ``int``, ``float``, ``bool``, ``str``, ``None``,
unions of these (``str | int | None``), ``tuple[T, ...]``, ``dict[str, T]`` and other message
types. Encoded, a message is

    {"type": NAME, "version": VERSION, "fields": {FIELD: VALUE, ...}}

with every declared field present (nested messages the same way). Decoding is given the type it
expects and refuses, with a `WireError` naming the field (``StepMessage.requests[0].rid``):
anything that is not UTF-8 JSON (a pickle, say), duplicate keys, ``NaN``/``Infinity``, another
message type, another version, an unknown field, a missing field, a value of the wrong type
(``True`` is not an int, ``1.5`` is not an int). Nothing but the declared fields' plain values
is ever built from what arrived: no class is looked up by a name from the wire.

Encoding checks the same types (a request whose id is a tuple is refused before it travels,
naming the field and the value), so a message that encodes always decodes equal on every
process.

Adding a field: declare it on the message type with its annotation (and a default, for the
constructors), and raise the type's version: processes of different versions then refuse each
other's messages by name rather than misread them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import types
from collections.abc import Callable
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = ["WireError", "check", "decode", "encode", "is_wire_message", "wire_message"]

T = TypeVar("T")

#: The registered message types, by wire name.
_BY_NAME: dict[str, type] = {}
_ENVELOPE = frozenset({"type", "version", "fields"})
_SCALARS = (int, float, bool, str, type(None))


class WireError(ValueError):
    """A value that cannot travel, or bytes that are not a valid message. ``where``: the field
    (``Type.field[index]...``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


def wire_message(name: str, version: int) -> Callable[[type[T]], type[T]]:
    """Declare a dataclass a message type named ``name`` on the wire, at ``version`` (module
    docstring). Raises TypeError for a class that is not a dataclass or a name taken by another
    class; the fields' annotations are checked at first use."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"message {name!r}: version {version!r} must be an integer from 1")

    def register(cls: type[T]) -> type[T]:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"@wire_message({name!r}) declares dataclasses only, got {cls!r}")
        other = _BY_NAME.get(name)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"wire name {name!r} is taken by {other.__module__}.{other.__qualname__}")
        _BY_NAME[name] = cls
        setattr(cls, "__wire__", (name, version))  # noqa: B010  a class attribute of a frozen dataclass
        return cls

    return register


def is_wire_message(value: Any) -> bool:
    """Whether ``value`` (an instance or a class) is a declared message type."""
    cls = value if isinstance(value, type) else type(value)
    return "__wire__" in vars(cls)


def _wire_id(cls: Any) -> tuple[str, int]:
    """A message type's wire name and version."""
    name, version = vars(cls)["__wire__"]
    return name, version


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, Any], ...]:
    """The message type's fields and their annotations, checked against the vocabulary."""
    hints = get_type_hints(cls)
    fields = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    for field_name, annotation in fields:
        _check_annotation(annotation, f"{cls.__name__}.{field_name}")
    return fields


def _check_annotation(tp: Any, where: str) -> None:
    origin, args = get_origin(tp), get_args(tp)
    if tp in _SCALARS or is_wire_message(tp):
        return
    if origin in (Union, types.UnionType):
        for arm in args:
            _check_annotation(arm, where)
        return
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        _check_annotation(args[0], where)
        return
    if origin is dict and len(args) == 2 and args[0] is str:
        _check_annotation(args[1], where)
        return
    raise TypeError(
        f"{where}: {tp!r} cannot travel; use int, float, bool, str, None, unions, tuple[T, ...], dict[str, T] "
        "or a @wire_message type"
    )


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type) and get_origin(tp) is None:
        return tp.__name__
    return str(tp).replace("typing.", "")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


# --- encoding --------------------------------------------------------------------------------------


def _fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of ``tp``'s kind at its top level (to pick a union's arm)."""
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    origin = get_origin(tp)
    if origin is tuple:
        return isinstance(value, (tuple, list))
    if origin is dict:
        return isinstance(value, dict)
    return type(value) is tp


def _to_plain(value: Any, tp: Any, where: str) -> Any:
    """``value`` as plain JSON values, checked against ``tp``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            if _fits(value, arm):
                return _to_plain(value, arm, where)
        raise WireError(where, f"expected {_type_name(tp)}, got {_shown(value)}")
    if not _fits(value, tp):
        raise WireError(where, f"expected {_type_name(tp)}, got {_shown(value)}")
    if is_wire_message(tp):
        name, version = _wire_id(tp)
        fields = {n: _to_plain(getattr(value, n), t, f"{where}.{n}") for n, t in _schema(tp)}
        return {"type": name, "version": version, "fields": fields}
    if tp is int:
        return int(value)
    if tp is float:
        if not math.isfinite(value):
            raise WireError(where, f"expected a finite float, got {value!r}")
        return float(value)
    if origin is tuple:
        return [_to_plain(v, get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise WireError(where, f"keys must be str, got {_shown(k)}")
            out[k] = _to_plain(v, get_args(tp)[1], f"{where}[{k!r}]")
        return out
    return value


def _message_type(message: Any) -> type:
    cls = type(message)
    if not is_wire_message(cls):
        raise TypeError(f"{cls.__name__} is not a wire message: only @wire_message types cross a process boundary")
    return cls


def check(message: Any) -> None:
    """Raise `WireError` (naming the field and the value) unless ``message`` can travel."""
    cls = _message_type(message)
    _to_plain(message, cls, cls.__name__)


def encode(message: Any) -> bytes:
    """``message`` (a ``@wire_message`` instance) as UTF-8 JSON (module docstring).

    Raises:
        TypeError: ``message`` is not of a declared message type.
        WireError: a field's value is not of its declared type (named, with the value).
    """
    cls = _message_type(message)
    plain = _to_plain(message, cls, cls.__name__)
    return json.dumps(plain, separators=(",", ":"), allow_nan=False).encode()  # ASCII: any str travels


# --- decoding --------------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_fits(obj: Any, tp: Any) -> bool:
    if tp is type(None):
        return obj is None
    if tp is bool:
        return type(obj) is bool
    if tp is int:
        return type(obj) is int
    if tp is float:
        return type(obj) in (int, float)
    if tp is str:
        return type(obj) is str
    origin = get_origin(tp)
    if origin is tuple:
        return type(obj) is list
    if origin is dict:
        return type(obj) is dict
    return type(obj) is dict and obj.get("type") == _wire_id(tp)[0]


def _from_plain(obj: Any, tp: Any, where: str) -> Any:
    """The value of ``tp`` that ``obj`` (parsed JSON) encodes; `WireError` naming ``where``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            if _json_fits(obj, arm):
                return _from_plain(obj, arm, where)
        raise WireError(where, f"expected {_type_name(tp)}, got {_shown(obj)}")
    if is_wire_message(tp):
        return _message_from_plain(obj, tp, where)
    if not _json_fits(obj, tp):
        raise WireError(where, f"expected {_type_name(tp)}, got {_shown(obj)}")
    if tp is float:
        return float(obj)
    if origin is tuple:
        return tuple(_from_plain(v, get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(obj))
    if origin is dict:
        return {k: _from_plain(v, get_args(tp)[1], f"{where}[{k!r}]") for k, v in obj.items()}
    return obj


def _message_from_plain(obj: Any, cls: type, where: str) -> Any:
    name, version = _wire_id(cls)
    if type(obj) is not dict:
        raise WireError(where, f"expected a {name!r} message, got {_shown(obj)}")
    if set(obj) != _ENVELOPE:
        odd = sorted(set(obj) ^ _ENVELOPE)
        raise WireError(where, f"a message has exactly the keys type, version, fields; {odd} differ")
    if obj["type"] != name:
        raise WireError(where, f"expected a {name!r} message, got {_shown(obj['type'])}")
    their = obj["version"]
    if type(their) is not int or their != version:
        raise WireError(
            where,
            f"{name!r} message of version {their!r}, this process reads version {version}: every process must run "
            "the same kvjax",
        )
    fields = obj["fields"]
    if type(fields) is not dict:
        raise WireError(where, f"fields: expected an object, got {_shown(fields)}")
    schema = _schema(cls)
    declared = [n for n, _ in schema]
    unknown = sorted(set(fields) - set(declared))
    if unknown:
        raise WireError(f"{where}.{unknown[0]}", f"unknown field of {name!r} version {version} (declared: {declared})")
    missing = [n for n in declared if n not in fields]
    if missing:
        raise WireError(f"{where}.{missing[0]}", f"missing field of {name!r} version {version}")
    values = {n: _from_plain(fields[n], t, f"{where}.{n}") for n, t in schema}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise WireError(where, f"refused by {cls.__name__}: {e}") from None


def decode(raw: bytes, cls: type[T]) -> T:
    """The ``cls`` message that ``raw`` encodes (module docstring).

    Raises:
        WireError: ``raw`` is not a valid ``cls`` message of this version (names the field).
    """
    where = cls.__name__
    if not is_wire_message(cls):
        raise TypeError(f"{where} is not a wire message: declare it with @wire_message")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(where, f"not UTF-8 JSON ({bytes(raw[:8])!r}...): not a kvjax message") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise WireError(where, f"not valid JSON ({e}): not a kvjax message") from None
    message: T = _from_plain(obj, cls, where)
    return message
