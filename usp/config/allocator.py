"""The CUDA caching allocator's settings a ``usp train`` rank runs with (no torch import):
in the config layer, so that the trainer and the planner both read this one rule.

``usp train`` turns on ``expandable_segments`` on CUDA unless ``PYTORCH_CUDA_ALLOC_CONF``
already names it (the user decided): segments then grow in place in 2 MiB pages, so
memory a long-context step frees is reused whatever size comes next, instead of
fragmenting fixed-size segments (PyTorch's documented remedy for "reserved but
unallocated" memory). Not measured on a GPU here: ``benchmarks/gpu_check.sh``'s
``overheads`` step compares reserved and allocated memory of a step with and without.
``usp plan`` reads the same rule to choose its allocator reserve
(:mod:`usp.planner.overheads`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

EXPANDABLE = "expandable_segments:True"


def allocator_settings(environ: Mapping[str, str] | None = None) -> str:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` a ``usp train`` rank runs with: the environment's
    when it names ``expandable_segments``, else the environment's with
    :data:`EXPANDABLE` added."""
    env = os.environ if environ is None else environ
    current = env.get("PYTORCH_CUDA_ALLOC_CONF", "").strip()
    if "expandable_segments" in current:
        return current
    return f"{current},{EXPANDABLE}" if current else EXPANDABLE


def expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :func:`allocator_settings` turns expandable segments on."""
    return EXPANDABLE in allocator_settings(environ).replace(" ", "")


def set_allocator_default(environ: MutableMapping[str, str] | None = None) -> str:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :func:`allocator_settings` in ``environ``
    (default ``os.environ``; before CUDA starts, which reads it once); returns it."""
    env = os.environ if environ is None else environ
    env["PYTORCH_CUDA_ALLOC_CONF"] = allocator_settings(env)
    return env["PYTORCH_CUDA_ALLOC_CONF"]
