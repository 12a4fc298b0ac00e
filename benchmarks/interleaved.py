"""Timing shared by the kernel benchmarks (``gdn_kernel.py``, ``mamba2_kernel.py``):
variants timed in turn, repeat after repeat (this VM moves single runs by 2x, and a
shared machine's load hits every variant alike), best of each; and what a ring pass
adds to one rank's layer under a ``fake`` process group."""

from __future__ import annotations

import time


def timed(fn) -> float:
    """Seconds ``fn()`` took (wall clock)."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def best_interleaved(variants: dict, repeats: int) -> dict[str, float]:
    """The best time of each of ``variants`` (name -> call) over ``repeats`` rounds, the
    variants interleaved within each round."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for name, fn in variants.items():
            best[name] = min(best[name], timed(fn))
    return best


def ring_pass_cost(run, ring_degree: int, repeats: int) -> tuple[dict[str, float], int]:
    """``run(plan)`` (one rank's layer, forward and backward as the caller decides) under
    a fake group of u1 x r``ring_degree`` (zigzag; collectives return at once: the
    compute the ring pass adds, not the wire) against ``run(None)`` (the same tokens
    alone): ({"ring": s, "alone": s} best interleaved, the bytes one run sends)."""
    import torch

    import usp
    from usp.process_groups.fake import fake_world

    with fake_world(ring_degree, 1, torch.device("cpu")):
        topo = usp.build_topology(1, ring_degree)
        try:
            plan = usp.Plan(topo, layout="zigzag")
            best = best_interleaved({"ring": lambda: run(plan), "alone": lambda: run(None)},
                                    repeats)  # fmt: skip
            topo.comm_stats.reset()
            run(plan)
            sent = topo.comm_stats.total_sent
        finally:
            topo.destroy()
    return best, sent
