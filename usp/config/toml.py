"""The one TOML reader of usp's config files, and how a value is shown in messages.

Every config file (topology or training) is read by :func:`read_toml`: bounded in size,
UTF-8, and every way it can fail is a :class:`~usp.errors.ConfigError` that starts with
the file's path.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from usp.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: the value of a key that the launch, the model or another key decides
AUTO = "auto"
# A config is a few hundred bytes; refuse to read more than this (a device file, a
# mistaken path to a dataset) instead of loading it into memory.
MAX_CONFIG_BYTES = 1 << 20


def toml_repr(value: Any) -> str:
    """A value as the user wrote it in TOML: strings in double quotes, lowercase bools."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def located(source: str | None, message: str) -> str:
    """``message`` prefixed with the config file's path (once)."""
    if source is None or message.startswith(f"{source}: "):
        return message
    return f"{source}: {message}"


def read_toml(source: str) -> dict[str, Any]:
    """The TOML document at ``source``; every way that can fail is a :class:`ConfigError`."""
    try:
        with open(source, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # bounded: the path may be a device or a dataset
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read the config file: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: larger than {MAX_CONFIG_BYTES} bytes; a config is a small TOML file "
            "(see examples/configs/)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r}); "
            "TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid TOML: nested too deeply") from None


# ----------------------------------------------------------------------------- writing
_BARE_KEY = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _key(name: str) -> str:
    return name if name and set(name) <= _BARE_KEY else _string(name)


def _string(text: str) -> str:
    # JSON's escapes are TOML's, but for DEL (which TOML wants escaped) and the
    # surrogate pairs ensure_ascii would write (so: keep non-ASCII characters as they are)
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value_text(value: Any) -> str:
    """One value in TOML syntax (tables inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{_key(str(k))} = {toml_value_text(v)}" for k, v in value.items())
        return "{" + inner + "}" if inner else "{}"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


def toml_dumps(data: dict[str, Any], *, comments: dict[str, str] | None = None) -> str:
    """The TOML text of a config structure (sections -> keys; deeper tables inline), which
    :func:`read_toml` reads back equal. ``comments``: ``"[section] key"`` -> a comment
    written at the end of that key's line."""
    comments = comments or {}
    lines: list[str] = []
    # top-level values before the first table (after it they would belong to it)
    ordered = sorted(data.items(), key=lambda item: isinstance(item[1], dict))
    for section, body in ordered:
        if not isinstance(body, dict):
            lines.append(f"{_key(section)} = {toml_value_text(body)}")
            continue
        lines += ["", f"[{_key(section)}]"] if lines else [f"[{_key(section)}]"]
        for key, value in body.items():
            line = f"{_key(key)} = {toml_value_text(value)}"
            note = comments.get(f"[{section}] {key}")
            lines.append(f"{line}  # {note}" if note else line)
    return "\n".join(lines) + "\n"
