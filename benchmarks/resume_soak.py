"""Resume and clean exit, as a user runs them: ``usp train --nproc-per-node N`` launches
of every family's tiny preset, each command's exit checked.

    python benchmarks/resume_soak.py --repeats 3 --parallel 2

For each preset (``--presets``; default every family's tiny one) and each of ``--repeats``
rounds, three launches of ``--nproc`` ranks (ulysses 2 x ring 2 for 4) into a fresh
directory: ``--steps 4`` uninterrupted; ``--steps 2``; then ``--steps 4 --resume`` in
the same output directory. The learning rate is constant (the 2-step run is then the
start of the 4-step one). Checked for every launch: exit status 0 and no
``terminate called`` (a rank aborting at interpreter shutdown) in its output; for every
preset and round: the resumed steps 3-4 repeat the uninterrupted run's loss, router aux
loss and gradient norm within ``--tolerance`` (1e-6 relative). ``--parallel K`` runs K
launches at once (a loaded machine is where an exit race shows). ``--keep`` keeps every
run directory and log (default: only those of failed launches) under ``--dir``;
``--core-dumps`` lets an aborting rank leave a core file there (for gdb).

Prints one JSON line per launch and a summary (launches, failed launches, those with
``terminate called``, resume mismatches); exits 1 if any. Results: ``benchmarks/README.md``,
*Resume and exit soak*.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_PRESETS = ("tiny", "qwen3-tiny", "gpt-oss-tiny", "gemma3-tiny", "qwen3-moe-tiny",
                "qwen3.5-tiny", "qwen3.5-moe-tiny")  # fmt: skip
ABORT = "terminate called"

CONFIG = """[cluster]
nodes = 1
gpus_per_node = "auto"

[parallel]
ulysses = "auto"
ring = "auto"

[model]
preset = "{preset}"

[data]
source = "synthetic"
synthetic_documents = 64
synthetic_length = 24
document_multiple = 8

[train]
steps = 4
global_batch = 4
seq_len = 64
micro_batch = 2
lr = 3e-3
warmup_steps = 0
min_lr_ratio = 1.0
grad_clip = 0.5
seed = 3
dtype = "float32"
checkpoint_interval = 0
export = false
"""


@dataclass
class Launch:
    """One ``usp train`` launch and what became of it."""

    preset: str
    round: int
    phase: str  # "full" (4 steps), "first" (2 steps) or "resumed" (--resume to 4)
    status: int | None = None  # None: killed after --timeout
    aborted: bool = False  # "terminate called" in its output
    seconds: float = 0.0
    last_line: str = ""
    log: str = ""


def _allow_core_dumps() -> None:
    """In the launcher (and so in its workers): an aborting rank leaves a core file in
    the run's directory (if the kernel's core_pattern is a plain file name), for
    ``gdb -batch -ex "thread apply all bt" python CORE``."""
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _grid(nproc: int) -> list[str]:
    ulysses = 2 if nproc % 2 == 0 else 1
    return ["--ulysses", str(ulysses), "--ring", str(nproc // ulysses), "--dp", "1"]


def _launch(launch: Launch, config: Path, out: Path, args) -> Launch:
    steps, resume = {"full": (4, False), "first": (2, False), "resumed": (4, True)}[launch.phase]
    command = [sys.executable, "-m", "usp", "train", str(config), "--nproc-per-node",
               str(args.nproc), "--steps", str(steps), "--output", str(out), "--device", "cpu",
               *_grid(args.nproc), *(["--resume"] if resume else [])]  # fmt: skip
    log = out.parent / f"{launch.phase}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with open(log, "w") as sink:
        process = subprocess.Popen(
            command, cwd=out.parent, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_allow_core_dumps if args.core_dumps else None,
        )  # fmt: skip
        try:
            launch.status = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
    launch.seconds = round(time.perf_counter() - started, 1)
    text = log.read_text(errors="replace")
    launch.aborted = ABORT in text
    lines = [line for line in text.splitlines() if line.strip()]
    launch.last_line = lines[-1][:300] if lines else ""
    launch.log = str(log)
    return launch


def _rows(out: Path) -> dict[int, dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "loss" in r}


def _resume_mismatches(where: Path, tolerance: float) -> list[str]:
    """What in steps 3-4 of the resumed run differs from the uninterrupted run."""
    full, resumed = _rows(where / "full"), _rows(where / "split")
    problems = []
    for step in (3, 4):
        if step not in full or step not in resumed:
            problems.append(f"step {step} missing")
            continue
        for key in ("loss", "aux_loss", "grad_norm"):
            a, b = resumed[step].get(key), full[step].get(key)
            if (a is None) != (b is None):
                problems.append(f"step {step} {key}: {a} resumed, {b} uninterrupted")
            elif a is not None and abs(a - b) > tolerance * max(abs(b), 1e-12):
                problems.append(f"step {step} {key}: {a!r} resumed != {b!r} uninterrupted")
    return problems


def _preset_round(preset: str, round_: int, root: Path, args) -> tuple[list[Launch], list[str]]:
    where = root / f"{preset}-{round_}"
    where.mkdir(parents=True)
    config = where / "job.toml"
    config.write_text(CONFIG.format(preset=preset))
    launches = [_launch(Launch(preset, round_, "full"), config, where / "full", args)]
    for phase in ("first", "resumed"):
        launches.append(_launch(Launch(preset, round_, phase), config, where / "split", args))
    mismatches = _resume_mismatches(where, args.tolerance)
    failed = mismatches or any(x.status != 0 or x.aborted for x in launches)
    if not args.keep and not failed:
        shutil.rmtree(where, ignore_errors=True)
    return launches, mismatches


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(TINY_PRESETS))
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every preset (1)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks per launch (4)")
    parser.add_argument("--parallel", type=int, default=1, help="launches at once (1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--tolerance", type=float, default=1e-6, help="relative, steps 3-4")
    parser.add_argument("--dir", type=Path, default=None, help="where runs go (a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep every run directory")
    parser.add_argument("--core-dumps", action="store_true", help="let aborting ranks dump core")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="usp-resume-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    jobs = [(preset, r) for r in range(args.repeats) for preset in args.presets]
    launches: list[Launch] = []
    mismatched: dict[str, list[str]] = {}
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(_preset_round, p, r, root, args) for p, r in jobs]
        for (preset, round_), future in zip(jobs, futures):
            done, mismatches = future.result()
            for launch in done:
                print(json.dumps(asdict(launch)), flush=True)
            launches += done
            if mismatches:
                mismatched[f"{preset} round {round_}"] = mismatches
                print(json.dumps({"resume_mismatch": f"{preset} round {round_}",
                                  "details": mismatches}), flush=True)  # fmt: skip
    summary = {
        "launches": len(launches),
        "failed": sum(x.status != 0 for x in launches),
        "terminate_called": sum(x.aborted for x in launches),
        "resume_mismatches": len(mismatched),
        "seconds": round(time.perf_counter() - started, 1),
        "dir": str(root),
    }
    print(json.dumps({"summary": summary}), flush=True)
    return summary


if __name__ == "__main__":
    result = main()
    sys.exit(
        1 if result["failed"] or result["terminate_called"] or result["resume_mismatches"] else 0
    )
