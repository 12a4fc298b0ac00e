"""The exactness pattern of the linear mixers' distributed tests (KDA, the short conv,
Mamba-1): each grid runs the same three cases (zigzag dense, contiguous packed, zigzag
packed) on 4 ranks, and every rank's errors against the one-process reference and its
bytes against the planner's formula are checked."""

from __future__ import annotations

#: (layout, packed) of every grid's cases, in seed order
CASES = [("zigzag", False), ("contiguous", True), ("zigzag", True)]


def bytes_sent(forward: dict, backward: dict, planned: dict) -> tuple[dict, dict]:
    """(measured, formula): the bytes each kind of exchange sent in each direction (kinds
    that sent nothing left out), from ``comm_stats`` snapshots of the forward and the
    backward, and the same from the planner's ``planned`` (direction -> kind -> counts)."""
    measured = {
        direction: {kind: c.get("sent", 0) for kind, c in kinds.items() if c.get("sent", 0)}
        for direction, kinds in (("forward", forward), ("backward", backward))
    }
    formula = {d: {kind: c["sent"] for kind, c in kinds.items()} for d, kinds in planned.items()}
    return measured, formula


def grid_failures(distributed, run_case, grid, tolerance: float, timeout: float) -> list[str]:
    """``run_case(ulysses, ring, layout, packed, seed)`` -> (errors, measured, formula) on
    4 ranks for each of :data:`CASES`: a line for every error not below ``tolerance`` and
    every rank whose bytes differ from the formula."""
    failures = []
    for seed, case in enumerate(CASES):
        results = distributed.run(run_case, *grid, *case, seed, world_size=4, timeout=timeout)
        for rank, (errors, sent, formula) in enumerate(results):
            failures += [f"{grid} {case} r{rank} {n}: {e:.3g}" for n, e in errors.items()
                         if not e < tolerance]  # fmt: skip
            if sent != formula:
                failures.append(f"{grid} {case} r{rank} bytes {sent} != formula {formula}")
    return failures
