"""The effective config of a run: the file with the command line's settings (``--set``,
``--steps``, ...) applied, shown at start-up and saved as ``output_dir/config.toml``.

The saved file is a config ``usp train`` reads again (its paths made absolute, as the
file now lives in the output directory), headed by what the command line changed; the
keys changed are marked in the start-up listing. A resumed run compares what it runs
with what the checkpoint recorded of this same effective config (:mod:`usp.train.resume`),
so a ``--set`` that changes what a step sees is refused as an edit of the file would be.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from usp.config import AUTO, ConfigError, read_toml
from usp.config.overrides import MISSING, changed_keys
from usp.config.toml import toml_dumps, toml_value_text

CONFIG_FILE = "config.toml"
#: tokenizer values that name no file
_TOKENIZER_WORDS = (AUTO, "byte")


def command_line_changes(job) -> list[tuple[str, Any, Any]]:
    """``(name, value in the file, effective value)`` for each key the command line set."""
    if job.source is None:
        return []
    try:
        written = read_toml(job.source)
    except ConfigError:
        return []  # the file is gone or changed since: nothing to compare with
    return changed_keys(written, job.tables)


def effective_tables(job, out: Path) -> dict[str, Any]:
    """``job.tables`` with every path absolute (relative paths are the config file's
    directory's; ``output_dir`` becomes ``out``), so the copy reads the same anywhere."""
    tables = copy.deepcopy(job.tables)
    model, data = tables.get("model", {}), tables.get("data", {})
    if isinstance(model, dict) and isinstance(model.get("path"), str):
        model["path"] = str(job.path(model["path"]))
    if isinstance(data, dict):
        files = data.get("files")
        if isinstance(files, str):
            data["files"] = str(job.path(files))
        elif isinstance(files, list):
            data["files"] = [str(job.path(f)) for f in files]
        tokenizer = data.get("tokenizer")
        if isinstance(tokenizer, str) and tokenizer not in _TOKENIZER_WORDS:
            data["tokenizer"] = str(job.path(tokenizer))
    tables.setdefault("train", {})["output_dir"] = str(Path(out).resolve())
    return tables


def effective_config_text(job, out: Path) -> str:
    """The TOML of the effective config, with a header naming the file and the changes."""
    changes = command_line_changes(job)
    header = [
        f"# The effective config of the run in {Path(out).resolve()}: {job.source or 'a config'}",
        "# with the command line's settings applied (paths made absolute).",
    ]
    header += [
        f"#   {name} = {_shown(new)} (the file: {_shown(old)})" for name, old, new in changes
    ]
    notes = {name: f"command line; the file has {_shown(old)}" for name, old, _ in changes}
    return "\n".join(header) + "\n\n" + toml_dumps(effective_tables(job, out), comments=notes)


def _shown(value: Any) -> str:
    return "not set" if value is MISSING else toml_value_text(value)


def save_effective_config(job, out: Path) -> Path:
    """Write :func:`effective_config_text` to ``out/config.toml`` (whole or not at all)."""
    path = Path(out) / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.{os.getpid()}")
    tmp.write_text(effective_config_text(job, out), encoding="utf-8")
    os.replace(tmp, path)
    return path


def startup_lines(job, path: Path) -> list[str]:
    """What ``usp train`` prints about the config: where the effective one is, what the
    command line changed, and the config itself (the keys given, not every default)."""
    changes = command_line_changes(job)
    lines = [f"  config: {path} (the effective config: the file + the command line)"]
    lines += [
        f"    set by the command line: {name} = {_shown(new)} (the file: {_shown(old)})"
        for name, old, new in changes
    ]
    marked = {name: "<- command line" for name, _, _ in changes}
    body = toml_dumps(job.tables, comments=marked).rstrip("\n").split("\n")
    return lines + [f"    {line}".rstrip() for line in body]
