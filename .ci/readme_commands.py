"""The commands README.md and docs/*.md present as runnable, read from those files.

CI (``.ci/run``) runs what this prints, so the README and the docs cannot drift from what
is tested. Conventions (tests/tools/test_readme_commands.py checks that the files follow
them):

- ``main``: in the first fenced ``bash`` block, the first command line after a comment
  line starting with ``# the main job``. It is run verbatim from the root of a fresh copy
  of the repository (it makes its own ``.venv``, without the dev extra).
- ``test``: in the same block, the first command line after a comment line that mentions
  ``test suite``. It is run verbatim from the repository root.
- ``console``: every line starting with ``$ `` inside fenced ``console`` blocks, without
  the ``$ `` (a trailing ``# comment`` is left to the shell), of README.md and then of
  every ``docs/*.md`` in name order (or of the files given). They are run with the clean
  install's ``bin`` on ``PATH``, from the root of the fresh copy.

A command is one line (no continuation backslashes). Standard library only: CI runs this
with the system ``python3`` before any virtual environment exists.

    python3 .ci/readme_commands.py {main,test} [README.md] | console [FILE ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\s*$")


class ReadmeConventionError(ValueError):
    """README.md no longer follows the convention CI reads its commands by."""


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of every fenced block, in order."""
    blocks: list[tuple[str, list[str]]] = []
    language, lines = None, []
    for line in text.splitlines():
        match = _FENCE.match(line.strip())
        if language is None:
            if match:
                language, lines = match.group(1), []
        elif line.strip() == "```":
            blocks.append((language, lines))
            language = None
        else:
            lines.append(line)
    if language is not None:
        raise ReadmeConventionError(f"a ```{language} block is never closed")
    return blocks


def _command_after(lines: list[str], is_heading, what: str) -> str:
    for i, line in enumerate(lines):
        if line.strip().startswith("#") and is_heading(line.strip()):
            for command in lines[i + 1 :]:
                command = command.strip()
                if command and not command.startswith("#"):
                    if command.endswith("\\"):
                        raise ReadmeConventionError(f"the {what} must fit on one line")
                    return command
            break
    raise ReadmeConventionError(
        f"no {what} in README.md: expected, in the first ```bash block, a command line "
        f"after the comment that introduces it (see .ci/readme_commands.py)"
    )


def _first_bash_block(text: str) -> list[str]:
    for language, lines in fenced_blocks(text):
        if language == "bash":
            return lines
    raise ReadmeConventionError("README.md has no ```bash block (the two commands)")


def main_command(text: str) -> str:
    return _command_after(
        _first_bash_block(text),
        lambda comment: comment.lower().startswith("# the main job"),
        'main-job command ("# the main job ..." then the command)',
    )


def test_command(text: str) -> str:
    return _command_after(
        _first_bash_block(text),
        lambda comment: "test suite" in comment.lower(),
        'test command (a comment mentioning "test suite", then the command)',
    )


def console_commands(text: str) -> list[str]:
    return [
        line.strip()[2:].strip()
        for language, lines in fenced_blocks(text)
        if language == "console"
        for line in lines
        if line.strip().startswith("$ ")
    ]


def documentation_files(root: Path) -> list[Path]:
    """README.md, then every docs/*.md in name order: the files whose console lines run."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str]) -> int:
    kind, files = (argv[0], argv[1:]) if argv else (None, [])
    if kind not in ("main", "test", "console") or (kind != "console" and len(files) > 1):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    if kind == "console":
        paths = [Path(f) for f in files] or documentation_files(Path("."))
    else:
        paths = [Path(files[0] if files else "README.md")]
    commands: list[str] = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        try:
            if kind == "console":
                commands += console_commands(text)
            else:
                commands.append(main_command(text) if kind == "main" else test_command(text))
        except ReadmeConventionError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 1
    for command in commands:  # none: no output at all, not an empty line
        print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
