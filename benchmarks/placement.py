"""Placing a length mix's documents: ``"sequence"`` against ``"documents"``, step by step.

    python benchmarks/placement.py --lengths FILE --ulysses U --ring R --seq-len N [--json]

Packs the document lengths of FILE (one integer a line) into steps of N tokens as ``usp
train`` packs them (in order; each document padded to the sequence multiple of the
grid, which a split document needs; the rest of a step one padding document; a document
longer than N cut into pieces of N) and prints, per step and in total, for both
placements: bytes each SP rank sends in one forward and backward of every layer (max
and mean over the ranks: :func:`usp.planner.placement.row_bytes`, the traffic formula
``tests/attention/test_placement_traffic.py`` holds equal to the byte counters),
the linear and attention work per rank (max / mean) and the link model's step-time
estimate (:func:`usp.planner.placement.step_seconds`: ``usp plan``'s assumptions, one
H200 a rank, 8 a node). ``--json``: the totals over all steps, ``{"sequence": {...},
"documents": {...}}``, each with ``bytes_max`` and ``bytes_mean`` (per rank, summed over
the steps), ``work_max_over_mean`` (the busiest rank's work over the mean, summed over
the steps) and ``step_s`` (the estimated seconds of all steps). The model is
``--model`` (a ``usp.models.PRESETS`` name, default Llama-3.1-8B; bf16).
Nothing runs on a device: every number is a closed form of the lengths.
"""

from __future__ import annotations

import argparse
import json
import sys

from usp.models import preset
from usp.planner.placement import PLACEMENTS, mix_steps, mix_totals
from usp.sp.sharding import required_multiple


def read_lengths(path: str) -> list[int]:
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            if not text.isdigit() or int(text) < 1:
                raise SystemExit(f"{path}:{number}: expected a document length >= 1, got {text!r}")
            out.append(int(text))
    if not out:
        raise SystemExit(f"{path}: no document lengths")
    return out


def _summary(values) -> tuple[float, float]:
    return max(values), sum(values) / len(values)


def measure(lengths, *, ulysses, ring, seq_len, model="llama3.1-8b", layout="zigzag",
            ring_impl="p2p") -> dict:  # fmt: skip
    """Per step and placement: bytes, work and seconds per rank; see the module doc."""
    multiple = required_multiple(ring, ulysses, layout)
    if seq_len % multiple:
        raise SystemExit(
            f"--seq-len {seq_len} must be a multiple of {multiple} on u{ulysses}xr{ring}"
        )
    steps = mix_steps(lengths, model=preset(model), ulysses=ulysses, ring=ring, seq_len=seq_len,
                      layout=layout, ring_impl=ring_impl)  # fmt: skip
    totals = mix_totals(steps)
    for t in totals.values():
        del t["tokens_max"]  # the JSON totals: the four the issue names
    return {"model": model, "ulysses": ulysses, "ring": ring, "seq_len": seq_len,
            "documents": len(lengths), "steps": steps, "totals": totals}  # fmt: skip


def text(result: dict) -> str:
    gb = 1e9
    lines = [
        f"{result['model']} on ulysses {result['ulysses']} x ring {result['ring']}, "
        f"{result['seq_len']:,} tokens a step, {result['documents']:,} documents in "
        f"{len(result['steps'])} steps",
        f"{'step':>5} {'placement':<10} {'split':>5} {'GB/rank max':>12} {'mean':>8} "
        f"{'linear max/mean':>16} {'attn max/mean':>14} {'tokens max':>11} {'est. s':>8}",
    ]
    for index, step in enumerate(result["steps"]):
        for placement in PLACEMENTS:
            s = step[placement]
            b_max, b_mean = _summary(s["bytes"])
            l_max, l_mean = _summary(s["linear"])
            a_max, a_mean = _summary(s["attention"])
            lines.append(
                f"{index:>5} {placement:<10} {s['split']:>5} {b_max / gb:>12.3f} "
                f"{b_mean / gb:>8.3f} {l_max / max(l_mean, 1e-30):>16.3f} "
                f"{a_max / max(a_mean, 1e-30):>14.3f} {max(s['tokens']):>11,} {s['step_s']:>8.3f}"
            )
    lines.append("total:")
    for placement, t in result["totals"].items():
        lines.append(
            f"  {placement:<10} bytes per rank max {t['bytes_max'] / gb:.2f} GB, mean "
            f"{t['bytes_mean'] / gb:.2f} GB; busiest rank's work / mean "
            f"{t['work_max_over_mean']:.4f}; estimated {t['step_s']:.2f} s"
        )
    seq, doc = result["totals"]["sequence"], result["totals"]["documents"]
    if seq["bytes_max"]:
        lines.append(
            f"  documents / sequence: bytes {doc['bytes_max'] / seq['bytes_max']:.3f}, "
            f"estimated time {doc['step_s'] / seq['step_s']:.3f}"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", required=True, help="one document length a line")
    parser.add_argument("--ulysses", type=int, required=True)
    parser.add_argument("--ring", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True, help="tokens a step")
    parser.add_argument("--json", action="store_true", help="the totals as JSON")
    parser.add_argument("--model", default="llama3.1-8b", help="a usp.models.PRESETS name")
    args = parser.parse_args(argv)
    result = measure(read_lengths(args.lengths), ulysses=args.ulysses, ring=args.ring,
                     seq_len=args.seq_len, model=args.model)  # fmt: skip
    if args.json:
        json.dump(result["totals"], sys.stdout, indent=2)
        print()
    else:
        print(text(result))
    return result


if __name__ == "__main__":
    main()
