"""The model shape a checkpoint records (``usp_meta.json``'s ``"model"``) and its
comparison with the shape of the run that loads it (``usp train --resume``, ``usp eval``).

The shape is :meth:`usp.models.DecoderConfig.shape`: the family and every field that
decides a parameter's shape, some of them sequences (Qwen3.5's ``layer_types``,
Qwen3-MoE's ``mlp_only_layers``) or tables. JSON has no tuples, so a record read back
holds lists where the config holds tuples: the two are compared by value, never by
Python type -- sequences as sequences (a list equals a tuple of the same items),
numbers as numbers (``2 == 2.0``, but a boolean is not the number 1), tables key by
key, nested configs (dataclasses) field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from usp.errors import CheckpointError


class CheckpointShapeError(CheckpointError):
    """A checkpoint written for another model shape (no other checkpoint can help)."""


def model_shape(config) -> dict[str, Any]:
    """What decides the parameters' shapes, as the checkpoint records it: the family and
    its shape fields (:meth:`usp.models.DecoderConfig.shape`) in JSON's form (sequences
    as lists, nested configs as tables)."""
    return {name: recorded(value, name) for name, value in config.shape().items()}


def recorded(value: Any, name: str = "value") -> Any:
    """``value`` in the form JSON writes and reads back: tuples and lists as lists,
    mappings (string keys) and dataclasses (their compared fields) as dicts; a value JSON
    cannot hold is a TypeError naming ``name`` (a family recording such a field is a bug)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f for f in dataclasses.fields(value) if f.compare]
        return {f.name: recorded(getattr(value, f.name), f"{name}.{f.name}") for f in fields}
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"shape field {name}: a table needs string keys, got {list(value)!r}")
        return {key: recorded(item, f"{name}.{key}") for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [recorded(item, f"{name}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"shape field {name}: {type(value).__name__} {value!r} has no JSON form")


def same_value(a: Any, b: Any) -> bool:
    """Whether two recorded values are the same (module docstring): a list equals a
    tuple with the same items, ``2`` equals ``2.0``, ``True`` equals neither ``1`` nor
    ``1.0``, dicts need the same keys with the same values, dataclasses compare by their
    compared fields."""
    a, b = recorded(a), recorded(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


_ABSENT = object()


def shape_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``"field SAVED (checkpoint) != NOW (this run)"`` for each field that differs
    (this run's fields in order, then any only the checkpoint records); empty when the
    shapes are the same."""
    names = [*now, *(name for name in saved if name not in now)]
    diffs = []
    for name in names:
        old, new = saved.get(name, _ABSENT), now.get(name, _ABSENT)
        if old is _ABSENT or new is _ABSENT or not same_value(old, new):
            diffs.append(f"{name} {_show(old)} (checkpoint) != {_show(new)} (this run)")
    return diffs


def check_shape(saved: Mapping[str, Any], now: Mapping[str, Any], *, path) -> None:
    """A :class:`CheckpointShapeError` naming every differing field when the checkpoint at
    ``path`` records another model shape than ``now``."""
    diffs = shape_differences(saved, now)
    if diffs:
        raise CheckpointShapeError(
            f"checkpoint {path} was written for another model shape: {'; '.join(diffs)}. "
            "Resume with the [model] that wrote it, or write to another --output directory"
        )


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(recorded(value))
