"""CI reads the runnable commands from README.md and docs/*.md (.ci/readme_commands.py).

These tests keep those files inside the convention the extraction relies on, so an edit
that would make CI silently skip a command fails here instead. The console commands (`usp
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
#: README.md, then docs/*.md: every file whose console lines CI runs
DOCUMENTS = extract.documentation_files(ROOT)


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


def test_the_documents_are_readme_then_docs_by_name(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    for name in ("README.md", "docs/b.md", "docs/a.md", "docs/notes.txt", "docs/sub/c.md"):
        (tmp_path / name).write_text("```console\n$ usp " + name + "\n```\n")
    found = extract.documentation_files(tmp_path)
    assert found == [tmp_path / "README.md", tmp_path / "docs/a.md", tmp_path / "docs/b.md"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), "console"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["usp README.md", "usp docs/a.md", "usp docs/b.md"]


def test_console_commands_are_found_and_succeed(capsys):
    commands = [
        (path.relative_to(ROOT), command)
        for path in DOCUMENTS
        for command in extract.console_commands(path.read_text(encoding="utf-8"))
    ]
    assert commands, "neither README.md nor docs/*.md has `$ ...` lines in ```console blocks"
    for path, command in commands:
        argv = shlex.split(command, comments=True)
        assert argv[0] == "usp", f"CI runs this with the clean install on PATH: {path}: {command}"
        assert usp_main(argv[1:]) == 0, (path, command)
        out, err = capsys.readouterr()
        assert out and err == "", (path, command, err)


def test_the_extractor_command_line_prints_the_same():
    every_console_line = [
        command
        for path in DOCUMENTS
        for command in extract.console_commands(path.read_text(encoding="utf-8"))
    ]
    for argv, expected in (
        (["main", "README.md"], [extract.main_command(README)]),
        (["test", "README.md"], [extract.test_command(README)]),
        (["console", "README.md"], extract.console_commands(README)),
        (["console"], every_console_line),  # what CI runs: README.md, then docs/*.md
    ):
        proc = subprocess.run(
            [sys.executable, ".ci/readme_commands.py", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == expected


def test_ci_runs_what_the_extractor_reads():
    script = (ROOT / ".ci" / "run").read_text()
    for kind in ("main", "test"):
        assert f"readme_command {kind}" in script
    # console: no file named, so README.md and every docs/*.md
    assert "console_cmds=$(python3 .ci/readme_commands.py console)" in script
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
