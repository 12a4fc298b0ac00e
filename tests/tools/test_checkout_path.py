"""The suite passes from a checkout named ``usp`` (what ``git clone`` gives), with its
.venv inside: the host-sync detector of tests/attention/test_plan.py once matched "/usp/"
in a path, took torch's frames (``usp/.venv/.../torch``) for usp's and failed. Here the
detector runs from a copy at ``<tmp>/usp/`` whose torch is imported from inside it too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import json, torch, usp
from host_syncs import PACKAGE, HostSyncs

plan = usp.Plan(None, backend="cpu", verify_calls=False)
packed = plan.pack(torch.tensor([0, 8, 12, 32], dtype=torch.int32))
q = torch.randn(1, 32, 4, 16, requires_grad=True)
k, v = torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16)
plan.attention(q, k, v, causal=True, packed=packed).sum().backward()  # caches made here
with HostSyncs() as mode:
    plan.attention(q, k, v, causal=True, packed=packed).sum().backward()
print(json.dumps({"torch": torch.__file__, "usp": usp.__file__, "package": PACKAGE,
                  "calls": mode.calls, "exempted": mode.exempted}))
"""


def test_the_host_sync_detector_works_from_a_checkout_named_usp(tmp_path):
    checkout = tmp_path / "usp"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "usp", checkout / "usp", ignore=skip)
    shutil.copytree(ROOT / "tests" / "helpers", checkout / "tests" / "helpers", ignore=skip)
    # torch imported from inside the checkout, as from a .venv created in it
    (checkout / "site").symlink_to(Path(torch.__file__).resolve().parents[1])
    (checkout / "check.py").write_text(CHECK)
    path = [checkout, checkout / "tests" / "helpers", checkout / "site"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    done = subprocess.run(
        [sys.executable, "check.py"], cwd=checkout, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # the situation of a clone named usp: both torch and usp under .../usp/
    assert seen["torch"].startswith(f"{checkout}{os.sep}site{os.sep}torch"), seen
    assert seen["usp"].startswith(f"{checkout}{os.sep}usp{os.sep}"), seen
    assert seen["calls"] == [], seen["calls"]
    assert seen["exempted"] > 0, "the CPU kernel's own reads were seen and told apart"
