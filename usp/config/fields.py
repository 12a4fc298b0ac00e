"""The field validators and the table reader every config section uses.

A section is a frozen dataclass whose ``__post_init__`` checks each field with the
``check_*`` functions here; a failed check is a :class:`~usp.errors.ConfigError` that
names ``[section] key``, what would be valid and the value given, e.g.
``[train] micro_batch must be an integer >= 1, got 0``. :func:`read_section` turns one
TOML table into a section (unknown and missing keys named), and command-line overrides
are derived from the sections' fields (:func:`override_keys`, :func:`apply_overrides`).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, Field, fields
from typing import Any, NoReturn

from usp.config.toml import AUTO, toml_repr
from usp.errors import ConfigError


# ----------------------------------------------------------------------------- values
def is_int(value: Any) -> bool:
    """An integer, not a bool (TOML ``true`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def fail(section: str, key: str, expected: str, value: Any) -> NoReturn:
    raise ConfigError(f"[{section}] {key} must be {expected}, got {toml_repr(value)}")


def check_int(section: str, key: str, value: Any, *, minimum: int = 1, auto: bool = False) -> None:
    """An integer >= ``minimum`` (or ``"auto"`` where ``auto``)."""
    if auto and value == AUTO:
        return
    if not (is_int(value) and value >= minimum):
        fail(section, key, f"an integer >= {minimum}" + (' or "auto"' if auto else ""), value)


def check_number(
    section: str, key: str, value: Any, *, minimum: float, strict: bool = False
) -> None:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    ok = is_number(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        fail(section, key, f"a number {'>' if strict else '>='} {minimum}", value)


def check_bool(section: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(section, key, "true or false", value)


def check_choice(section: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if not (isinstance(value, str) and value in choices):
        fail(section, key, "one of " + ", ".join(json.dumps(c) for c in choices), value)


def check_string(section: str, key: str, value: Any) -> None:
    if not (isinstance(value, str) and value):
        fail(section, key, "a non-empty string", value)


# ----------------------------------------------------------------------------- tables
def keys_of(cls: type) -> tuple[str, ...]:
    """The keys a section's table may have: its dataclass fields, in order."""
    return tuple(f.name for f in fields(cls))


def is_required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def check_table(name: str, cls: type, body: Any) -> None:
    """``body`` is a table with only ``cls``'s keys and all of its required ones."""
    if not isinstance(body, dict):
        raise ConfigError(f"{name} must be a [{name}] table, got {toml_repr(body)}")
    known = keys_of(cls)
    for key in body:
        if key not in known:
            raise ConfigError(f"[{name}] unknown key {key!r}; expected one of {', '.join(known)}")
    for f in fields(cls):
        if is_required(f) and f.name not in body:
            raise ConfigError(f"[{name}] missing required key {f.name!r}")


def read_section(name: str, cls: type, body: Any):
    """The section ``cls`` built from the TOML table ``body`` (validated by ``cls``)."""
    check_table(name, cls, body)
    try:
        return cls(**body)
    except TypeError as e:  # a table where a value was expected, or the reverse
        raise ConfigError(f"[{name}] {e}") from None


# ----------------------------------------------------------------------------- overrides
def override_keys(sections: dict[str, type]) -> dict[str, str]:
    """Override name -> section, from the sections' fields (``ulysses`` -> ``parallel``).

    A key that two sections share is left out of the flat names (an override of it is
    unknown: the name alone does not say which section it is for).
    """
    owners: dict[str, list[str]] = {}
    for section, cls in sections.items():
        for key in keys_of(cls):
            owners.setdefault(key, []).append(section)
    return {key: names[0] for key, names in owners.items() if len(names) == 1}


def apply_overrides(
    data: dict[str, Any], overrides: dict[str, Any], keys: dict[str, str]
) -> dict[str, Any]:
    """A copy of the TOML structure ``data`` with ``overrides`` (key -> value) written into
    their sections; ``None`` values are skipped (argparse's "not given")."""
    merged = {
        name: dict(value) if isinstance(value, dict) else value for name, value in data.items()
    }
    for key, value in overrides.items():
        if key not in keys:
            raise ConfigError(f"unknown override {key!r}; known overrides: {', '.join(keys)}")
        if value is None:
            continue
        section = keys[key]
        if not isinstance(merged.get(section, {}), dict):
            continue  # the section's reader reports the malformed table
        merged.setdefault(section, {})[key] = value
    return merged
