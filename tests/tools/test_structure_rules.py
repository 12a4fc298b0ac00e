"""Rules about usp's own source that no linter checks: the single-process topology is
an object (``usp.process_groups.SINGLE_PROCESS``), never a None that every caller tests;
production code does not patch itself with test doubles; importing usp does not load
torch's compiler."""

import re
from pathlib import Path

import usp

SOURCE = Path(usp.__file__).parent


def _lines_matching(pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return [
        f"{path.relative_to(SOURCE.parent)}:{number}: {line.strip()}"
        for path in sorted(SOURCE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if regex.search(line)
    ]


def test_no_code_asks_whether_the_topology_is_none():
    # a plan's topology is SINGLE_PROCESS for one process: ask it (single_process,
    # world_size, dp_degree), do not test for None
    assert _lines_matching(r"topology\s+is\s+(not\s+)?None") == []


def test_no_test_doubles_in_production_code():
    assert _lines_matching(r"^\s*(import unittest|from unittest)") == []


def test_no_module_level_use_of_torchs_compiler():
    # ``@torch._dynamo.x`` or ``@torch.compiler.x`` on a function or method imports
    # torch._dynamo (1-2 s of CPU) in every process that imports the module, compiled or
    # not: usp.compile_marks has the marks that load nothing (ruff's TID253 catches only
    # ``import torch._dynamo``)
    assert _lines_matching(r"^(\s*@)?torch\.(_dynamo|compiler)\.") == []
