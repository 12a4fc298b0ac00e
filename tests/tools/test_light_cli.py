"""The light commands (:data:`usp.cli.LIGHT`): a usage error answers, and a launcher
(``--nproc-per-node``) starts, before torch or the command's own stack loads."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from launch_cases import ROOT

from usp.cli import LIGHT
from usp.cli.args import DTYPE_NAMES
from usp.train.components import TORCH_DTYPES

#: per command of LIGHT: argvs that are usage errors (exit status 2 from argparse)
USAGE_ERRORS = {
    "plan": [
        ["plan"],
        ["plan", "x.toml", "--seq-len", "0"],
        ["plan", "x.toml", "--gpu-memory-gib", "1e12"],
        ["plan", "--bogus"],
    ],
    "train": [["train", "--bogus"], ["train", "x.toml", "--nproc-per-node", "0"]],
    "eval": [["eval", "x"], ["eval", "x", "--lengths", "0"], ["eval", "--bogus"]],
}
#: per command of LIGHT with a launcher form: a launcher call (its module's ``launch``,
#: replaced here: it would start workers)
LAUNCHES = {
    "train": ["train", "x.toml", "--nproc-per-node", "2"],
    "eval": ["eval", "runs/x", "--lengths", "256", "--dtype", "float32", "--nproc-per-node", "2"],
}
#: what none of them may load: torch, and each command's stack (torch would come first)
HEAVY = ("torch", "usp.train.cli", "usp.evaluation.cli", "usp.planner.plan")

CODE = """
import sys
from usp.cli import LIGHT, main
usage_errors, launches, heavy = {usage_errors!r}, {launches!r}, {heavy!r}
loaded = lambda: sorted(m for m in heavy if m in sys.modules)
for name in LIGHT:
    for argv in usage_errors[name]:
        try:
            main(argv)
        except SystemExit as exit:
            assert exit.code == 2, (argv, exit.code)
        else:
            raise AssertionError(f"{{argv}} parsed")
    print("usage", name, loaded())
for name, argv in launches.items():
    sys.modules[LIGHT[name]].launch = lambda *call, name=name: print("launch", name, loaded()) or 0
    print("status", main(argv))
"""


def test_light_commands_answer_before_torch_or_their_stack_loads():
    """One fresh interpreter (nothing loaded before) runs every LIGHT command's usage
    errors, then every launcher call; neither loads torch, nor the command's stack."""
    assert set(USAGE_ERRORS) == set(LIGHT) and set(LAUNCHES) <= set(LIGHT)
    code = CODE.format(usage_errors=USAGE_ERRORS, launches=LAUNCHES, heavy=HEAVY)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's usp, whatever is installed
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = [f"usage {name} []" for name in LIGHT]
    for name in LAUNCHES:
        expected += [f"launch {name} []", "status 0"]
    assert result.stdout.splitlines() == expected, result.stdout + result.stderr
    # eval's --dtype choices, named without torch, are the command's dtypes
    assert tuple(TORCH_DTYPES) == DTYPE_NAMES
    assert {"float32": torch.float32, "bfloat16": torch.bfloat16} == TORCH_DTYPES
