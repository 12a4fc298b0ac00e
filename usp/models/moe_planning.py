"""The experts as ``usp plan`` measures them: ``top_k`` segments of every routed row and
the other experts' weight gradients held, instead of a loop over every expert.

Under fake tensors every op costs the same host time whatever its size, and
:func:`usp.models.moe_op.routed_experts`'s per-expert loop (``_run_swiglu``,
``_run_gpt_oss``: about ten ops an expert, each differentiated) was most of a planned
MoE step: one layout at 131,072 tokens on 8 ranks, three layers, took 48 s (gpt-oss-20b,
32 experts) and 360 s (Qwen3-30B-A3B, 128 experts) on a loaded machine. Fake tensors
cannot know the routing either, so the plan must hold what the worst routing holds.
Inside :func:`usp.planning_mode.representative_tiles`, on fake tensors
(:func:`usp.planning_mode.representative`), the experts run instead

* **the most uneven routing** (:func:`planned_segments`): the ``N`` tokens' ``M = N k``
  sorted rows on ``k = top_k`` experts, ``N`` rows each, none on the others: ``k``
  passes of the expert function instead of ``E`` (gpt-oss-20b 4 of 32, Qwen3-30B-A3B 8
  of 128), the same matmul FLOPs (linear in the rows: ``6 M`` times one expert's
  weights, the active parameters the step-time estimate counts);
* **a gradient hold** (:func:`hold_gradients`): from the first op of the experts'
  backward until their parameters' gradients are whole, one tensor the size of the
  ``E - k`` other experts' share of each parameter that takes a gradient.

Why this is never below the loop, whatever the routing ``c = (n_0, ..., n_{E-1})``: a
token's top-k experts are distinct, so ``0 <= n_e <= N`` and ``sum n_e = M = N k``.

1. *Rows.* Every tensor the loop allocates for expert ``e`` -- its segment's projections,
   activations, outputs, the saved tensors, their gradients -- has ``n_e`` rows, and
   which op runs when does not depend on ``c`` (an expert with no rows allocates
   nothing: a zero-row tensor has no bytes). So the bytes live at any one moment of the
   loop's forward or backward are an affine function of ``c``, and the loop's peak, the
   largest of them, is a convex function of ``c``. A convex function on a polytope is
   largest at a vertex; the vertices of ``{0 <= n_e <= N, sum n_e = N k}`` are the
   routings with ``k`` experts at ``N`` rows and the rest at 0. Every vertex allocates
   the same as the planned one (the experts' shapes are equal and the empty ones
   allocate nothing between the others). The memory outside the experts' ops (the
   gathered rows ``[M, H]``, the router, the weighted sum) does not depend on ``c``.
2. *Weights.* The one thing an expert allocates that is not linear in its rows is its
   weight gradient in the backward (and its biases', gpt-oss): the expert's share of
   each parameter, made when its backward runs and held until ``unbind``'s backward
   stacks every expert's into the parameter's gradient. The loop holds at most ``E``
   of them (every expert had rows); the planned run makes ``k`` and the hold is the
   other ``E - k``, live from before the first is made until after the stack (the
   planned run's stack takes expanded zeros for its empty experts).

So the planned peak is at least the loop's at every moment of the step; with every
token on the same ``k`` experts the loop's forward is the planned one.
``tests/planner/test_planner_moe.py`` measures both under the tracker (an even split,
the most uneven routings, a random one). On CUDA (bf16 on Hopper) and on the CPU
(float32, bf16) the real step runs ``torch._grouped_mm`` instead, which holds no
per-expert gradients and no concatenated copy of the outputs; that test compares a real
CPU step with the plan too.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from usp.planning_mode import representative

__all__ = [
    "GradientHold",
    "hold_gradients",
    "opened_by",
    "planned",
    "planned_routing",
    "planned_segments",
]


def planned(x: torch.Tensor) -> bool:
    """Whether the experts over ``x`` run as planned (:func:`representative`: inside
    the planner's mode, on fake tensors, not while compiling)."""
    return representative(x)


_TOP_K: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "usp_planned_top_k", default=None
)


@contextmanager
def planned_routing(top_k: int) -> Iterator[None]:
    """While inside, :func:`planned_segments` splits the rows of ``top_k`` experts per
    token (set by :func:`usp.models.moe_op.routed_experts` around the expert function)."""
    token = _TOP_K.set(top_k)
    try:
        yield
    finally:
        _TOP_K.reset(token)


def planned_segments(rows: int, experts: int) -> list[int]:
    """The segment sizes of the planned run (see the module docstring, 1.): ``top_k``
    experts with ``rows / top_k`` rows each, the others none; every row on the first
    expert where no ``top_k`` is known (a vertex of every routing too)."""
    top_k = _TOP_K.get() or 1
    return [rows // top_k] * top_k + [0] * (experts - top_k)


class GradientHold:
    """The bytes of the per-expert weight gradients the loop can hold beyond the planned
    run's own (see the module docstring, 2.): for each parameter ``[E, ...]`` that takes
    a gradient, a tensor ``[E - k, ...]``, allocated by :meth:`open` and released by
    :meth:`close`."""

    def __init__(self, params: Sequence[torch.Tensor], planned_experts: int):
        self.specs = [
            ((p.shape[0] - planned_experts, *p.shape[1:]), p.dtype)
            for p in params
            if p.requires_grad
        ]
        self.held: list[torch.Tensor] = []

    def open(self, like: torch.Tensor) -> None:
        self.held = [like.new_empty(shape, dtype=dtype) for shape, dtype in self.specs]

    def close(self) -> None:
        self.held = []


class _Open(torch.autograd.Function):
    """Identity on the experts' output; its backward (the first of the experts') opens
    the hold."""

    @staticmethod
    def forward(ctx, hidden, hold):
        ctx.hold = hold
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        ctx.hold.open(grad)
        return grad, None


class _Close(torch.autograd.Function):
    """Identity on the experts' parameters; its backward runs once every parameter's
    gradient is whole (after ``unbind``'s stack) and closes the hold."""

    @staticmethod
    def forward(ctx, hold, *params):
        ctx.hold = hold
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        ctx.hold.close()
        return (None, *grads)


def hold_gradients(params: Sequence[torch.Tensor], top_k: int):
    """``(hold, params)``: the experts' parameters (each ``[E, ...]``) as the planned
    run of ``top_k`` experts uses them (identities whose backward closes ``hold``), or
    ``(None, params)`` when none takes a gradient (then neither does any of the loop's).
    Pass the run's output through :func:`opened_by`."""
    if not any(p.requires_grad for p in params) or not torch.is_grad_enabled():
        return None, list(params)
    hold = GradientHold(params, top_k)
    return hold, list(_Close.apply(hold, *params))


def opened_by(hidden: torch.Tensor, hold: GradientHold | None) -> torch.Tensor:
    """The experts' output ``hidden`` [M, H], whose backward opens ``hold`` (unchanged
    for ``None``)."""
    return hidden if hold is None else _Open.apply(hidden, hold)
