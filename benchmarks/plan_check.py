"""The planner against a real step on this machine's device: ``usp plan``'s fake-tensor
estimate of one rank's peak memory next to what the same step really allocates.

    python benchmarks/plan_check.py                      # CUDA: 4 layers of Llama-3.1-8B, 64k tokens, 8 ranks
    python benchmarks/plan_check.py --preset tiny --layers 2 --seq-len 4096 --world 4 --ulysses 2 --ring 2

One rank of ``--world`` on the ``fake`` process group (collectives move no data, which
changes no allocation), FSDP2 over all of them, activation checkpointing on, AdamW state
from a first step. The real figure is ``torch.cuda.max_memory_allocated`` on CUDA and the
peak of torch.profiler's allocator events on the CPU (:mod:`usp.planner.validate`).
Exit status 1 when the estimate is more than 10% off.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from usp.models import PRESETS, Levers
from usp.planner.footprint import Choice, Target
from usp.planner.measure import measure
from usp.planner.validate import real_peak
from usp.train.config import train_config_from_dict

GIB = 2**30
TOLERANCE = 0.10


def job_for(args, device: str):
    data = {
        "cluster": {"nodes": 1, "gpus_per_node": args.world},
        "parallel": {"ulysses": args.ulysses, "ring": args.ring},
        "model": {"preset": args.preset},
        "data": {"source": "synthetic"},
        "train": {"steps": 1, "global_batch": 1, "seq_len": args.seq_len, "device": device},
    }
    return train_config_from_dict(data, source="plan_check")


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3.1-8b" if cuda else "tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=4 if cuda else 2)
    p.add_argument("--seq-len", type=int, default=65536 if cuda else 4096)
    p.add_argument("--world", type=int, default=8 if cuda else 4)
    p.add_argument("--ulysses", type=int, default=8 if cuda else 2)
    p.add_argument("--ring", type=int, default=1 if cuda else 2)
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="write plan_check.json here")
    args = p.parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    device = "cuda" if cuda else "cpu"
    job = job_for(args, device)
    model = PRESETS[args.preset].replace(num_hidden_layers=args.layers)
    target = Target(job, model, args.world, args.world, device)
    levers = Levers(activation_checkpointing=not args.no_activation_checkpointing)
    choice = Choice(args.ulysses, args.ring, args.world // (args.ulysses * args.ring), levers)
    estimate = measure(target, choice)
    real = real_peak(target, choice)
    ratio = estimate.peak_device / real
    row = {
        "preset": args.preset, "layers": args.layers, "seq_len": args.seq_len,
        "world": args.world, "ulysses": args.ulysses, "ring": args.ring, "device": device,
        "estimate_gib": estimate.peak_device / GIB, "real_gib": real / GIB, "ratio": ratio,
        "breakdown_gib": {k: v / GIB for k, v in estimate.breakdown.items() if v},
    }  # fmt: skip
    print(json.dumps(row, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan_check.json").write_text(json.dumps(row, indent=2) + "\n")
    if abs(ratio - 1) > TOLERANCE:
        print(f"plan_check: FAILED: the estimate is {ratio:.3f}x the real peak (> 10% off)")
        return 1
    print(f"plan_check: estimate / real = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
