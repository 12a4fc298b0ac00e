"""CI reads the README's runnable commands from README.md (.ci/readme_commands.py).

These tests keep README.md inside the convention the extraction relies on, so an edit that
would make CI silently skip a command fails here instead. The console commands (`usp
topo ...`) are cheap: they run here too, in-process.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from usp.cli import main as usp_main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _load_extractor():
    spec = importlib.util.spec_from_file_location(
        "readme_commands", ROOT / ".ci" / "readme_commands.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


extract = _load_extractor()


def _repo_paths(command: str) -> list[str]:
    """Arguments that name files of this repository (examples/..., *.toml, *.py)."""
    words = shlex.split(command, comments=True)
    return [
        w
        for w in words
        if w.startswith(("examples/", "benchmarks/")) or w.endswith((".toml", ".py"))
    ]


def test_the_main_job_is_found_and_runs_from_a_fresh_clone():
    command = extract.main_command(README)
    # a fresh machine: its own venv, the runtime dependencies only (no dev extra)
    assert command.startswith("python3 -m venv .venv && .venv/bin/pip install torch==")
    assert "[dev]" not in command and " -e . " in command
    paths = _repo_paths(command)
    assert paths, f"the main job names no file of the repository: {command}"
    for path in paths:
        assert (ROOT / path).is_file(), f"the README's main job names a missing file: {path}"


def test_the_test_command_is_found():
    command = extract.test_command(README)
    assert '-e ".[dev]"' in command and "pytest" in command
    assert command != extract.main_command(README)


def test_console_commands_are_found_and_succeed(capsys):
    commands = extract.console_commands(README)
    assert commands, "README.md has no `$ ...` lines in ```console blocks"
    for command in commands:
        argv = shlex.split(command, comments=True)
        assert argv[0] == "usp", f"CI runs this with the clean install on PATH: {command}"
        assert usp_main(argv[1:]) == 0, command
        out, err = capsys.readouterr()
        assert out and err == "", (command, err)


def test_the_extractor_command_line_prints_the_same():
    for kind, expected in (
        ("main", [extract.main_command(README)]),
        ("test", [extract.test_command(README)]),
        ("console", extract.console_commands(README)),
    ):
        proc = subprocess.run(
            [sys.executable, ".ci/readme_commands.py", kind, "README.md"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == expected


def test_ci_runs_what_the_extractor_reads():
    script = (ROOT / ".ci" / "run").read_text()
    for kind in ("main", "test", "console"):
        assert f"readme_command {kind}" in script
    assert '"$status" -eq 5' in script  # pytest's "no tests collected" fails CI


BLOCK = """
```bash
# the main job: something
python3 -m venv .venv && run main

# the whole test suite
python3 -m venv .venv && run tests
```
"""


def test_the_convention_on_a_small_readme():
    assert extract.main_command(BLOCK) == "python3 -m venv .venv && run main"
    assert extract.test_command(BLOCK) == "python3 -m venv .venv && run tests"
    text = (
        "```console\n$ usp topo a.toml  # note\nusp topo: a.toml\n```\n```text\n$ not this\n```\n"
    )
    assert extract.console_commands(text) == ["usp topo a.toml  # note"]


@pytest.mark.parametrize(
    "text, call, message",
    [
        ("no code at all\n", "main_command", "README.md has no ```bash block"),
        (BLOCK.replace("# the main job", "# the first job"), "main_command", "no main-job command"),
        (BLOCK.replace("test suite", "tests"), "test_command", "no test command"),
        (BLOCK.replace("&& run main", "&& \\"), "main_command", "must fit on one line"),
        ("```bash\n# the main job\nrun\n", "main_command", "a ```bash block is never closed"),
    ],
)
def test_a_readme_that_breaks_the_convention_is_an_error(text, call, message):
    with pytest.raises(extract.ReadmeConventionError, match=re.escape(message)):
        getattr(extract, call)(text)
