"""Typed messages between a notebook and its ranks: frozen dataclasses to JSON and back, checked.

A host module sends its rank program a **Spec** (what to run, every size in it, built from the
preset) and gets back one **Result** per rank. Both are frozen dataclasses declared on the host
side; :func:`teraflops.launch.launcher.launch` writes the Spec into the launch folder as ``spec.json``
and passes ``--spec PATH``, the rank reads it with :func:`teraflops.launch.rank.read_spec`, and its
Result goes back through :func:`teraflops.launch.rank.write_result` and is read with ``result=``.

:func:`to_json` and :func:`from_json` are the one round trip for all of them. Supported field
types: ``int``, ``float`` (an int is taken), ``str``, ``bool``, ``None``, ``X | None``, nested
dataclasses, ``tuple[X, ...]`` and fixed ``tuple[X, Y]``, ``list[X]``, ``dict[K, V]`` with ``K``
``str`` or ``int`` (JSON keys are strings: an int key is written as its digits and read back as an
int), and ``object`` (any JSON value, unchecked). A wrong, missing or unknown field raises
:class:`SpecError`, one line naming the field's path (``ZeroSpec.model.vocab``), what was expected
and what came.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path

from teraflops.errors import CourseError


class SpecError(CourseError, ValueError):
    """A Spec or Result that does not match its dataclass (one line: field path, expected, got)."""


def to_json(obj):
    """``obj`` (a dataclass, or what its fields hold) as JSON-able values: dataclasses become dicts
    of their fields, tuples lists, dict keys strings; tensors and NumPy values (``.tolist()``) their
    Python values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise SpecError(f"cannot send a {type(obj).__name__} ({obj!r:.60}) to or from a rank: "
                    "use JSON-able fields (numbers, strings, lists, dicts, dataclasses)")


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return f"{type(value).__name__} {text[:60]}"


def _decode(tp, value, where: str):
    """``value`` (parsed JSON) as type ``tp``; SpecError naming ``where`` if it is not one."""
    if tp is object or tp is typing.Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _decode_union(tp, args, value, where)
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value, where)
    if tp in _SCALARS:
        if not _SCALARS[tp](value):
            raise SpecError(f"{where}: expected {'null' if tp is type(None) else tp.__name__}, got {_show(value)}")
        return float(value) if tp is float else value
    if origin in (list, tuple) or tp in (list, tuple):
        return _decode_sequence(tp, origin, args, value, where)
    if origin is dict or tp is dict:
        return _decode_dict(tp, args, value, where)
    raise SpecError(f"{where}: type {_name(tp)} cannot come from JSON (declare it with the types of teraflops.launch.wire)")


# What a JSON value must be to stand for each scalar type (a bool is no int or float here, though Python's is)
_SCALARS = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _decode_union(tp, args, value, where: str):
    """``X | Y | None``: None if allowed, else the first option that decodes (one option: its own error)."""
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    errors = []
    for option in options:
        try:
            return _decode(option, value, where)
        except SpecError as e:
            errors.append(e)
    if len(options) == 1:
        raise errors[0]
    raise SpecError(f"{where}: expected {_name(tp)}, got {_show(value)}")


def _decode_sequence(tp, origin, args, value, where: str):
    """``list[X]``, ``tuple[X, ...]`` or a fixed ``tuple[X, Y]`` from a JSON list, item by item."""
    if not isinstance(value, list):
        raise SpecError(f"{where}: expected a list ({_name(tp)}), got {_show(value)}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise SpecError(f"{where}: expected {len(args)} items ({_name(tp)}), got {len(value)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    item = args[0] if args else object
    out = [_decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(out) if (origin or tp) is tuple else out


def _decode_dict(tp, args, value, where: str):
    """``dict[K, V]`` from a JSON object; ``int`` keys from their digits."""
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a dict ({_name(tp)}), got {_show(value)}")
    key_tp, val_tp = args or (str, object)
    out = {}
    for k, v in value.items():
        if key_tp is int and not (isinstance(k, str) and k.lstrip("-").isdigit()):
            raise SpecError(f"{where}: expected int keys, got key {k!r}")
        out[int(k) if key_tp is int else k] = _decode(val_tp, v, f"{where}[{k!r}]")
    return out


def _name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_json(cls, data, where: str | None = None):
    """The ``cls`` dataclass that ``data`` (parsed JSON, as :func:`to_json` wrote it) describes,
    every field checked against its annotation, nested ones too.

    Raises:
        SpecError: ``data`` is not a dict, a field is missing (and has no default), unknown, or of
            the wrong type; the message names it (``Cls.field.sub``).
    """
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a JSON object ({cls.__name__}), got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(f"{where}: missing field {name!r} ({_name(hints[name])})")
            continue
        kwargs[name] = _decode(hints[name], data[name], f"{where}.{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # the dataclass's own __post_init__ checks
        raise SpecError(f"{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def write(obj, path: Path) -> Path:
    """Write dataclass ``obj`` to ``path`` as JSON (:func:`to_json`); returns ``path``."""
    path = Path(path)
    path.write_text(json.dumps(to_json(obj)))
    return path


def read(cls, path: Path):
    """The ``cls`` written to ``path`` by :func:`write`.

    Raises:
        SpecError: the file is missing or not JSON, or a field is wrong (:func:`from_json`).
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise SpecError(f"{cls.__name__}: cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise SpecError(f"{cls.__name__}: {path} is not JSON ({e})") from None
    return from_json(cls, data)


RESULTS_ENV = "TERAFLOPS_RESULTS_DIR"  # a launch folder: spec.json, rank{r}.json, progress.json, logs


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    os.replace(tmp, path)  # a reader sees the old file or all of the new one


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
