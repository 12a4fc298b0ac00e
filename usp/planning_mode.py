"""Whether a step is being planned: the context ``usp plan`` measures a fake-tensor step
in, read by the loops that run differently there (:mod:`usp.models.tiling`'s
representative tiles, the chunk loops of the gated delta rule in :mod:`usp.linear.kernel`
and of the scalar-decay scan in :mod:`usp.linear.scan`).

A leaf module (torch only), so that any part of usp can ask without importing
:mod:`usp.models`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

_REPRESENTATIVE = contextvars.ContextVar("usp_representative_tiles", default=False)


@contextmanager
def representative_tiles() -> Iterator[None]:
    """While inside, memory-periodic loops over fake tensors run their first and last
    tile only (:mod:`usp.models.tiling`), and the chunk loops of the gated delta rule and
    the scalar-decay scan are planned (:mod:`usp.linear.kernel`, :mod:`usp.linear.scan`);
    real tensors are unaffected."""
    token = _REPRESENTATIVE.set(True)
    try:
        yield
    finally:
        _REPRESENTATIVE.reset(token)


def representative(x: torch.Tensor) -> bool:
    """Whether a memory-periodic loop over ``x`` may run its representative tiles only:
    inside :func:`representative_tiles` and ``x`` a fake tensor. A loop decides this once
    (an autograd function in its forward, kept for its backward: the backward can run
    on another thread, which does not see the context). Always False while
    ``torch.compile`` traces (a compiled graph computes: it never plans)."""
    if torch.compiler.is_compiling():
        return False
    return _REPRESENTATIVE.get() and is_fake(x)


def planned_gradients(like: torch.Tensor, inputs, needs_input_grad) -> list:
    """A planned autograd function's gradients: for each input ``(shape, dtype)`` in
    ``inputs`` an uninitialised tensor on ``like``'s device where ``needs_input_grad``
    says so, else None (allocations only: what ``usp plan`` counts)."""
    return [like.new_empty(shape, dtype=dtype) if need else None
            for (shape, dtype), need in zip(inputs, needs_input_grad)]  # fmt: skip
