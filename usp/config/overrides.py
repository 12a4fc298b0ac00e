"""``--set SECTION.KEY=VALUE``: a config field from the command line, any section, any key.

A setting is written into the TOML structure before the sections are read, so it is
checked by exactly the validators a value in the file meets (an unknown key, a wrong
type, a value out of range: the same message, naming the ``--set`` that gave it).
``VALUE`` is a TOML value (``1e-4``, ``true``, ``[0.9, 0.95]``, ``{rope_type = "yarn",
factor = 4.0}``, ``"text"``); what does not parse as one is taken as a string, so
``--set data.long_documents=split`` needs no quotes. A key may be nested
(``--set model.overrides.num_hidden_layers=4``); of two settings of one key the last
wins.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from usp.config.toml import toml_repr, tomllib
from usp.errors import ConfigError

EXAMPLE = "--set train.lr=1e-4"


@dataclass(frozen=True)
class Setting:
    """One ``--set``: the key's path (``("train", "lr")``), its value, the text given."""

    path: tuple[str, ...]
    value: Any
    text: str

    @property
    def name(self) -> str:
        """``[train] lr`` (``[model] overrides.num_hidden_layers``): as messages name keys."""
        return f"[{self.path[0]}] {'.'.join(self.path[1:])}"


def toml_value(text: str) -> Any:
    """``text`` as a TOML value, or the text itself when it is none (a bare word)."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def parse_setting(text: str) -> Setting:
    """``"train.lr=1e-4"`` -> ``Setting(("train", "lr"), 0.0001, ...)``."""
    key, sep, raw = text.partition("=")
    path = tuple(part.strip() for part in key.split("."))
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(
            f"--set expects SECTION.KEY=VALUE (e.g. {EXAMPLE}, --set data.long_documents=split), "
            f"got {text!r}"
        )
    return Setting(path, toml_value(raw.strip()), text)


def parse_settings(texts: Iterable[str] | None) -> tuple[Setting, ...]:
    return tuple(parse_setting(t) for t in texts or ())


def apply_settings(data: dict[str, Any], settings: Sequence[Setting]) -> dict[str, Any]:
    """A copy of the TOML structure ``data`` with every setting written in (tables made
    where missing)."""
    merged = copy.deepcopy(data)
    for s in settings:
        table = merged
        for depth, part in enumerate(s.path[:-1]):
            inner = table.setdefault(part, {})
            if not isinstance(inner, dict):
                where = ".".join(s.path[: depth + 1])
                raise ConfigError(
                    f"--set {s.text}: {where} is {toml_repr(inner)} in the config, not a table"
                )
            table = inner
        table[s.path[-1]] = s.value
    return merged


def located_in_settings(message: str, settings: Sequence[Setting]) -> str:
    """``message`` with the ``--set`` it is about named (the last one of that key)."""
    for s in reversed(settings):
        section, key = s.path[0], s.path[1]
        if f"[{section}] {key}" in message or f"[{section}] unknown key {key!r}" in message:
            return f"{message} (from --set {s.text})"
        if f"section [{section}]" in message:
            return f"{message} (from --set {s.text})"
    return message


def check_no_conflicts(
    settings: Sequence[Setting],
    flags: dict[str, Any],
    sections: dict[str, str],
    flag_names: dict[str, str] | None = None,
) -> None:
    """A key given by a flag (``--steps``: ``flags["steps"]``, its section from
    ``sections``) and by ``--set`` too is refused: which one should win is a guess.
    ``flag_names``: a flag not named ``--<key>`` (``{"output_dir": "--output"}``)."""
    for key, value in flags.items():
        if value is None or key not in sections:
            continue
        for s in settings:
            if s.path == (sections[key], key):
                flag = (flag_names or {}).get(key, "--" + key.replace("_", "-"))
                raise ConfigError(
                    f"[{sections[key]}] {key} is given twice, by {flag} and by --set {s.text}; "
                    "give it once"
                )


def changed_keys(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, old, new)`` for every leaf key whose value differs (``old`` is
    :data:`MISSING` for a key the file does not have), in the order of ``after``."""
    found: list[tuple[str, Any, Any]] = []

    def walk(old: Any, new: Any, path: tuple[str, ...]) -> None:
        if isinstance(new, dict) and (isinstance(old, dict) or old is MISSING):
            old_table = old if isinstance(old, dict) else {}
            for key, value in new.items():
                walk(old_table.get(key, MISSING), value, (*path, key))
        elif old is MISSING or old != new:
            found.append((f"[{path[0]}] {'.'.join(path[1:])}".rstrip(), old, new))

    walk(before, after, ())
    return found


class _Missing:
    def __repr__(self) -> str:
        return "(not in the file)"


#: the "old value" of a key the file does not have
MISSING = _Missing()
